"""Elastic training under torchrun: a rank that dies restarts the job from the last checkpoint, and the
run ends with the parameters an uninterrupted run ends with, bit for bit.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 4 --max-restarts 3 \\
        examples/resume.py --steps 40 --ckpt-dir /tmp/ckpt --save-every 5 --out final.pt \\
        [--kill-rank 2 --kill-at-step 17]

A small GPT trains with AdamW on batches made from the step index alone, so a resumed run sees the
batches the killed one would have. Every ``--save-every`` steps ``CheckpointManager`` saves
``step-<k>`` (model, optimizer, RNG, step) and keeps the newest ``--keep``; on start every attempt
resumes from the newest complete one. ``--kill-rank R --kill-at-step T`` makes rank R SIGKILL itself
at the start of step T, on the first attempt only (``TORCHELASTIC_RESTART_COUNT`` is 0); torchrun then
stops the other ranks and starts all of them again. The plan the first attempt used is kept in the
checkpoint directory (``plan.json``) and reused, so an AUTO plan (re-timed at each start) cannot change
under a resumed run. Rank 0 writes the final ``pmodel.full_state_dict()`` to ``--out``.
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: without it torchrun hands restarted ranks a store that still
holds their dead predecessors' addresses (``autopar.runtime.resume.check_restartable`` says so).

Lines starting with ``elastic:`` (rank 0, and the rank that kills itself) say what happened, with
wall-clock times: tests read them.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autopar  # noqa: E402
from autopar.runtime.launch import init_from_env  # noqa: E402
from examples.models import GPT, lm_loss  # noqa: E402

VOCAB, SEQ, BATCH = 64, 8, 8


def batch(step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (1-based): a function of the step index only."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def log(msg: str) -> None:
    print(f"elastic: {msg} t={time.time():.3f}", flush=True)


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, required=True, help="training steps in all")
    ap.add_argument("--ckpt-dir", required=True, help="directory of the step-<k> checkpoints")
    ap.add_argument("--save-every", type=int, required=True, help="save a checkpoint every K steps")
    ap.add_argument("--keep", type=int, default=2, help="keep the newest N checkpoints (default 2)")
    ap.add_argument("--out", help="rank 0 writes the final full state dict here (torch.save)")
    ap.add_argument("--mode", default="data", help="parallel mode of the first attempt (default data)")
    ap.add_argument("--mesh", default=None, help="mesh shape, e.g. 2x2 (default: one axis of all ranks)")
    ap.add_argument("--plan", default=None, help="a plan JSON to use instead of planning")
    ap.add_argument("--seed", type=int, default=0, help="model and data seed")
    ap.add_argument("--dropout", type=float, default=0.1, help="dropout (exercises the restored RNG)")
    ap.add_argument("--timeout", type=float, default=30.0,
                    help="process-group timeout in seconds: how long a rank waits on a dead peer at most")
    ap.add_argument("--kill-rank", type=int, default=None, help="rank that SIGKILLs itself (first attempt only)")
    ap.add_argument("--kill-at-step", type=int, default=None, help="at the start of this step (1-based)")
    args = ap.parse_args(argv)
    if (args.kill_rank is None) != (args.kill_at_step is None):
        ap.error("--kill-rank and --kill-at-step go together")
    return args


def make_model(args) -> torch.nn.Module:
    torch.manual_seed(args.seed)
    return GPT(vocab=VOCAB, hidden=32, heads=2, layers=2, seq=SEQ, dropout=args.dropout, qkv_bias=False)


def main(argv=None) -> None:
    args = parse(argv)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if os.environ.get("RANK", "0") == "0":
        log(f"attempt {attempt} imported")
    made_group = init_from_env(timeout_s=args.timeout)      # False inside a group that already exists
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if rank == 0:
        log(f"attempt {attempt} joined a group of {world} ranks")
    ckpts = autopar.CheckpointManager(args.ckpt_dir, every=args.save_every, keep=args.keep)
    kept_plan = Path(args.ckpt_dir) / "plan.json"
    plan = args.plan or (str(kept_plan) if kept_plan.is_file() else None)

    model = make_model(args)
    mesh = autopar.Mesh(tuple(int(n) for n in args.mesh.split("x")) if args.mesh else world)
    x0, y0 = batch(1, args.seed)
    pmodel = autopar.parallelize(model, mesh, example_inputs=(x0,), loss_fn=lm_loss, example_target=y0,
                                 mode=None if plan else args.mode, plan=plan)
    if rank == 0 and plan is None:
        kept_plan.parent.mkdir(parents=True, exist_ok=True)
        pmodel.plan.save(kept_plan)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-2)
    if rank == 0:
        log(f"attempt {attempt} built its module")

    done = ckpts.resume(pmodel, opt)
    if rank == 0:
        log(f"attempt {attempt} resumed at step {done}" if done else f"attempt {attempt} starts from step 0")
    loss = None
    for step in range(done + 1, args.steps + 1):
        if attempt == 0 and rank == args.kill_rank and step == args.kill_at_step:
            log(f"rank {rank} kills itself at step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(step, args.seed)
        loss = pmodel.step(x, target=y)
        opt.step()
        opt.zero_grad()
        if ckpts.maybe_save(pmodel, opt, step) and rank == 0:
            log(f"saved step {step} loss {loss.item():.6f}")
        if step == done + 1 and rank == 0:
            log(f"attempt {attempt} trained step {step}")

    final = pmodel.full_state_dict()
    if rank == 0:
        if args.out:
            torch.save(final, args.out)
        log(f"attempt {attempt} finished {args.steps} steps" + (f", loss {loss.item():.6f}" if loss is not None else ""))
    if made_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
