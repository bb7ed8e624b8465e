"""Parallel modes and the process-wide auto-parallel context (MindSpore style)."""
from __future__ import annotations

import enum
from typing import Any


class ParallelMode(str, enum.Enum):
    STAND_ALONE = "stand_alone"
    DATA = "data"
    SEMI_AUTO = "semi_auto"
    AUTO = "auto"
    HYBRID = "hybrid"

    @classmethod
    def parse(cls, mode) -> "ParallelMode":
        if isinstance(mode, ParallelMode):
            return mode
        if isinstance(mode, str):
            key = mode.strip().lower().replace("-", "_")
            for m in cls:
                if m.value == key or m.name.lower() == key:
                    return m
        names = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"unknown parallel mode {mode!r}; use autopar.ParallelMode or one of {names}")

    def __str__(self) -> str:
        return self.name


_DEFAULTS: dict[str, Any] = {
    "parallel_mode": ParallelMode.AUTO,
    "grad_compression": None,      # None, "bf16" or "fp16"
    "memory_budget_gb": None,
    "microbatches": None,
    "schedule": None,
    "solver_time_limit": 10.0,
    "autotune_top_k": 0,           # AUTO under torch.distributed: time the k best predicted plans, keep the fastest
    "autotune_steps": 3,
}
_context: dict[str, Any] = dict(_DEFAULTS)


def set_auto_parallel_context(**kwargs) -> None:
    """Set process-wide defaults, e.g. ``set_auto_parallel_context(parallel_mode="data")``."""
    for key, value in kwargs.items():
        if key not in _DEFAULTS:
            raise ValueError(f"unknown auto-parallel context key {key!r}; known keys: {sorted(_DEFAULTS)}")
        if key == "parallel_mode":
            value = ParallelMode.parse(value)
        if key == "grad_compression" and value not in (None, "bf16", "fp16"):
            raise ValueError(f"grad_compression must be None, 'bf16' or 'fp16', got {value!r}")
        if key in ("autotune_top_k", "autotune_steps") and (not isinstance(value, int) or isinstance(value, bool)
                                                            or value < (0 if key == "autotune_top_k" else 1)):
            raise ValueError(f"{key} must be an int >= {0 if key == 'autotune_top_k' else 1}, got {value!r}")
        _context[key] = value


def get_auto_parallel_context() -> dict:
    return dict(_context)


def reset_auto_parallel_context() -> None:
    _context.clear()
    _context.update(_DEFAULTS)
