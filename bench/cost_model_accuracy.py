"""How well does the cost model predict real times on this machine?

Section 1 (ops): for (op, shape) cases, the forward + backward time of one op with one
thread (median of interleaved repetitions) against ``node_cost(node, get_device("cpu"))``
after a quick calibration. Prints a table, the Spearman rank correlation and the median
absolute percentage error.

Section 2 (steps): whole training steps (forward, backward, AdamW) of (model, plan) pairs on
1, 2 and 4 gloo ranks, one thread each: ``plan.step_time`` against the median measured step
(the cases of one world size interleaved). Prints a table, the Spearman rank correlation and
the median absolute percentage error.

The calibration profile goes to a temp file (``--profile`` to choose) which this process
and its ranks use through ``AUTOPAR_PROFILE``; the machine's default profile is untouched.

    .venv/bin/python bench/cost_model_accuracy.py [--quick] [--reps 21] [--step-reps 9]
        [--no-calibrate] [--profile PATH] [--skip-ops] [--skip-steps]
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tp_models

from autopar.cost_models.calibrate import calibrate, summary
from autopar.cost_models.profile import load_profile, profile_path
from autopar.cost_models.compute import node_cost
from autopar.cost_models.devices import DeviceSpec, get_device


class OpCase(nn.Module):
    """One op; its float operands are parameters so both the trace and the real run need
    their gradients, its integer operands are inputs."""

    def __init__(self, fn: Callable, floats: Sequence[torch.Tensor]):
        super().__init__()
        self.fn = fn
        self.operands = nn.ParameterList([nn.Parameter(t) for t in floats])

    def forward(self, *ints):
        return self.fn(*self.operands, *ints)


@dataclass(frozen=True)
class Case:
    name: str
    shape: str
    op: object  # the aten op whose node is costed
    build: Callable[[], tuple[Callable, list[torch.Tensor], list[torch.Tensor]]]


def _r(*shape):
    return torch.randn(*shape)


CASES = [
    Case("linear", "64x512 -> 512", torch.ops.aten.linear.default,
         lambda: (lambda x, w, b: F.linear(x, w, b), [_r(64, 512), _r(512, 512), _r(512)], [])),
    Case("linear", "256x1024 -> 1024", torch.ops.aten.linear.default,
         lambda: (lambda x, w, b: F.linear(x, w, b), [_r(256, 1024), _r(1024, 1024), _r(1024)], [])),
    Case("linear", "1024x1024 -> 2048", torch.ops.aten.linear.default,
         lambda: (lambda x, w, b: F.linear(x, w, b), [_r(1024, 1024), _r(2048, 1024), _r(2048)], [])),
    Case("mm", "128x128 @ 128x128", torch.ops.aten.mm.default,
         lambda: (torch.mm, [_r(128, 128), _r(128, 128)], [])),
    Case("bmm", "16x128x64 @ 16x64x128", torch.ops.aten.bmm.default,
         lambda: (torch.bmm, [_r(16, 128, 64), _r(16, 64, 128)], [])),
    Case("layer_norm", "32x128x512", torch.ops.aten.layer_norm.default,
         lambda: (lambda x, w, b: F.layer_norm(x, (512,), w, b), [_r(32, 128, 512), _r(512), _r(512)], [])),
    Case("gelu", "32x128x512", torch.ops.aten.gelu.default, lambda: (F.gelu, [_r(32, 128, 512)], [])),
    Case("relu", "32x128x512", torch.ops.aten.relu.default, lambda: (F.relu, [_r(32, 128, 512)], [])),
    Case("softmax", "8x8x128x128", torch.ops.aten.softmax.int,
         lambda: (lambda x: x.softmax(-1), [_r(8, 8, 128, 128)], [])),
    Case("sdpa", "b2 h8 s256 d64 causal", torch.ops.aten.scaled_dot_product_attention.default,
         lambda: (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                  [_r(2, 8, 256, 64), _r(2, 8, 256, 64), _r(2, 8, 256, 64)], [])),
    Case("conv2d", "8x16x32x32, 3x3 -> 32", torch.ops.aten.conv2d.default,
         lambda: (lambda x, w: F.conv2d(x, w, padding=1), [_r(8, 16, 32, 32), _r(32, 16, 3, 3)], [])),
    Case("batch_norm", "8x32x32x32", torch.ops.aten.batch_norm.default,
         lambda: (lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
                  [_r(8, 32, 32, 32), _r(32), _r(32)], [])),
    Case("embedding", "V=10000 h=256, 16x128", torch.ops.aten.embedding.default,
         lambda: (lambda w, i: F.embedding(i, w), [_r(10000, 256)], [torch.randint(0, 10000, (16, 128))])),
    Case("add", "32x128x512", torch.ops.aten.add.Tensor,
         lambda: (torch.add, [_r(32, 128, 512), _r(32, 128, 512)], [])),
    Case("mul", "1000 (tiny)", torch.ops.aten.mul.Tensor, lambda: (torch.mul, [_r(1000), _r(1000)], [])),
    Case("cross_entropy", "512x5000", torch.ops.aten.cross_entropy_loss.default,
         lambda: (lambda x, t: F.cross_entropy(x, t), [_r(512, 5000)], [torch.randint(0, 5000, (512,))])),
]


@dataclass(frozen=True)
class Row:
    name: str
    shape: str
    predicted: float  # seconds, forward + backward
    measured: float  # seconds, median

    @property
    def error(self) -> float:
        """Signed relative error ``(predicted - measured) / measured``."""
        return (self.predicted - self.measured) / self.measured


def _node(gm: torch.fx.GraphModule, op) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.target is op)


def _step(model: OpCase, ints: list[torch.Tensor]) -> Callable[[], None]:
    params = list(model.parameters())

    def run():
        out = model(*ints)
        torch.autograd.grad(out, params, torch.ones_like(out))

    return run


def predict_vs_measure_ops(
    device: DeviceSpec | None = None, reps: int = 21, cases: Sequence[Case] = CASES
) -> list[Row]:
    """Predicted and measured forward + backward seconds of each case (1 thread).

    Measured: median over ``reps`` rounds, each round timing every case once
    (interleaved, so drifts of a shared machine hit all cases alike). The time includes
    the harness (module call, ``autograd.grad`` set-up, ~0.1-0.2 ms), which dominates only
    the tiniest cases.
    """
    device = device or get_device("cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        runs, predictions = [], []
        for case in cases:
            fn, floats, ints = case.build()
            model = OpCase(fn, floats)
            gm = torch.export.export(model, tuple(ints), strict=False).graph_module
            predictions.append(node_cost(_node(gm, case.op), device).time_total)
            runs.append(_step(model, ints))
        for run in runs * 2:  # warm up
            run()
        times: list[list[float]] = [[] for _ in runs]
        for _ in range(reps):
            for i, run in enumerate(runs):
                t0 = time.perf_counter()
                run()
                times[i].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return [Row(c.name, c.shape, p, statistics.median(t)) for c, p, t in zip(cases, predictions, times)]


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation (Pearson correlation of the ranks; no ties expected)."""
    ra = np.argsort(np.argsort(a)).astype(float)
    rb = np.argsort(np.argsort(b)).astype(float)
    return float(np.corrcoef(ra, rb)[0, 1])


