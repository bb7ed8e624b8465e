"""Parallel modes and the process-wide auto-parallel context (MindSpore style)."""
from __future__ import annotations

import dataclasses
import enum
import math
import os
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


MIXED_PRECISIONS = (None, "bf16", "fp16")


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer (e.g. 0 to turn autotune off), "
                         f"got {text!r}") from None


_DEFAULTS: dict[str, Any] = {
    "parallel_mode": ParallelMode.AUTO,
    "grad_compression": None,      # None, "bf16" or "fp16"
    "mixed_precision": None,       # None (the model's dtypes), "bf16" or "fp16": 16-bit compute, fp32 master weights
    "loss_scaling": None,          # fp16's dynamic loss scaler: None (GradScaler's defaults) or {knob: value}
    "memory_budget_gb": None,
    "microbatches": None,
    "recompute": None,             # None (AUTO/SEMI_AUTO pick when memory needs it), "none", "selective"
                                   # (attention core), "except_attention" (each layer but its attention
                                   # core), "full" (each layer) or {layer name: one of those}
    "recompute_layers": None,      # None, or k: "full" on k of the repeated layers only, spread evenly (each
                                   # pipeline stage its first k/pp: Megatron's --recompute-num-layers)
    "zero": None,                  # None (AUTO/SEMI_AUTO pick when memory needs it) or a ZeRO stage 0-3 over the
                                   # data-parallel axes: 1 optimizer state, 2 + gradients, 3 + parameters sharded
    "accumulation": None,          # None (AUTO/SEMI_AUTO pick when memory needs it) or k: run the global
                                   # batch as k microbatches one after another, gradients synced once
    "schedule": None,
    "virtual_stages": None,        # None (the planner picks for "interleaved_1f1b") or v >= 2 model stages per
                                   # pipeline rank (Megatron's --virtual-pipeline-model-parallel-size)
    "solver_time_limit": 10.0,
    # AUTO under torch.distributed: time the k best predicted plans (those predicted within
    # autotune_slack x the best) for autotune_steps steps each and keep the fastest; 0 or 1 = off
    "autotune_top_k": 6,
    "autotune_steps": 8,
    "autotune_slack": 1.5,
    # seconds any collective or point-to-point wait may take before the rank raises autopar.CommError
    # (a peer died or stalled); None: the default process group's timeout (autopar/core/comm_timeout.py)
    "comm_timeout_s": None,
    # True: each rank's program (each pipeline stage's graphs) runs through torch.compile / inductor,
    # and the cost model times compute at the profile's compiled_speedup (autopar/runtime/compiled.py)
    "compile": False,
    # the busiest expert-parallel rank's routed tokens over the mean: MoE expert compute and dispatch
    # all-to-alls are costed at this factor where the experts are split (autopar/cost_models/moe.py)
    "moe_imbalance": 1.1,
}


def _defaults() -> dict[str, Any]:
    """The defaults; ``AUTOPAR_AUTOTUNE_TOP_K`` in the environment sets autotune_top_k's (0 turns it off)."""
    out = dict(_DEFAULTS)
    out["autotune_top_k"] = _env_int("AUTOPAR_AUTOTUNE_TOP_K", _DEFAULTS["autotune_top_k"])
    _check("autotune_top_k", out["autotune_top_k"])
    return out


def _check(key: str, value) -> None:
    if key in ("autotune_top_k", "autotune_steps") and (not isinstance(value, int) or isinstance(value, bool)
                                                        or value < (0 if key == "autotune_top_k" else 1)):
        raise ValueError(f"{key} must be an int >= {0 if key == 'autotune_top_k' else 1}, got {value!r}")
    if key == "autotune_slack" and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1):
        raise ValueError(f"autotune_slack must be a number >= 1 (trial plans predicted within slack x the best), "
                         f"got {value!r}")


