"""Ring attention's per-block kernels on one device: the fused path against the explicit one.

One rank's share of causal ring attention, without the ring: the queries of the last of ``n``
contiguous pieces against every piece's keys, block by block as ``collectives/attention_cp.py``'s
``_RingAttention`` computes them (blocks merged by log-sum-exp forward; backward per block from
the merged output and log-sum-exp), once with the fused kernels (``fused_blocks``: the flash
kernel of the device; on CUDA in fp16 / bf16) and once with the explicit scores path
(``_block_forward`` / ``_block_backward``). Checks both against
``scaled_dot_product_attention`` of the same queries on the whole keys (forward and the three
gradients) and times forward + backward of each.

    python bench/gpu_ring_blocks.py [--device cuda] [--seq 32768] [--n 8]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from autopar.collectives import attention_cp as cp, fused_blocks  # noqa: E402
from autopar.sharding.cp_positions import tiles  # noqa: E402
from bench.gpu_calibration import timed  # noqa: E402


def ring_share(q, k, v, n: int, fused: bool):
    """(out, dq, dk, dv) of the last piece's queries against n key blocks, as the ring computes them."""
    L = q.shape[-2]
    qpos = torch.arange((n - 1) * L, n * L, device=q.device)
    scale = q.shape[-1] ** -0.5
    acc = cp._acc(q)
    out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=acc, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    blocks = []
    for src in range(n):
        kpos = torch.arange(src * L, (src + 1) * L, device=q.device)
        kb, vb = k[..., src * L:(src + 1) * L, :], v[..., src * L:(src + 1) * L, :]
        args = cp._block_args(None, qpos, kpos, True)
        kind = fused_blocks.kind(q, None, tiles(qpos, kpos, True)[0][2]) if fused else None
        if kind is None:
            (o_b, lse_b), aux = cp._block_forward(q, kb, vb, scale, *args), None
        else:
            o_b, lse_b, aux = fused_blocks.forward(q, kb, vb, scale, kind == "causal")
        out, lse = cp._merge(out, lse, o_b.to(acc), lse_b)
        blocks.append((kb, vb, args, kind, aux))
    out = out.to(q.dtype)
    g = torch.ones_like(out)
    delta = (g.to(acc) * out.to(acc)).sum(-1)
    dq = torch.zeros_like(q, dtype=acc)
    dks, dvs = [], []
    for kb, vb, args, kind, aux in blocks:
        dq_b, dk_b, dv_b = cp._block_backward(q, kb, vb, g, lse, delta, scale, *args) if kind is None else \
            fused_blocks.backward(q, kb, vb, g, out, lse, scale, kind == "causal", aux)
        dq += dq_b
        dks.append(dk_b)
        dvs.append(dv_b)
    return out, dq, torch.cat(dks, -2), torch.cat(dvs, -2)


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """The device and the attention's shape: ``--device --seq --n --heads --dim``."""
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(ap)
    args = ap.parse_args(argv)
    dev = args.device
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    L = args.seq // args.n
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, args.heads, L, args.dim, device=dev, dtype=dt, generator=g, requires_grad=True)
    k = torch.randn(1, args.heads, args.seq, args.dim, device=dev, dtype=dt, generator=g, requires_grad=True)
    v = torch.randn(1, args.heads, args.seq, args.dim, device=dev, dtype=dt, generator=g, requires_grad=True)
    # the reference: the last piece's queries against all keys (all visible: the diagonal block is causal)
    mask = torch.arange((args.n - 1) * L, args.n * L, device=dev)[:, None] >= torch.arange(args.seq, device=dev)[None, :]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref.backward(torch.ones_like(ref))
    want = [ref.detach(), q.grad, k.grad, v.grad]
    if dev == "cuda":
        print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    with torch.no_grad():
        for fused in (True, False):
            got = ring_share(q.detach(), k.detach(), v.detach(), args.n, fused)
            err = [float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(got, want)]
            t = timed(lambda: ring_share(q.detach(), k.detach(), v.detach(), args.n, fused), dev, reps=5, warmup=1)
            print(json.dumps({"path": "fused" if fused else "explicit", "seq": args.seq, "n": args.n,
                              "seconds": t, "rel_err_out_dq_dk_dv": err}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
