"""The calibration profile file: where it lives, what identifies the machine, load and save.

JSON at ``~/.cache/autopar/cpu_profile.json`` (env ``AUTOPAR_PROFILE`` overrides), written by
``autopar calibrate`` (``calibrate.py``) and read by ``devices.cpu_device``.
"""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch

PROFILE_VERSION = 1
RERUN = "run `autopar calibrate` again"


def profile_path() -> Path:
    """``$AUTOPAR_PROFILE`` or ``~/.cache/autopar/cpu_profile.json``."""
    env = os.environ.get("AUTOPAR_PROFILE")
    return Path(env) if env else Path.home() / ".cache" / "autopar" / "cpu_profile.json"


def cpu_model() -> str:
    """The CPU model string (``/proc/cpuinfo`` "model name", else ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def fingerprint() -> dict:
    """What identifies this machine (no hostname): cpu model, core count, torch version."""
    return {"cpu_model": cpu_model(), "nproc": os.cpu_count() or 1, "torch": torch.__version__}


def load_profile(path: str | os.PathLike | None = None) -> dict | None:
    """The profile at ``path`` (default :func:`profile_path`), None when there is none.

    Raises ``ValueError`` naming the file when it is not valid JSON, lacks fields, or was
    measured on another machine (cpu model or core count differ).
    """
    path = Path(path) if path is not None else profile_path()
    if not path.exists():
        return None
    try:
        profile = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"calibration profile {path} is corrupt ({exc}); {RERUN}") from exc
    required = ("machine", "peak_flops", "memory_bandwidth", "kernel_overhead", "link")
    if not isinstance(profile, dict) or any(k not in profile for k in required):
        raise ValueError(f"calibration profile {path} is incomplete (needs {', '.join(required)}); {RERUN}")
    theirs, ours = profile["machine"], fingerprint()
    for key in ("cpu_model", "nproc"):
        if theirs.get(key) != ours[key]:
            raise ValueError(
                f"calibration profile {path} was measured on another machine "
                f"({key}: {theirs.get(key)!r}, this machine: {ours[key]!r}); {RERUN}"
            )
    return profile


def save_profile(profile: dict, path: str | os.PathLike | None = None) -> Path:
    """Write ``profile`` as JSON (atomically); returns the path."""
    path = Path(path) if path is not None else profile_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(profile, indent=2, sort_keys=True), encoding="utf-8")
    tmp.replace(path)
    return path