def median_abs_pct_error(rows: Sequence[Row]) -> float:
    return 100.0 * statistics.median(abs(r.error) for r in rows)


def format_ops(rows: Sequence[Row]) -> str:
    lines = [f"{'op':<14}{'shape':<26}{'predicted ms':>14}{'measured ms':>14}{'error %':>10}"]
    for r in rows:
        lines.append(
            f"{r.name:<14}{r.shape:<26}{r.predicted * 1e3:>14.3f}{r.measured * 1e3:>14.3f}{100 * r.error:>10.1f}"
        )
    pred, meas = [r.predicted for r in rows], [r.measured for r in rows]
    lines.append(f"cases: {len(rows)}   Spearman rank correlation: {spearman(pred, meas):.3f}   "
                 f"median |error|: {median_abs_pct_error(rows):.1f} %   "
                 f"log10 ratio sd: {statistics.pstdev(math.log10(p / m) for p, m in zip(pred, meas)):.2f}")
    return "\n".join(lines)


# ---- section 2: whole training steps ------------------------------------------------------

STEP_MODELS = {
    "mlp": {"kind": "mlp", "d": 1024, "ffn": 4096, "depth": 2, "batch": 64},
    "mlp-small": {"kind": "mlp", "d": 512, "ffn": 2048, "depth": 2, "batch": 32},
    "gpt": {"kind": "gpt", "vocab": 1024, "hidden": 256, "heads": 8, "layers": 4, "seq": 128, "batch": 16},
    "blocks": {"kind": "blocks", "hidden": 256, "heads": 8, "layers": 4, "seq": 128, "batch": 8},
}

