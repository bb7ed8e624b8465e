"""How well does the cost model predict real times on this machine?

Section 1 (ops): for (op, shape) cases, the forward + backward time of one op with one
thread (median of interleaved repetitions) against ``node_cost(node, get_device("cpu"))``
after a quick calibration. Prints a table, the Spearman rank correlation and the median
absolute percentage error.

Section 2 (whole training steps of (model, plan) on 1, 2 and 4 ranks) is to be added as
``predict_vs_measure_steps()`` next to :func:`predict_vs_measure_ops`.

    .venv/bin/python bench/cost_model_accuracy.py [--reps 21] [--no-calibrate] [--profile PATH]
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from autopar.cost_models.calibrate import calibrate, load_profile, profile_path, summary
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--no-calibrate", action="store_true", help="use the existing profile")
    parser.add_argument("--profile", default=None, help=f"profile path (default {profile_path()})")
    args = parser.parse_args(argv)
    if args.profile:
        os.environ["AUTOPAR_PROFILE"] = args.profile
    print(f"# cost model accuracy, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}")
    if args.no_calibrate and load_profile() is not None:
        print("using the existing calibration profile")
    else:
        print(summary(calibrate(quick=True)))
    print("\n## ops: forward + backward, 1 thread")
    print(format_ops(predict_vs_measure_ops(get_device("cpu"), reps=args.reps)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
