"""Units: how sizes read in messages and reports."""
from __future__ import annotations


def human_bytes(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit it fills: "12.3 GiB", "16 KiB", "512 B"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"
