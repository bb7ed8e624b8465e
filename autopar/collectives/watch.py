"""Say what a rank was doing when its communication failed because a peer died or stalled.

Every collective autopar issues is noted (``note``, called by ``COUNTER.record`` and before each
point-to-point wait); ``guard(what)`` wraps where autopar runs them (``pmodel.step``, the pipeline
schedule, the gradient sync, start-up) and turns torch.distributed's failure into one
``CommError`` line: what timed out or failed (the collective and its mesh axis, or the
point-to-point transfer and its peer rank), in which call (``pmodel.step (step 3)``), that a peer
died or stalled, and what to do (read that rank's log; raise ``comm_timeout_s``).

    a peer died     gloo: "Connection closed by peer" / "Connection reset by peer" at once
    a peer stalled  gloo: "Timed out waiting 5000ms for recv operation" after the group's timeout
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import torch.distributed as dist

from autopar.core.comm_timeout import comm_timeout_s
from autopar.core.errors import CommError

_PHASES = {"fwd": "forward", "bwd": "backward", "step": "optimizer step", "recompute": "recomputation"}
_LOST = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|remote worker crash|"
                   r"communicator was aborted|Connection refused|ECONNRESET", re.I)
_TIMED_OUT = re.compile(r"timed out|timeout|watchdog", re.I)
_COMM_TEXT = re.compile(r"gloo|NCCL|Timed out waiting|pair closure|Socket Timeout", re.I)
_WAITED_MS = re.compile(r"waiting (\d+)\s*ms", re.I)
_SOURCE = re.compile(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")      # gloo's "[/path/pair.cc:553] "
_CALLBACK = re.compile(r"^Got the following error when running the callback: \w+: ")     # DDP's comm hook
_BOILERPLATE = re.compile(r"\.? This is typically caused by .*$")


@dataclass(frozen=True)
class Op:
    """One communication: ``kind`` ("all_reduce", "p2p receive"), the mesh ``axis`` of a collective,
    the ``phase`` ("fwd", "bwd", "step"), the ``peer`` rank of a point-to-point transfer, ``detail``."""

    kind: str
    axis: str | None = None
    phase: str | None = None
    peer: int | None = None
    detail: str = ""

    def describe(self) -> str:
        text = f"the {self.kind}"
        if self.detail:
            text += f" {self.detail}"
        if self.axis:
            text += f" over mesh axis {self.axis!r}"
        if self.phase:
            text += f" ({_PHASES.get(self.phase, self.phase)})"
        return text


_last: list[Op | None] = [None]


def note(kind: str, axis: str | None = None, phase: str | None = None, peer: int | None = None,
         detail: str = "") -> None:
    """Record the communication this rank is about to wait on (the last one noted is named on failure)."""
    _last[0] = Op(kind, axis, phase, peer, detail)


def failure_kind(err: BaseException) -> str | None:
    """"lost" (a peer closed its connection), "timeout", "failed" (another torch.distributed error), or
    None: not a communication failure."""
    text = str(err)
    if _LOST.search(text):
        return "lost"
    if _TIMED_OUT.search(text) and (isinstance(err, dist.DistError) or _COMM_TEXT.search(text)):
        return "timeout"
    if isinstance(err, dist.DistError):
        return "failed"
    return None


def message(what: str, how: str, op: Op | None, timeout_s: float, err: BaseException, rank: int | None) -> str:
    """The one-line CommError text (module docstring)."""
    me = f"rank {rank}: " if rank is not None else ""
    where = op.describe() if op is not None else "a collective"
    logs = f"rank {op.peer}'s log" if op is not None and op.peer is not None else "the other ranks' logs"
    cause = _cause(err)
    raise_it = (f"raise the timeout with autopar.set_auto_parallel_context(comm_timeout_s=...) or "
                f"parallelize(..., comm_timeout_s=...) (now {timeout_s:g} s)")
    if how == "timeout":
        waited = _WAITED_MS.search(str(err))
        after = int(waited.group(1)) / 1000 if waited else timeout_s
        text = (f"{me}{what} timed out after {after:g} s waiting in {where}: a peer rank did not take part in time; "
                "it stalled (stuck in other code, waiting on something else, or much slower than this rank) or died "
                f"without closing its connections. Check {logs} (autopar.launch names the rank that stalled or "
                f"died first); if that rank is only slow, {raise_it}")
    elif how == "lost":
        text = (f"{me}{what} failed in {where}: a peer rank closed its connection: it died (killed or crashed) "
                "or failed (an error of its own, or a timeout waiting for another rank). Check "
                f"{logs} for the first error (autopar.launch reports it first); this rank only lost its peer")
    else:
        text = (f"{me}{what} failed in {where}: torch.distributed reported an error, most likely because a peer "
                f"rank died or stalled. Check {logs} for the first error; if a rank is only slow, {raise_it}")
    return f"{text} (torch.distributed: {cause})"


def _cause(err: BaseException) -> str:
    """torch.distributed's message, first line, without gloo's source paths and boilerplate."""
    lines = str(err).strip().splitlines()
    text = _CALLBACK.sub("", lines[0] if lines else type(err).__name__)
    return _BOILERPLATE.sub("", _SOURCE.sub("", text)).strip()


@contextlib.contextmanager
def guard(what: str, timeout_s: float | None = None):
    """Run the block; a communication failure in it becomes a ``CommError`` naming ``what`` (e.g.
    ``"pmodel.step (step 3)"``), the last communication noted, and the timeout (default: the one in force)."""
    _last[0] = None
    try:
        yield
    except CommError:
        raise
    except RuntimeError as err:
        how = failure_kind(err)
        if how is None:
            raise
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else None
        seconds = timeout_s if timeout_s is not None else comm_timeout_s()
        op = _last[0]
        raise CommError(message(what, how, op, seconds, err, rank), how, seconds,
                        op.peer if op is not None else None) from err


__all__ = ["Op", "failure_kind", "guard", "message", "note"]