# (model, mode, world): STAND_ALONE on 1 rank; DATA and TP (a named "tp" mesh, mode auto) on 2 and 4
STEP_CASES = [
    ("mlp", "stand_alone", 1), ("mlp-small", "stand_alone", 1), ("gpt", "stand_alone", 1),
    ("blocks", "stand_alone", 1),
    ("mlp", "data", 2), ("gpt", "data", 2), ("mlp", "tp", 2), ("blocks", "tp", 2),
    ("mlp", "data", 4), ("gpt", "data", 4), ("mlp", "tp", 4), ("blocks", "tp", 4), ("mlp-small", "tp", 4),
]
QUICK_STEP_CASES = [("mlp", "stand_alone", 1), ("gpt", "stand_alone", 1), ("mlp", "data", 2), ("mlp", "tp", 2),
                    ("mlp", "data", 4), ("gpt", "data", 4), ("mlp", "tp", 4)]


def _build_step_model(spec: dict):
    from examples.models import GPT, lm_loss
    from tp_models import BlockStack, WideMLP

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if spec["kind"] == "gpt":
        model = GPT(vocab=spec["vocab"], hidden=spec["hidden"], heads=spec["heads"], layers=spec["layers"],
                    seq=spec["seq"])
        x = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=g)
        return model, x, torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=g), lm_loss
    if spec["kind"] == "mlp":
        model = WideMLP(spec["d"], spec["ffn"], spec["depth"])
        x = torch.randn(spec["batch"], spec["d"], generator=g)
    else:
        model = BlockStack(spec["hidden"], spec["heads"], spec["layers"])
        x = torch.randn(spec["batch"], spec["seq"], spec["hidden"], generator=g)
    return model, x, torch.randn(x.shape, generator=g), F.mse_loss


