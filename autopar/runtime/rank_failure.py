"""What ``autopar.launch`` and ``RankPool`` say when ranks fail: the cause first.

When one rank fails, its peers fail too, in their next collective ("Connection closed by peer"),
so the cause is the rank that died without raising (a signal, an exit code) or the first rank
whose error is not a lost peer; the ranks that only lost a peer follow, one line each.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import sys
import time
import traceback
from dataclasses import dataclass

# a collective's error on a rank whose peer went away (gloo, NCCL, the TCP store)
_PEER_LOST = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|remote worker crash|"
                        r"communicator was aborted|NCCL.*(?:abort|watchdog)|recvBytes|Socket Timeout", re.I)

# the exit code of a spawned rank that found itself re-running the script's top level (no main guard)
NO_MAIN_GUARD_EXIT = 86


@dataclass
class Failure:
    """A rank's exception: when it happened (any increasing clock) and its formatted traceback."""

    rank: int
    time: float
    traceback: str

    @property
    def lost_peer(self) -> bool:
        return bool(_PEER_LOST.search(self.traceback.strip().splitlines()[-1] if self.traceback.strip() else ""))

    @property
    def last_line(self) -> str:
        lines = self.traceback.strip().splitlines()
        return lines[-1] if lines else "(no traceback)"


def record(err_dir: str, rank: int) -> None:
    """Write this rank's current exception to ``err_dir`` (called in an ``except`` block)."""
    with open(os.path.join(err_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "time": time.time(), "traceback": traceback.format_exc()}, f)


def recorded(err_dir: str) -> list[Failure]:
    out = []
    for name in sorted(os.listdir(err_dir)):
        if name.endswith(".json"):
            with open(os.path.join(err_dir, name)) as f:
                out.append(Failure(**json.load(f)))
    return out


def bootstrapping() -> bool:
    """True in a spawned process that is still importing the parent's main module (the check
    ``multiprocessing.spawn`` itself makes before it refuses to start processes)."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def no_main_guard_message(call: str) -> str:
    main = getattr(sys.modules.get("__main__"), "__file__", None) or "your script"
    return (f"{call} ran again in every process it started: they import {main} (the 'spawn' start method), whose "
            "top level calls autopar.launch. Put the call, and what should run only once, under "
            "`if __name__ == \"__main__\":`")


def signal_advice(name: str) -> str:
    if name == "SIGKILL":
        return ("SIGKILL usually means the host ran out of memory and the kernel's OOM killer picked this process "
                "(check `dmesg -T | grep -i -E 'out of memory|killed process'` or `journalctl -k`; then use a smaller "
                "batch or model per process, or fewer processes per host); otherwise something killed it from "
                "outside (kill -9, a job scheduler's memory or time limit)")
    if name in ("SIGSEGV", "SIGBUS", "SIGABRT", "SIGILL", "SIGFPE"):
        return ("a crash in native code (torch, an extension, a driver); run the job with `python -X faulthandler` "
                "to see where")
    return "something outside the process stopped it"


def death(rank: int, exitcode: int) -> str:
    """One line for a rank that ended without a Python exception."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"rank {rank} was killed by signal {name}: it did not raise. {signal_advice(name)}"
    return (f"rank {rank} exited with code {exitcode} without raising a Python exception (os._exit, sys.exit in "
            "native code, or a crash)")


def describe(fn_name: str, failures: list[Failure], deaths: dict[int, int] | None = None) -> str:
    """The message: deaths and causes first (in time order, with tracebacks), then the ranks that lost a peer."""
    deaths = deaths or {}
    causes = sorted((f for f in failures if not f.lost_peer), key=lambda f: f.time)
    peers = sorted((f for f in failures if f.lost_peer), key=lambda f: f.time)
    if not causes and not deaths and peers:
        causes, peers = peers[:1], peers[1:]
    heads = [death(r, code) for r, code in sorted(deaths.items(), key=lambda rc: (rc[1] > 0, rc[0]))]  # signals first
    heads += [f"rank {f.rank} raised {f.last_line}" for f in causes]
    lines = [f"{fn_name}: " + "; ".join(heads)]
    lines += [f"--- rank {f.rank} traceback ---\n{f.traceback.rstrip()}" for f in causes]
    lines += [f"--- rank {f.rank} then failed because it lost a peer (a consequence of the above, not a cause): "
              f"{f.last_line}" for f in peers]
    return "\n".join(lines)
