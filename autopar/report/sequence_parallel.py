"""Where a plan runs sequence parallelism (Megatron-SP): norms split along the sequence on a
tensor-parallel axis, so the residual stream between the blocks' linears is sequence-split there."""
from __future__ import annotations

from autopar.sharding.placements import Shard

NORM_OPS = ("layer_norm", "rms_norm")


def _pattern(module: str) -> str:
    return ".".join("*" if p.isdigit() else p for p in module.split("."))


def _is_norm(d) -> bool:
    """A norm op, or the statistic of a norm written from ops (Hugging Face's ``LlamaRMSNorm``:
    pow, mean, rsqrt, mul in a module named ``*norm*``): its ``mean`` over the hidden dim, which
    can split only along the batch and the sequence."""
    if any(k in d.op for k in NORM_OPS):
        return True
    return "mean" in d.op and "norm" in (d.module or "").rsplit(".", 1)[-1].lower()


def sequence_parallel(plan) -> dict[str, list[str]]:
    """tp axis name -> module patterns (``blocks.*.ln1``) of the norms split along a non-batch dim
    there, in graph order (empty: the plan uses no sequence parallelism)."""
    out: dict[str, list[str]] = {}
    for d in plan.nodes.values():
        if not _is_norm(d):
            continue
        spec = d.output[0] if isinstance(d.output, list) else d.output
        for axis, p in zip(plan.mesh.axis_names, spec or ()):
            if isinstance(p, Shard) and p.dim >= 1 and plan.axis_roles.get(axis) == "tp":
                mods = out.setdefault(axis, [])
                if _pattern(d.module or "<root>") not in mods:
                    mods.append(_pattern(d.module or "<root>"))
    return out


def sequence_parallel_lines(plan) -> list[str]:
    """The report's summary line per tp axis that runs sequence-parallel norms."""
    return [f"sequence parallel (sp) on {axis}: norms split along the sequence ({', '.join(mods)}); "
            "reduce-scatter out of the row-parallel linears, all-gather into the column-parallel ones"
            for axis, mods in sequence_parallel(plan).items()]
