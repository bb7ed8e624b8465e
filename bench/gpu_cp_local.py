"""What one context-parallel rank's attention costs on one GPU, by how the causal offset is given.

Rank ``r`` of ``n`` (contiguous split, ``L = S / n`` tokens each) attends with its ``L`` queries to
the keys at or before its last position: ``(r + 1) L`` keys, causal with the diagonal offset by
``r L``. Three ways to run that with ``scaled_dot_product_attention`` (forward + backward, bf16):

* ``mask``: an explicit boolean ``[L, (r+1) L]`` mask (what ``collectives/attention_cp.py``'s
  all-gather form passes today);
* ``lower_right``: ``torch.nn.attention.bias.causal_lower_right`` (the offset as a bias object
  the fused kernels understand);
* ``split``: the visible prefix without a mask plus the diagonal block with ``is_causal`` (two
  fused calls; the log-sum-exp merge not included);
* ``tiled``: what ``collectives/attention_cp.py``'s all-gather form runs now without a user mask:
  ``_TiledAttention``, the same two fused calls merged by log-sum-exp, with its own backward;
* ``tiled_zigzag``: the same on rank ``r``'s zig-zag share (chunks ``r`` and ``2n-1-r`` of ``2n``
  against all ``S`` gathered keys), the placement the planner uses under a causal mask.

Beside them: ``ideal``, the whole sequence's causal attention divided by ``n`` (a balanced split's
share). Prints one JSON line per (S, n, r, form) with the time and its ratio to ``ideal``.

    python bench/gpu_cp_local.py [--device cuda]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from autopar.collectives.attention_cp import _TiledAttention  # noqa: E402
from autopar.sharding.cp_positions import held  # noqa: E402
from bench.gpu_calibration import timed  # noqa: E402


def run(device: str, seq: int, n: int, heads: int, dim: int) -> None:
    from torch.nn.attention.bias import causal_lower_right

    dt = torch.bfloat16 if device == "cuda" else torch.float32
    L = seq // n

    def qkv(lq, lk):
        q = torch.randn(1, heads, lq, dim, device=device, dtype=dt, requires_grad=True)
        k = torch.randn(1, heads, lk, dim, device=device, dtype=dt, requires_grad=True)
        v = torch.randn(1, heads, lk, dim, device=device, dtype=dt, requires_grad=True)
        return q, k, v

    q, k, v = qkv(seq, seq)
    g = torch.randn_like(q)
    ideal = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g), device) / n
    del q, k, v, g
    for r in (0, n // 2, n - 1):
        lk = (r + 1) * L
        q, k, v = qkv(L, lk)
        g = torch.randn_like(q)
        pos_q = torch.arange(r * L, (r + 1) * L, device=device)
        mask = pos_q[:, None] >= torch.arange(lk, device=device)[None, :]
        bias = causal_lower_right(L, lk)

        def split():
            out = F.scaled_dot_product_attention(q, k[:, :, r * L:], v[:, :, r * L:], is_causal=True)
            if r:
                out = out + F.scaled_dot_product_attention(q, k[:, :, :r * L], v[:, :, :r * L])
            out.backward(g)

        def tiled(q=q, k=k, v=v, g=g, qpos=pos_q, kpos=torch.arange(lk, device=device)):
            _TiledAttention.apply(q, k, v, qpos, kpos, dim ** -0.5).backward(g)

        zq, zk, zv = qkv(L, seq)
        zpos_q = held(seq, [n], [r], True, device=device)
        zpos_k = held(seq, [n], [r], True, (0,), device)

        forms = {"mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask).backward(g),
                 "lower_right": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias).backward(g),
                 "split": split, "tiled": tiled,
                 "tiled_zigzag": lambda: tiled(zq, zk, zv, g, zpos_q, zpos_k)}
        for name, fn in forms.items():
            try:
                t = timed(fn, device)
                row = {"seq": seq, "n": n, "rank": r, "form": name, "seconds": t, "over_ideal": t / ideal}
            except Exception as err:  # noqa: BLE001 - a form this build cannot run is a finding
                row = {"seq": seq, "n": n, "rank": r, "form": name, "error": f"{type(err).__name__}: {str(err)[:160]}"}
            print(json.dumps(row), flush=True)
        del q, k, v, g, zq, zk, zv


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    cases = [(512, 4, 2, 16)] if args.small else [(32768, 8, 32, 128), (131072, 16, 8, 128)]
    for seq, n, heads, dim in cases:
        run(args.device, seq, n, heads, dim)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
