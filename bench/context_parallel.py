"""Benchmark (issue 35): context parallelism on 4 CPU ranks against one process, on one long sequence.

A causal GPT (``examples.models.GPT``, sdpa attention) on a batch of ONE sequence of ``--seq``
tokens: nothing for data parallelism to split. Contenders, timed interleaved in one process group
(``bench/common.interleaved``: a barrier before each call, the slowest rank's time):

* ``one``: the plain model trained on rank 0 alone (the other ranks wait at the barrier);
* ``cp4-gather``: autopar on ``Mesh(4, axis_names=("cp",))``, the input split along the sequence,
  attention in its all-gather-K/V form;
* ``cp4-ring``: the same plan with attention switched to ring attention (HYBRID).

Per contender and rank: the peak of autograd's saved activations (``memory_measure.SavedTensorMeter``)
and the peak of every live storage during a step (``memory_measure.live_peak``: temporaries too, the
gathered K/V of the gather form); the first losses (equal to one process's, the split is exact).
torch's own ``context_parallel`` (``torch.distributed.tensor.experimental``) is not a contender: it
rewrites the CUDA SDPA kernels (flash, efficient, cuDNN) and has no CPU path.

    PYTHONPATH=. .venv/bin/python bench/context_parallel.py [--seq 4096] [--reps 8]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import Ratio, header, interleaved  # noqa: E402


def _model(cfg: dict):
    from examples.models import GPT

    torch.manual_seed(0)
    return GPT(vocab=cfg["vocab"], hidden=cfg["hidden"], heads=cfg["heads"], layers=cfg["layers"], seq=cfg["seq"])


class _Plain:
    """The one-process contender with the ``step`` / ``parameters`` a ParallelModule has."""

    def __init__(self, model, loss_fn):
        self.model, self.loss_fn = model, loss_fn

    def parameters(self):
        return self.model.parameters()

    def step(self, x, target):
        loss = self.loss_fn(self.model(x), target)
        loss.backward()
        return loss.detach()


def rank_run(rank: int, cfg: dict, reps: int, warmup: int) -> dict:
    import torch.distributed as dist

    import autopar
    from bench.memory_measure import live_peak, measure_step
    from examples.models import lm_loss

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg["vocab"], (1, cfg["seq"]), generator=g)
    y = torch.randint(0, cfg["vocab"], (1, cfg["seq"]), generator=g)
    mesh = autopar.Mesh(4, axis_names=("cp",))
    autopar.shard_input(0, {"cp": autopar.Shard(1)})
    plan = autopar.plan(_model(cfg), mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, mode="semi_auto")
    autopar.clear_annotations()
    contenders = {}
    for form in ("attn_gather:cp", "attn_ring:cp"):
        p = autopar.Plan.from_json(plan.to_json())
        for n in p.nodes.values():
            if "scaled_dot_product_attention" in n.op:
                n.local = [form if loc and loc.endswith(":cp") else loc for loc in n.local]
        contenders["cp4-" + form.split(":")[0][5:]] = autopar.parallelize(_model(cfg), mesh, example_inputs=(x,),
                                                                          loss_fn=lm_loss, example_target=y,
                                                                          mode="hybrid", plan=p)
    plain = _Plain(_model(cfg), lm_loss)
    fns, losses, memory = {}, {}, {}
    for name, m in [("one", plain), *contenders.items()]:
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        losses[name] = []

        def step(m=m, opt=opt, name=name):
            if name == "one" and rank != 0:
                return
            losses[name].append(float(m.step(x, target=y)))
            opt.step()
            opt.zero_grad(set_to_none=False)

        fns[name] = step
        if name != "one" or rank == 0:
            saved = measure_step(m, opt, (x,), y).activations
            live = live_peak(lambda: m.step(x, target=y), m, opt, x, y)
            opt.zero_grad(set_to_none=False)
            memory[name] = {"saved_activations": saved, "live_peak": live}
    times = interleaved(fns, reps=reps, warmup=warmup)
    peaks = {}
    for name, d in memory.items():
        t = torch.tensor([d["saved_activations"], d["live_peak"]], dtype=torch.float64)
        if name != "one":
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        peaks[name] = t.tolist()
    return {"times": times, "losses": {k: v[:1] for k, v in losses.items()}, "peaks": peaks,
            "attention": sorted({str(n.local) for n in plan.nodes.values() if "scaled_dot_product" in n.op})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=8)
    args = ap.parse_args(argv)
    from autopar.runtime.launch import RankPool

    cfg = {"vocab": 256, "hidden": args.hidden, "heads": 4, "layers": args.layers, "seq": args.seq}
    print(header(f"context parallelism: cp 4 vs one process, GPT {cfg}, batch 1"))
    pool = RankPool(4, timeout_s=600)
    try:
        r = pool.run(rank_run, cfg, args.reps, 2, timeout_s=1800)[0]
    finally:
        pool.close()
    t = r["times"]
    print(f"plan's attention: {r['attention']}")
    print("first losses: " + ", ".join(f"{k} {v[0]:.6f}" for k, v in r["losses"].items() if v))
    for name, (saved, live) in r["peaks"].items():
        base = r["peaks"]["one"]
        print(f"{name:<11} saved activations {saved / 2**20:8.2f} MiB ({saved / base[0]:.3f} of one process)   "
              f"live peak {live / 2**20:8.2f} MiB ({live / base[1]:.3f})")
    for name in ("cp4-gather", "cp4-ring"):
        print(Ratio(name, "one", t[name], t["one"]).line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