def check_comm_timeout(value) -> None:
    """``comm_timeout_s`` is None or a number of seconds > 0."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
        raise ValueError(f"comm_timeout_s must be a number of seconds > 0 (or None: the default process group's "
                         f"timeout), got {value!r}")


def check_compile(value) -> None:
    """``compile`` is True or False."""
    if not isinstance(value, bool):
        raise ValueError(f"compile must be True or False (True runs each rank's program through torch.compile), "
                         f"got {value!r}")


_context: dict[str, Any] = _defaults()


def set_auto_parallel_context(**kwargs) -> None:
    """Set process-wide defaults, e.g. ``set_auto_parallel_context(parallel_mode="data")``."""
    for key, value in kwargs.items():
        if key not in _DEFAULTS:
            raise ValueError(f"unknown auto-parallel context key {key!r}; known keys: {sorted(_DEFAULTS)}")
        if key == "parallel_mode":
            value = ParallelMode.parse(value)
        if key == "recompute" and value is not None:
            bad = [v for v in (value.values() if isinstance(value, dict) else [value])
                   if v not in ("none", "selective", "except_attention", "full")]
            if bad:
                raise ValueError(f"recompute must be None, 'none', 'selective', 'except_attention', 'full' or a "
                                 f"{{layer: one of those}} "
                                 f"mapping, got {bad[0]!r}")
        if key == "recompute_layers" and value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"recompute_layers must be None or an int >= 0 (how many layers recompute \"full\"), "
                             f"got {value!r}")
        if key == "zero" and value not in (None, 0, 1, 2, 3):
            raise ValueError(f"zero must be None (chosen when memory needs it) or a ZeRO stage 0, 1, 2 or 3, "
                             f"got {value!r}")
        if key in ("accumulation", "microbatches") and value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{key} must be None or a positive int, got {value!r}")
        if key == "virtual_stages" and value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 2):
            raise ValueError(f"virtual_stages must be None (the planner picks) or an int >= 2 (model stages per "
                             f"pipeline rank under the 'interleaved_1f1b' schedule), got {value!r}")
        if key in ("memory_budget_gb", "solver_time_limit") and (value is not None or key == "solver_time_limit") and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ValueError(f"{key} must be a number > 0{' or None' if key == 'memory_budget_gb' else ''}, "
                             f"got {value!r}")
        if key == "comm_timeout_s":
            check_comm_timeout(value)
        if key == "compile":
            check_compile(value)
        if key == "moe_imbalance" and (isinstance(value, bool) or not isinstance(value, (int, float))
                                       or not math.isfinite(value) or value < 1):
            raise ValueError(f"moe_imbalance must be a number >= 1 (the busiest expert-parallel rank's routed tokens "
                             f"over the mean; 1.0 = perfect balance), got {value!r}")
        if key == "mixed_precision" and value not in MIXED_PRECISIONS:
            raise ValueError(f"mixed_precision must be None, 'bf16' or 'fp16', got {value!r}")
        if key == "loss_scaling":
            LossScaling.of(value)
        if key == "grad_compression" and value not in (None, "bf16", "fp16"):
            raise ValueError(f"grad_compression must be None, 'bf16' or 'fp16', got {value!r}")
        _check(key, value)
        _context[key] = value


def get_auto_parallel_context() -> dict:
    return dict(_context)


def reset_auto_parallel_context() -> None:
    fresh = _defaults()
    _context.clear()
    _context.update(fresh)


@dataclasses.dataclass
class LossScaling:
    """GradScaler's knobs and defaults (``set_auto_parallel_context(loss_scaling={...})``)."""

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    @classmethod
    def of(cls, value: dict | None) -> "LossScaling":
        """The settings from a ``{knob: value}`` dict (None: the defaults); bad ones raise ValueError."""
        if value is None:
            return cls()
        known = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(value, dict) or any(k not in known for k in value):
            raise ValueError(f"loss_scaling must be None or a dict with keys from {known}, got {value!r}")
        out = cls(**value)
        ranges = {"init_scale": lambda v: v > 0, "growth_factor": lambda v: v > 1,
                  "backoff_factor": lambda v: 0 < v < 1}
        for k, ok in ranges.items():
            v = getattr(out, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
                raise ValueError(f"loss_scaling[{k!r}] = {v!r} is out of range (init_scale > 0, growth_factor > 1, "
                                 "0 < backoff_factor < 1)")
        if isinstance(out.growth_interval, bool) or not isinstance(out.growth_interval, int) or out.growth_interval < 1:
            raise ValueError(f"loss_scaling['growth_interval'] = {out.growth_interval!r} must be an int >= 1 "
                             "(clean steps before the scale grows)")
        return out
