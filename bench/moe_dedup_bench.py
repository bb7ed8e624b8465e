"""The de-duplicated expert dispatch against the per-(token, k) one it replaced (bench/RESULTS.md §34g), on
CPU ranks (gloo): all-to-all bytes summed over the ranks and the wall time of one forward + backward of
``collectives/moe_dispatch.moe_experts`` (median of ``--reps``), with group-limited routing drawn as
``sharding/moe_routing.py`` models it (``topk_group`` of ``n_group`` groups, then k experts among theirs).
"old" is the module as it was at commit ``OLD_COMMIT`` (read with ``git show``), "new" the working tree's;
both run the same DeepSeek-V3 experts module on the same routing, and their outputs and gradients agree.

    PYTHONPATH=. python bench/moe_dedup_bench.py                      # ep 4, then (expert 2 x ep 2) two hops
    PYTHONPATH=. python bench/moe_dedup_bench.py --experts 16 --topk 4 --groups 1 --topk-groups 1
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
OLD_COMMIT = "4ad4f60"      # the per-(token, k) dispatch (the last commit before the de-duplication)


def _old_module():
    src = subprocess.run(["git", "show", f"{OLD_COMMIT}:autopar/collectives/moe_dispatch.py"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    mod = types.ModuleType("moe_dispatch_old")
    exec(compile(src, "moe_dispatch_old.py", "exec"), mod.__dict__)
    return mod


def _experts(a):
    import transformers as tf
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    from autopar.frontend.moe_experts import _register, _template

    cfg = tf.DeepseekV3Config(hidden_size=a.hidden, moe_intermediate_size=a.inter, n_routed_experts=a.experts,
                              num_experts_per_tok=a.topk, n_group=a.groups, topk_group=a.topk_groups)
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    mod = DeepseekV3Experts(cfg)
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0, 0.05)
    return mod, _register(mod, _template(mod), a.topk)


def _routing(a, rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    size = a.experts // a.groups
    groups = torch.rand(a.tokens, a.groups, generator=g).argsort(1)[:, :a.topk_groups]
    pool = (groups.unsqueeze(2) * size + torch.arange(size)).reshape(a.tokens, -1)
    ids = pool.gather(1, torch.rand(pool.shape, generator=g).argsort(1)[:, :a.topk])
    return torch.randn(a.tokens, a.hidden, generator=g), ids, torch.rand(a.tokens, a.topk, generator=g)


def _rank(rank, world, a, shape, names, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import autopar
    from autopar.collectives import comm, moe_dispatch
    from autopar.collectives.groups import axis_groups, bound_axes

    mesh = autopar.Mesh(shape, axis_names=names)
    mod, key = _experts(a)
    n_local = a.experts // world
    params = [p.detach()[rank * n_local:(rank + 1) * n_local].clone() for p in mod.parameters()]
    hidden, ids, weights = _routing(a, rank)
    impls = {"old": _old_module().moe_experts, "new": moe_dispatch.moe_experts}
    res = {}
    with bound_axes(axis_groups(mesh)):
        for name, fn in impls.items():
            times, grads = [], None
            for rep in range(a.reps + 1):
                h, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
                ps = [p.clone().requires_grad_() for p in params]
                dist.barrier()
                with comm.count_collectives() as c:
                    t0 = time.perf_counter()
                    y = fn(key, h, ids, w, ps, _axes={"ep": list(names)})
                    y.square().sum().backward()
                    dist.barrier()
                    dt = time.perf_counter() - t0
                if rep:                      # the first run warms up
                    times.append(dt)
                grads = (y.detach(), h.grad, w.grad, [p.grad for p in ps])
            a2a = [(b, ax) for k, b, ax, _ in c.calls if k == "all_to_all"]
            res[name] = dict(time=statistics.median(times), bytes=sum(b for b, _ in a2a),
                             per_axis={ax: sum(b for b, x in a2a if x == ax) for ax in names}, grads=grads)
    o, n = res["old"]["grads"], res["new"]["grads"]
    for x, y in zip([o[0], o[1], o[2], *o[3]], [n[0], n[1], n[2], *n[3]]):
        err = ((y - x).abs().max() / x.abs().max().clamp_min(1e-30)).item()    # fp32 sums in another order
        assert err < 1e-4, f"old and new dispatch differ: {err:.2e} of the largest entry"
    out[rank] = {k: {kk: vv for kk, vv in v.items() if kk != "grads"} for k, v in res.items()}
    dist.destroy_process_group()


def run(a, shape, names) -> dict:
    from autopar.sharding.moe_routing import copies_per_token

    world = 1
    for s in shape:
        world *= s
    out = mp.Manager().dict()
    mp.spawn(_rank, args=(world, a, shape, names, 29500 + os.getpid() % 1000, out), nprocs=world, join=True)
    _, key = _experts(a)
    copies = copies_per_token(key, a.experts, a.topk, list(shape), [True] * len(shape))
    return {"ranks": dict(out), "copies": copies}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--topk-groups", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048, help="per rank")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    print(f"E {a.experts}, top {a.topk} in {a.topk_groups} of {a.groups} groups, {a.tokens} tokens x {a.hidden} per rank, "
          f"fp32, gloo, median of {a.reps} forward + backward")
    for shape, names in (((4,), ("ep",)), ((2, 2), ("expert", "ep"))):
        r = run(a, shape, names)
        ranks = r["ranks"].values()
        line = []
        for impl in ("old", "new"):
            b = sum(x[impl]["bytes"] for x in ranks)
            axes = {ax: sum(x[impl]["per_axis"][ax] for x in ranks) / 2**20 for ax in names}
            t = max(x[impl]["time"] for x in ranks)
            line.append(f"{impl}: {b / 2**20:.1f} MiB ({', '.join(f'{k} {v:.1f}' for k, v in axes.items())}), "
                        f"{t * 1e3:.1f} ms")
        print(f"mesh {shape} {names}: expected copies per token per hop {[round(c, 2) for c in r['copies']]} "
              f"(old: {a.topk}) | " + " | ".join(line))


if __name__ == "__main__":
    main()
