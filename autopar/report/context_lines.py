"""The plan report's line on context parallelism: which mesh axes split the sequence and which
form each attention op runs there (``sharding/rules/attention.py``'s ``attn_gather`` / ``attn_ring``)."""
from __future__ import annotations

from collections import Counter

FORMS = {"attn_gather": "all-gather K/V", "attn_ring": "ring"}


def context_lines(plan) -> list[str]:
    """``["context parallelism: cp=4 over axis cp; attention: all-gather K/V ×2"]``, or [] where no
    attention op splits its sequence; the zig-zag order (``Z(dim)``, causal attention) is named."""
    if plan.degrees.get("cp", 1) <= 1:
        return []
    forms, axes, zigzag = Counter(), [], False
    for d in plan.nodes.values():
        locs = [(a, loc) for a, loc in enumerate(d.local or []) if loc and loc.endswith(":cp")]
        if not locs:
            continue
        forms[FORMS.get(locs[0][1].split(":")[0], locs[0][1])] += 1
        zigzag |= any(getattr(d.inputs[0][a], "zigzag", False) for a, _ in locs) if d.inputs else False
        axes += [plan.mesh.axis_names[a] for a, _ in locs if plan.mesh.axis_names[a] not in axes]
    what = ", ".join(f"{form} ×{n}" for form, n in sorted(forms.items()))
    return [f"context parallelism: cp={plan.degrees['cp']} over axis {'+'.join(axes)} (each rank holds "
            f"1/{plan.degrees['cp']} of the sequence{', in the zig-zag order' if zigzag else ''}); attention: {what}"]
