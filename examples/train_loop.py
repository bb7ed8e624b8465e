"""A complete training loop on a Dataset: each rank loads its part of every global batch
(``autopar.DataParallelLoader``), an LR schedule, gradient clipping across shards, a progress bar, and
a checkpoint of model, optimizer, scheduler and data position that resumes mid-epoch.

    python -m examples.train_loop --nprocs 4 --stop-after 10   # trains 10 steps, checkpointing every 4
    python -m examples.train_loop --nprocs 4 --resume          # goes on from the last checkpoint (step 8)
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from torch.utils.data import TensorDataset

import autopar
from examples.models import GPT, lm_loss
from examples.progress import Progress

VOCAB, SEQ, BATCH, SAMPLES = 128, 16, 16, 256


def make_dataset() -> TensorDataset:
    """Sequences of a noisy counting pattern (token t+1 follows t), so the loss visibly falls."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, VOCAB, (SAMPLES, 1), generator=g)
    tokens = (start + torch.arange(SEQ + 1)) % VOCAB
    noise = torch.rand(tokens.shape, generator=g) < 0.1
    tokens = torch.where(noise, torch.randint(0, VOCAB, tokens.shape, generator=g), tokens)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def rank_main(rank: int, args) -> None:
    data = make_dataset()
    torch.manual_seed(0)
    model = GPT(vocab=VOCAB, hidden=64, heads=4, layers=2, seq=SEQ, qkv_bias=False)
    x0, y0 = data[:BATCH]
    pmodel = autopar.parallelize(model, autopar.Mesh(torch.distributed.get_world_size()), example_inputs=(x0,),
                                 loss_fn=lm_loss, example_target=y0, mode=args.mode)
    loader = autopar.DataParallelLoader(data, pmodel, shuffle=True, seed=0, num_workers=1)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=3e-3, weight_decay=0.01)
    total = args.epochs * loader.batch_sampler.batches_per_epoch
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=total)
    ckpt = os.path.join(args.dir, "ckpt")
    step = 0
    if args.resume and os.path.isdir(ckpt):
        step = pmodel.load(ckpt, optimizer=opt)
        with open(os.path.join(args.dir, "loop.json")) as f:
            saved = json.load(f)
        sched.load_state_dict(saved["scheduler"])
        loader.load_state_dict(saved["data"])
    if rank == 0:
        print(f"plan: {pmodel.plan.degrees}, data-parallel size {pmodel.data_parallel_size}, "
              f"{total} steps, starting at step {step}", flush=True)
    for epoch in range(loader.batch_sampler.epoch, args.epochs):
        loader.set_epoch(epoch)                 # keeps a resumed mid-epoch position
        bar = Progress(len(loader), f"epoch {epoch}") if rank == 0 else None
        for x, y in loader:
            loss = pmodel.step(x, target=y, local_batch=True)
            norm = pmodel.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            sched.step()
            step += 1
            if bar is not None:
                bar.update(loss=loss.item(), grad_norm=float(norm))
            if step % args.save_every == 0 or step == total:
                pmodel.save(ckpt, optimizer=opt, step=step)
                if rank == 0:
                    with open(os.path.join(args.dir, "loop.json"), "w") as f:
                        json.dump({"scheduler": sched.state_dict(), "data": loader.state_dict()}, f)
            if step == args.stop_after:
                break
        if bar is not None:
            bar.close()
        if step == args.stop_after:
            return


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--mode", default="auto")
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "autopar_train_loop"))
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--stop-after", type=int, default=-1, help="stop after this many steps (then try --resume)")
    args = ap.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    autopar.launch(rank_main, nprocs=args.nprocs, args=(args,))


if __name__ == "__main__":
    main()
