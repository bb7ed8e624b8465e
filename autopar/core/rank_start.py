"""How ``RankPool`` and ``launch`` start ranks: from a fork server that imported torch (and autopar) once.

A spawned rank imports torch, autopar and, on its first job, torch's tracing machinery itself (~5 CPU-s);
ranks forked from a server that preloaded them (``rank_preload``) start in ~0.02 CPU-s and behave like spawned
ones otherwise (the main module is prepared as under spawn, and the parent's environment at the pool's start is
applied: ``apply_env``).
autopar is preloaded only where the server (cwd first on its path, then ``PYTHONPATH``) finds the
autopar this process runs; otherwise each rank imports it. Where no fork server exists: spawn.
"""
from __future__ import annotations

import atexit
import os
from pathlib import Path

import torch.multiprocessing as mp

_PRELOAD = ("torch", "torch.distributed", "torch.export")
_STOP_AT_EXIT: list = []


def _server_finds_this_autopar() -> bool:
    mine = Path(__file__).resolve().parents[1]      # this autopar's package folder
    for entry in ["", *os.environ.get("PYTHONPATH", "").split(os.pathsep)]:
        found = Path(entry or os.getcwd()) / "autopar" / "__init__.py"
        if found.is_file():
            return found.resolve().parent == mine
    return False


def stop_server() -> None:
    """At exit: stop the fork server and reap it (else it outlives this process briefly, unreaped)."""
    from multiprocessing import forkserver

    try:
        forkserver._forkserver._stop()
    except Exception:  # noqa: BLE001 - nothing to stop, or a Python without the helper
        pass


def start_method() -> str:
    """"forkserver" (its preloads set; the server is started once per process and stopped at its exit),
    else "spawn"."""
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    if not _STOP_AT_EXIT:
        _STOP_AT_EXIT.append(atexit.register(stop_server))
    mp.get_context("forkserver").set_forkserver_preload(
        list(_PRELOAD) + (["autopar.core.rank_preload"] if _server_finds_this_autopar() else []))
    return "forkserver"


def pool_context():
    """The multiprocessing context for the ranks of a pool or a launch."""
    return mp.get_context(start_method())


def apply_env(env: dict[str, str]) -> None:
    """Make this rank's environment the parent's at the pool's start (a forked rank has the server's)."""
    for k in set(os.environ) - set(env):
        del os.environ[k]
    os.environ.update(env)
