"""autopar pipeline parallelism vs torch.distributed.pipelining, same model, split and schedule.

    .venv/bin/python bench/pipeline.py [--reps 10] [--ranks 2,4]

A Llama-style model (untied embeddings: torch's pipelining has no tied-weight sync) is cut at
the same layer boundaries on both sides: autopar through ``pipeline_stage`` tags (SEMI_AUTO on
a ``("pp",)`` mesh), torch through hand-written stage modules wrapped in ``PipelineStage`` and
driven by ``ScheduleGPipe`` / ``Schedule1F1B`` with the same microbatch count. Both train with
AdamW; a timed call is one step (forward+backward of every microbatch, optimizer step).
Contenders run interleaved (bench/common.py); the figure is the ratio of medians
autopar / torch (target <= 1.05). The first step's losses are compared as a sanity check.
"""
from __future__ import annotations

import argparse
import sys

from common import ROOT, interleaved, quartiles  # noqa: F401  (ROOT puts the repo on sys.path)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import autopar  # noqa: E402
from autopar.runtime.launch import RankPool  # noqa: E402
from examples.models import Llama, lm_loss  # noqa: E402

CFG = dict(vocab=512, hidden=192, heads=6, layers=8, seq=64, ffn=512)
BATCH = 16


def _model() -> Llama:
    torch.manual_seed(0)
    return Llama(**CFG)


def _batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, CFG["vocab"], (BATCH, CFG["seq"]), generator=g)
    return x, torch.randint(0, CFG["vocab"], (BATCH, CFG["seq"]), generator=g)


class Part(nn.Module):
    """Layers [lo, hi) of a Llama, with the embedding on the first part and the head on the last."""

    def __init__(self, model: Llama, lo: int, hi: int):
        super().__init__()
        self.first, self.last = lo == 0, hi == len(model.layers)
        self.embed = model.embed if self.first else None
        self.layers = nn.ModuleList(model.layers[lo:hi])
        self.norm, self.out = (model.norm, model.out) if self.last else (None, None)
        self.register_buffer("cos", model.cos, persistent=False)
        self.register_buffer("sin", model.sin, persistent=False)

    def forward(self, x):
        if self.first:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return self.out(self.norm(x)) if self.last else x


_STATE: dict = {}


def _setup(rank: int, pp: int, schedule: str, m: int) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    x, y = _batch()
    per = CFG["layers"] // pp
    autopar.clear_annotations()
    autopar.reset_auto_parallel_context()
    model = _model()
    for k in range(1, pp):
        autopar.pipeline_stage(model.layers[k * per], k)
    autopar.set_auto_parallel_context(schedule=schedule, microbatches=m)
    pm = autopar.parallelize(model, autopar.Mesh((pp,), axis_names=("pp",)), example_inputs=(x,), loss_fn=lm_loss,
                             example_target=y, mode="semi_auto")
    autopar.clear_annotations()
    opt_a = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    part = Part(_model(), rank * per, (rank + 1) * per)
    stage = PipelineStage(part, rank, pp, torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = cls(stage, m, loss_fn=lm_loss)
    opt_t = torch.optim.AdamW(part.parameters(), lr=1e-4)

    def step_autopar():
        loss = pm.step(x, target=y)
        opt_a.step()
        opt_a.zero_grad()
        return float(loss)

    def step_torch():
        losses = []
        if rank == 0:
            sched.step(x)
        elif rank == pp - 1:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        opt_t.step()
        opt_t.zero_grad()
        return float(torch.stack(losses).detach().mean()) if losses else None

    _STATE.update(autopar=step_autopar, torch=step_torch)
    return {"layers": [s.layers for s in pm.plan.stages], "loss_autopar": step_autopar(), "loss_torch": step_torch()}


def _measure(rank: int, reps: int) -> dict:
    return interleaved({"autopar": _STATE["autopar"], "torch": _STATE["torch"]}, reps, warmup=2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ranks", default="2,4")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"model Llama {CFG}, global batch {BATCH}; step = fwd+bwd of all microbatches + AdamW; "
          f"{args.reps} interleaved rounds; times are the slowest rank's")
    print(f"{'ranks':>5} {'schedule':>9} {'m':>3} {'autopar ms':>11} {'torch ms':>9} {'ratio':>6}  "
          f"{'paired ratio q1/med/q3':>24}  losses (autopar, torch)")
    for n in [int(v) for v in args.ranks.split(",")]:
        pool = RankPool(n, timeout_s=300)
        try:
            for schedule, m in (("gpipe", 4), ("1f1b", 4), ("1f1b", 8)):
                infos = pool.run(_setup, n, schedule, m)
                info = dict(infos[0], loss_torch=infos[-1]["loss_torch"])
                t = pool.run(_measure, args.reps)[0]
                a, b = t["autopar"], t["torch"]
                med_a, med_b = sorted(a)[len(a) // 2], sorted(b)[len(b) // 2]
                q = quartiles([x / y for x, y in zip(a, b)])
                print(f"{n:>5} {schedule:>9} {m:>3} {med_a * 1e3:>11.1f} {med_b * 1e3:>9.1f} {med_a / med_b:>6.3f}  "
                      f"{q[0]:>7.3f}/{q[1]:.3f}/{q[2]:.3f}  ({info['loss_autopar']:.5f}, {info['loss_torch']:.5f}) "
                      f"stages {[s[0] for s in info['layers']]}", flush=True)
        finally:
            pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

