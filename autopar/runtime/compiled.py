"""Per-rank graphs through ``torch.compile`` (inductor): what ``compile=True`` runs.

What is compiled is the fx GraphModule a rank runs (a program's training graph and its
forward-only graph, each pipeline stage's), never the user's module, so ``pmodel.code`` still
shows the readable per-rank graph with its collectives. Each graph is compiled on its first
call (``dynamic=False``: a per-rank graph has static shapes) and AOTAutograd compiles its
backward, which ``step()``'s ordinary ``backward`` then runs.

Collectives stay autopar's autograd Functions (``collectives/comm.py``): dynamo traces them
whole, forward and explicit backward, turning their ``torch.distributed`` calls into traceable
functional collectives inside the graph (``bench/compile.py`` prints the graph and graph-break
counts it measures), so inductor sees the compute on both sides of each collective.

Numerics: inductor fuses and may reorder reductions (fp32 rounding differences at the 1e-6
level); ``fallback_random`` keeps random ops (dropout) on eager's generator, so a compiled
program draws the same masks as the eager one.

Compile threads: inductor compiles kernels in a pool of ``compile_threads`` worker processes per
rank (default: the cores). Ranks sharing a host share its cores, so unless the user set
``TORCHINDUCTOR_COMPILE_THREADS``, each rank takes ``cores // ranks on the host`` (at least 1):
4 gloo ranks on 2 cores otherwise start 4 pools of 2 that compete for the same cores
(bench/RESULTS.md §16).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.fx as fx

INDUCTOR_OPTIONS = {"fallback_random": True}


def _share_compile_threads() -> None:
    """This rank's share of the host's cores for inductor's compile workers (module docstring)."""
    if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:
        return
    import torch._inductor.config as inductor_config

    world = dist.get_world_size() if dist.is_initialized() else 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    inductor_config.compile_threads = max(1, min(inductor_config.compile_threads, cores // max(local, 1)))


class CompiledGraph:
    """``gm`` through ``torch.compile(backend="inductor")``, compiled on the first call."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self._fn = None

    def __call__(self, *args):
        if self._fn is None:
            _share_compile_threads()
            self._fn = torch.compile(self.gm, backend="inductor", dynamic=False, options=dict(INDUCTOR_OPTIONS))
        return self._fn(*args)


def runner(gm: fx.GraphModule, compiled: bool):
    """What runs ``gm``: the graph itself, or its compiled form."""
    return CompiledGraph(gm) if compiled else gm
