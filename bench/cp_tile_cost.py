"""The cost model's charge for one context-parallel rank's attention against bench/RESULTS.md §GPU6.

For the cases ``bench/gpu_cp_local.py`` ran on one H200 (bf16, head dim 128, batch 1; 32768 tokens
over 8 ranks with 32 heads, 131072 over 16 with 8 heads), one rank's attention compute as the
gather form runs it (``_TiledAttention``: the rank's queries against all keys, no collectives),
forward + backward:

* ``old``: what the model charged the op before ``cost_models/cp_tiles.py``, whichever the rank (the
  whole op's ``compute.node_cost`` over the ranks times the placement's imbalance: 1 in the zig-zag
  order, the last rank's ``(2n-1)/n`` contiguous);
* ``new``: ``cp_tiles.gather_tiles`` of that rank priced (its tiles, merges and accumulators);
* ``measured``: §GPU6's ratios to the measured balanced share (the whole causal SDPA / n on the
  H200), times that share. They are a comparison of record, copied from RESULTS.md, not a test.

Then, not measured: the ring form's compute (``ring_compute``) beside the gather form's; and what
the planner charges one attention node per form (``solver/cp_costs.cp_time``: compute and the
collectives it does not hide), old and new, for Llama 3 405B's 128K attention (128 query heads, 8 K/V
heads, bf16, batch 1) on cp 16 x tp 8 (the heads split on tp, cp across nodes) and the GPU6 shapes.

``--cpu``: instead, measures on this CPU (one thread, fp32) a zig-zag rank's ``_TiledAttention``
forward + backward against the whole causal SDPA's over the ranks, beside the ``cpu`` preset's
balanced share (what it keeps) and what the tile formulas would charge.

    PYTHONPATH=. python bench/cp_tile_cost.py [--preset h100] [--cpu]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.fx as fx
from torch.ops import aten

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from autopar.cost_models.compute import node_cost  # noqa: E402
from autopar.cost_models.context_parallel import gather_time  # noqa: E402
from autopar.cost_models.cp_tiles import AttnShape, gather_rank_time, gather_tiles, ring_compute  # noqa: E402
from autopar.cost_models.devices import get_device  # noqa: E402
from autopar.sharding.placements import Shard  # noqa: E402
from autopar.sharding.strategy import Strategy  # noqa: E402
from autopar.solver import cp_costs  # noqa: E402
from autopar.solver.strategy_prices import Costing, split_cost  # noqa: E402

# §GPU6 (one H200, torch 2.11.0+cu130, 2026-11-27): the whole causal SDPA's fwd + bwd / n ("ideal", ms),
# and each rank's time over it. Zig-zag: the last run (after commit f6ddf78, the code this model prices).
# Contiguous: the section's table (the run before it), and the last run's last rank (2.17).
IDEAL_MS = {(32768, 8): 7.02, (131072, 16): 231.0 / 16}
MEASURED = {
    ("zigzag", 32768, 8): {0: 1.85, 4: 1.92, 7: 1.54},
    ("zigzag", 131072, 16): {0: 1.35, 8: 1.36, 15: 1.22},
    ("contiguous", 32768, 8): {0: 0.42, 4: 1.62, 7: 2.56},
    ("contiguous", 131072, 16): {0: 0.18, 8: 1.26, 15: 2.17},
}
HEADS = {32768: 32, 131072: 8}


def _sdpa(heads: int, seq: int, dim: int = 128, dtype: torch.dtype = torch.bfloat16, kv_heads: int = 0) -> fx.Node:
    g = fx.Graph()
    ins = []
    for name, h in zip("qkv", (heads, kv_heads or heads, kv_heads or heads)):
        p = g.placeholder(name)
        p.meta["val"] = torch.empty((1, h, seq, dim), device="meta", dtype=dtype, requires_grad=True)
        ins.append(p)
    node = g.call_function(aten.scaled_dot_product_attention.default, tuple(ins),
                           {"is_causal": True, "enable_gqa": bool(kv_heads) and kv_heads != heads})
    node.meta["val"] = torch.empty((1, heads, seq, dim), device="meta", dtype=dtype)
    g.output(node)
    return node


def charges(seq: int, n: int, rank: int, zigzag: bool, device) -> tuple[float, float]:
    """(old, new) seconds of one rank's gather-form attention compute, forward + backward."""
    heads = HEADS[seq]
    base = node_cost(_sdpa(heads, seq), device).scaled(n)
    old = gather_time(base.time_fwd, base.time_bwd, n, seq, True, 0.0, 0.0, zigzag)
    shape = AttnShape(heads, heads, seq, 128, 128, torch.bfloat16, True, True)
    new = gather_rank_time(shape, gather_tiles(seq, n, rank, zigzag, True), n, device)
    return old.compute_fwd + old.compute_bwd, new.total


