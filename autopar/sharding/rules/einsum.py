"""Einsum-style strategy generation shared by matmul, attention, conv and embedding rules.

Each tensor's dims get labels. Sharding a label present in the output shards every
operand that has it (operands without it, or where it is broadcast, stay R). Sharding a
label absent from the output (contracted) makes the output Partial. An *additive* operand
(a bias) must then be Partial too. ``partial_inputs`` lists operands in which the op is
linear: P there, R elsewhere, gives P out.
"""
from __future__ import annotations

from autopar.sharding.placements import P, R, Shard
from autopar.sharding.strategy import AxisStrategy


def einsum_options(labels: list[str | None], out: str, shapes: list[tuple], additive: dict[int, str] | None = None,
                   partial_inputs=(), no_shard: str = "", chunks: dict[str, int] | None = None) -> list[AxisStrategy]:
    """labels[i]: label string of tensor input i (None: not a labelled operand, stays R)."""
    additive = additive or {}
    chunks = chunks or {}
    all_labels = []
    for lab in labels + [out]:
        for ch in lab or "":
            if ch not in all_labels:
                all_labels.append(ch)
    opts = []
    for lab in all_labels:
        if lab in no_shard:
            continue
        for k in sorted({1, chunks.get(lab, 1)}):
            ins = []
            for i, (ls, shape) in enumerate(zip(labels, shapes)):
                if i in additive:
                    al = additive[i]
                    if lab in out:
                        d = al.find(lab)
                        ins.append(Shard(d, k) if d >= 0 and shape[d] != 1 else R)
                    else:
                        ins.append(P)
                    continue
                d = ls.find(lab) if ls else -1
                ins.append(Shard(d, k) if d >= 0 and shape[d] != 1 else R)
            if lab in out:
                output = Shard(out.index(lab), k)
            else:
                if k > 1:
                    continue
                output = P
            name = f"{lab}" + (f"/{k}" if k > 1 else "") + ("" if lab in out else "→P")
            if all(isinstance(p, type(R)) for p in ins):
                continue
            opts.append(AxisStrategy(tuple(ins), output, None, name))
    for i in partial_inputs:
        ins = tuple(P if (j == i or j in additive) else R for j in range(len(labels)))
        opts.append(AxisStrategy(ins, P, None, f"P{i}"))
    return opts


def letters(n: int, start: int = 0) -> str:
    return "abcdefghijklmnopqrstuvwxyz"[start:start + n]