def _rank_steps(rank: int, cases: list, reps: int, warmup: int) -> list[dict]:
    """On every rank of one world size: build each case, then time training steps of all
    cases interleaved. Per step: fwd+bwd (``pmodel.step``) and optimizer (AdamW step +
    zero_grad) separately; the slowest rank's time counts."""
    import autopar
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    runs = []
    for name, mode, _ in cases:
        model, x, y, loss_fn = _build_step_model(STEP_MODELS[name])
        mesh = autopar.Mesh(world, axis_names=("tp",)) if mode == "tp" else autopar.Mesh(world)
        pmodel = autopar.parallelize(model, mesh, example_inputs=(x,), loss_fn=loss_fn, example_target=y,
                                     mode="auto" if mode == "tp" else mode)
        opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
        runs.append((pmodel, opt, x, y))
    fb = [[] for _ in runs]
    op = [[] for _ in runs]
    for r in range(warmup + reps):
        for i, (pmodel, opt, x, y) in enumerate(runs):
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            pmodel.step(x, target=y)
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            t2 = time.perf_counter()
            if r >= warmup:
                fb[i].append(t1 - t0)
                op[i].append(t2 - t1)
    if world > 1:
        t = torch.tensor([fb, op], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        fb, op = t[0].tolist(), t[1].tolist()
    out = []
    for (pmodel, _, _, _), f, o in zip(runs, fb, op):
        plan = pmodel.plan
        out.append({"predicted": plan.step_time, "fwd_bwd": statistics.median(f), "optimizer": statistics.median(o),
                    "step": statistics.median(a + b for a, b in zip(f, o)), "degrees": dict(plan.degrees),
                    "n_coll": len(plan.collectives(0))})
    return out


@dataclass(frozen=True)
class StepRow:
    model: str
    mode: str
    world: int
    predicted: float
    measured: float      # median seconds of a whole step (fwd + bwd + optimizer)
    fwd_bwd: float
    optimizer: float
    degrees: str

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured


def predict_vs_measure_steps(cases: Sequence[tuple] = STEP_CASES, reps: int = 9, warmup: int = 2) -> list[StepRow]:
    """Predicted ``plan.step_time`` vs measured whole training steps, per world size one
    spawned gloo group (1 thread per rank), the cases of a world size interleaved."""
    from autopar.runtime.launch import RankPool

    rows = []
    for world in sorted({c[2] for c in cases}):
        group = [c for c in cases if c[2] == world]
        pool = RankPool(world, timeout_s=600)
        try:
            res = pool.run(_rank_steps, group, reps, warmup, timeout_s=1200)[0]
        finally:
            pool.close()
        for (name, mode, _), r in zip(group, res):
            deg = ",".join(f"{k}{v}" for k, v in r["degrees"].items() if v > 1) or "1"
            rows.append(StepRow(name, mode, world, r["predicted"], r["step"], r["fwd_bwd"], r["optimizer"], deg))
    return rows


def format_steps(rows: Sequence[StepRow]) -> str:
    lines = [f"{'model':<10}{'mode':<12}{'ranks':>6}{'plan':>10}{'predicted ms':>14}{'measured ms':>13}"
             f"{'(fwd+bwd':>10}{'+ optim)':>10}{'error %':>9}"]
    for r in rows:
        lines.append(f"{r.model:<10}{r.mode:<12}{r.world:>6}{r.degrees:>10}{r.predicted * 1e3:>14.1f}"
                     f"{r.measured * 1e3:>13.1f}{r.fwd_bwd * 1e3:>10.1f}{r.optimizer * 1e3:>10.1f}{100 * r.error:>9.1f}")
    pred, meas = [r.predicted for r in rows], [r.measured for r in rows]
    lines.append(f"steps: {len(rows)}   Spearman rank correlation: {spearman(pred, meas):.3f} (target >= 0.9)   "
                 f"median |error|: {100 * statistics.median(abs(r.error) for r in rows):.1f} % (target <= 25)   "
                 f"median signed error: {100 * statistics.median(r.error for r in rows):+.1f} %")
    for w in sorted({r.world for r in rows}):
        sub = [r for r in rows if r.world == w]
        lines.append(f"  {w} rank(s): median signed error {100 * statistics.median(r.error for r in sub):+.1f} %, "
                     f"median measured/predicted {statistics.median(r.measured / r.predicted for r in sub):.2f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--step-reps", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="fewer op reps and step cases (~3 min)")
    parser.add_argument("--no-calibrate", action="store_true", help="use the existing profile")
    parser.add_argument("--profile", default=None,
                        help="profile path (default: a file in the temp dir, so that this benchmark never "
                             f"replaces the machine's profile at {profile_path()})")
    parser.add_argument("--skip-ops", action="store_true")
    parser.add_argument("--skip-steps", action="store_true")
    args = parser.parse_args(argv)
    os.environ["AUTOPAR_PROFILE"] = args.profile or os.path.join(tempfile.gettempdir(), "autopar_bench_cpu_profile.json")
    print(f"# cost model accuracy, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}")
    if args.no_calibrate and load_profile() is not None:
        print(f"using the existing calibration profile {profile_path()}")
    else:
        print(summary(calibrate(quick=True)))
    if not args.skip_ops:
        print("\n## ops: forward + backward, 1 thread")
        print(format_ops(predict_vs_measure_ops(get_device("cpu"), reps=5 if args.quick else args.reps)))
    if not args.skip_steps:
        cases = QUICK_STEP_CASES if args.quick else STEP_CASES
        reps = args.step_reps or (5 if args.quick else 9)
        print(f"load average before: {os.getloadavg()[0]:.1f} (other processes on this machine slow every rank)")
        print(f"\n## whole training steps (fwd + bwd + AdamW), gloo, 1 thread per rank on {os.cpu_count()} cores, "
              f"{reps} interleaved rounds per world size")
        print(format_steps(predict_vs_measure_steps(cases, reps=reps)))
        print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