def cpu_check() -> None:
    """Measured CPU tiles against the ``cpu`` preset's share and the tile formulas (``--cpu``)."""
    import torch.nn.functional as F

    from autopar.collectives.attention_cp import _TiledAttention
    from autopar.sharding.cp_positions import held
    from bench.gpu_calibration import timed

    torch.set_num_threads(1)
    cpu = get_device("cpu")
    print("| S, n, heads x dim | rank | measured tiles (ms) | measured whole / n (ms) | ratio | "
          "cpu preset: share (ms) | tile formulas (ms) | formulas / share |")
    print("|---|---|---|---|---|---|---|---|")
    for seq, n, heads, dim in ((1024, 4, 4, 32), (4096, 4, 8, 64), (8192, 8, 8, 64)):
        q, k, v = (torch.randn(1, heads, seq, dim, requires_grad=True) for _ in range(3))
        g = torch.randn_like(q)
        whole = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g), "cpu", 5, 2) / n
        node = _sdpa(heads, seq, dim, torch.float32)
        share = node_cost(node, cpu).scaled(n).time_total
        shape = AttnShape(heads, heads, seq, dim, dim, torch.float32, True, True)
        for r in (0, n - 1):
            zq = torch.randn(1, heads, seq // n, dim, requires_grad=True)
            zk, zv = (torch.randn(1, heads, seq, dim, requires_grad=True) for _ in range(2))
            zg = torch.randn_like(zq)
            qpos, kpos = held(seq, [n], [r], True), held(seq, [n], [r], True, (0,))
            t = timed(lambda: _TiledAttention.apply(zq, zk, zv, qpos, kpos, dim ** -0.5).backward(zg), "cpu", 5, 2)
            formulas = gather_rank_time(shape, gather_tiles(seq, n, r, True, True), n, cpu).total
            print(f"| {seq}, {n}, {heads} x {dim} | {r} | {t * 1e3:.2f} | {whole * 1e3:.2f} | {t / whole:.2f} | "
                  f"{share * 1e3:.2f} | {formulas * 1e3:.2f} | {formulas / share:.2f} |", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="h100")
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args(argv)
    if args.cpu:
        cpu_check()
        return 0
    device = get_device(args.preset)
    print(f"gather form, one rank's attention fwd + bwd; old / new: the {args.preset} preset; "
          "measured on the H200 in §GPU6")
    print("| placement | S, n | rank | old, the op (ms) | new, the rank (ms) | measured (ms) | new / measured |")
    print("|---|---|---|---|---|---|---|")
    for (order, seq, n), ranks in MEASURED.items():
        for rank, ratio in ranks.items():
            old, new = charges(seq, n, rank, order == "zigzag", device)
            measured = ratio * IDEAL_MS[(seq, n)]
            print(f"| {order} | {seq}, {n} | {rank} | {old * 1e3:.2f} | {new * 1e3:.2f} | {measured:.1f} "
                  f"({ratio} x {IDEAL_MS[(seq, n)]:.2f}) | {new * 1e3 / measured:.2f} |")
    print()
    print(f"ring form, zig-zag, the busiest rank per step summed ({args.preset}; not measured)")
    print("| S, n | gather, slowest rank (ms) | ring (ms) |")
    print("|---|---|---|")
    for seq, n in IDEAL_MS:
        shape = AttnShape(HEADS[seq], HEADS[seq], seq, 128, 128, torch.bfloat16, True, True)
        gather = max(charges(seq, n, r, True, device)[1] for r in range(n))
        fwd, bwd, fixed = ring_compute(shape, (n,), True, device)
        print(f"| {seq}, {n} | {gather * 1e3:.2f} | {(sum(fwd) + sum(bwd) + fixed.total) * 1e3:.2f} |")
    print()
    print(f"the planner's charge of one attention node per form, zig-zag ({args.preset}; ms: total = compute + "
          "unhidden collectives)")
    print("| rank's op | S, n | gather old | gather new | ring old | ring new | picked old / new |")
    print("|---|---|---|---|---|---|---|")
    for name, heads, kv, seq, n, tp in (("Llama 3 405B: 128 heads, 8 K/V, cp 16 x tp 8", 128, 8, 131072, 16, 8),
                                        ("GPU6: 8 heads, cp 16", 8, 8, 131072, 16, 1),
                                        ("GPU6: 32 heads, cp 8", 32, 32, 32768, 8, 1)):
        row = {form: node_charges(heads, kv, seq, n, tp, form, device) for form in ("attn_gather", "attn_ring")}
        picks = ["gather" if row["attn_gather"][i] <= row["attn_ring"][i] else "ring" for i in (0, 1)]
        gather, ring = row["attn_gather"], row["attn_ring"]
        print(f"| {name} | {seq}, {n} | {gather[0] * 1e3:.2f} | {gather[1] * 1e3:.2f} | {ring[0] * 1e3:.2f} | "
              f"{ring[1] * 1e3:.2f} | {picks[0]} / {picks[1]} |")
    return 0


def node_charges(heads: int, kv: int, seq: int, n: int, tp: int, form: str, device) -> tuple[float, float]:
    """(old, new) ``cp_time`` totals of one zig-zag attention node on a cp axis of ``n`` (and, when
    ``tp > 1``, its heads split on a tp axis inside it)."""
    node = _sdpa(heads, seq, kv_heads=kv)
    z = Shard(2, 2, True)
    if tp > 1:
        st = Strategy(((z, Shard(1)),) * 3, (z, Shard(1)), (f"{form}:cp", None), "cp")
        c = Costing((n, tp), device)
    else:
        st = Strategy(((z,),) * 3, (z,), (f"{form}:cp",), "cp")
        c = Costing((n,), device)
    cost = split_cost(node, node_cost(node, device), st, list(node.all_input_nodes), c)
    new = cp_costs.cp_time(node, st, cost, c).total
    tiled, cp_costs.tiled_shape = cp_costs.tiled_shape, lambda *a: None      # the balanced share, as before
    try:
        old = cp_costs.cp_time(node, st, cost, c).total
    finally:
        cp_costs.tiled_shape = tiled
    return old, new


if __name__ == "__main__":
    raise SystemExit(main())
