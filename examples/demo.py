"""The README's main job: a small GPT trained across 4 CPU processes, checked against one process.

Run with ``make demo`` or ``autopar demo [--mode auto] [--nprocs 4] [--steps 5]``.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

import autopar
from examples.models import GPT, lm_loss
from examples.progress import Progress

VOCAB, SEQ, BATCH = 256, 32, 8


def make_model():
    torch.manual_seed(0)
    return GPT(vocab=VOCAB, hidden=128, heads=4, layers=4, seq=SEQ, qkv_bias=False)


def make_data(steps):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(steps)]


def train_single(steps):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    with Progress(steps, "single process") as bar:
        for x, y in make_data(steps):
            loss = lm_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            bar.update(loss=losses[-1])
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def rank_main(rank, mode, steps, out_path):
    data = make_data(steps)
    x0, y0 = data[0]
    pmodel = autopar.parallelize(make_model(), autopar.Mesh(torch.distributed.get_world_size()),
                                 example_inputs=(x0,), loss_fn=lm_loss, example_target=y0, mode=mode)
    if rank == 0:
        print(pmodel.plan.report(), flush=True)
        print("\nrank 0 program (first lines):\n" + "\n".join(pmodel.code.strip().splitlines()[:25]) + "\n  ...",
              flush=True)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    losses = []
    bar = Progress(steps, f"{torch.distributed.get_world_size()} processes") if rank == 0 else None
    for x, y in data:
        loss = pmodel.step(x, target=y)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if bar is not None:
            bar.update(loss=losses[-1])
    if bar is not None:
        bar.close()
    state = pmodel.full_state_dict()
    if rank == 0:
        torch.save({"losses": losses, "state": state}, out_path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="autopar demo", description=__doc__)
    ap.add_argument("--mode", default="auto")
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        print(f"training a {sum(p.numel() for p in make_model().parameters())/1e6:.2f}M-parameter GPT on "
              f"{args.nprocs} CPU processes, mode {args.mode}\n", flush=True)
        autopar.launch(rank_main, nprocs=args.nprocs, args=(args.mode, args.steps, out))
        result = torch.load(out)
    ref_losses, ref_state = train_single(args.steps)
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], ref_losses))
    param_rel = max(((result["state"][k] - v).norm() / v.norm().clamp_min(1e-12)).item()
                    for k, v in ref_state.items() if v.is_floating_point())
    print(f"\nparallel losses:       {[round(v, 6) for v in result['losses']]}")
    print(f"single-process losses: {[round(v, 6) for v in ref_losses]}")
    print(f"max relative difference vs single process: loss {loss_rel:.2e}, parameters {param_rel:.2e}")
    ok = loss_rel <= 1e-5 and param_rel <= 1e-5
    print("OK: parallel training equals single-device training" if ok else "MISMATCH: above 1e-5 relative")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
