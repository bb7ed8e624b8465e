"""What ``autopar.launch`` and ``RankPool`` say when ranks fail: the cause first.

When one rank fails, its peers fail too, in their next collective ("Connection closed by peer",
or autopar's ``CommError``), so the cause is the rank that died without raising (a signal, an
exit code), the first rank whose error is not a lost peer, or else a rank that was still running
when the others had failed (it stalled: they timed out waiting for it; its Python stack, which
it dumps on SIGUSR1, says where); the ranks that only lost a peer follow, one line each.
"""
from __future__ import annotations

import faulthandler
import json
import multiprocessing
import os
import re
import signal
import sys
import time
import traceback
from dataclasses import dataclass

# a collective's error on a rank whose peer went away or stalled (autopar's CommError, gloo, NCCL, the TCP store)
_PEER_LOST = re.compile(r"^autopar\.core\.errors\.CommError:|Connection closed by peer|Connection reset by peer|Broken pipe|"
                        r"remote worker crash|communicator was aborted|NCCL.*(?:abort|watchdog)|recvBytes|"
                        r"Socket Timeout|Timed out waiting", re.I)
STACK_SIGNAL = getattr(signal, "SIGUSR1", None)
_STACK_LINES = 40           # the first lines (innermost calls) of a running rank's stack dump that the message shows
_stack_file: list = []      # keeps the dump's file open in the rank

# the exit code of a spawned rank that found itself re-running the script's top level (no main guard)
NO_MAIN_GUARD_EXIT = 86


@dataclass
class Failure:
    """A rank's exception: when it happened (any increasing clock) and its formatted traceback."""

    rank: int
    time: float
    traceback: str
    timeout_s: float | None = None      # a CommError's communication timeout

    @property
    def lost_peer(self) -> bool:
        return bool(_PEER_LOST.search(self.traceback.strip().splitlines()[-1] if self.traceback.strip() else ""))

    @property
    def last_line(self) -> str:
        lines = self.traceback.strip().splitlines()
        return lines[-1] if lines else "(no traceback)"


def record(err_dir: str, rank: int) -> None:
    """Write this rank's current exception to ``err_dir`` (called in an ``except`` block)."""
    path = os.path.join(err_dir, f"rank{rank}.json")
    timeout = getattr(sys.exc_info()[1], "timeout_s", None)
    with open(path + ".tmp", "w") as f:
        json.dump({"rank": rank, "time": time.time(), "traceback": traceback.format_exc(),
                   "timeout_s": timeout if isinstance(timeout, (int, float)) else None}, f)
    os.replace(path + ".tmp", path)       # the launcher reads it while this rank is still running


def dump_stack_on_request(err_dir: str, rank: int) -> None:
    """In a rank: write every thread's Python stack to ``err_dir/rank<rank>.stack`` on SIGUSR1."""
    if STACK_SIGNAL is None:
        return
    f = open(os.path.join(err_dir, f"rank{rank}.stack"), "w")
    _stack_file.append(f)
    signal.signal(STACK_SIGNAL, signal.SIG_IGN)    # what faulthandler restores as the interpreter exits: a
    faulthandler.register(STACK_SIGNAL, file=f, all_threads=True)     # late request must not kill the rank


def request_stacks(err_dir: str, pids: dict[int, int], wait_s: float = 0.5) -> dict[int, str]:
    """Ask running ranks (rank -> pid) for their stacks; rank -> the stack text ("" when none came)."""
    if STACK_SIGNAL is None or not pids:
        return {r: "" for r in pids}
    for pid in pids.values():
        try:
            os.kill(pid, STACK_SIGNAL)
        except OSError:
            pass
    paths = {r: os.path.join(err_dir, f"rank{r}.stack") for r in pids}
    sizes, deadline = {}, time.monotonic() + wait_s
    while time.monotonic() < deadline:      # faulthandler writes while the rank handles the signal
        now = {r: os.path.getsize(p) if os.path.exists(p) else 0 for r, p in paths.items()}
        if now == sizes and all(now.values()):
            break
        sizes = now
        time.sleep(0.05)
    out = {}
    for r, p in paths.items():
        text = open(p).read() if os.path.exists(p) else ""
        out[r] = "\n".join(text.rstrip().splitlines()[:_STACK_LINES])
    return out


def any_recorded(err_dir: str) -> bool:
    return any(name.endswith(".json") for name in os.listdir(err_dir))


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
    return (f"{call} ran again in every process it started: they import {main} (as under the 'spawn' start method), whose "
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


def describe(fn_name: str, failures: list[Failure], deaths: dict[int, int] | None = None,
             running: dict[int, str] | None = None, grace_s: float = 0.0) -> str:
    """The message: deaths and causes first (in time order, with tracebacks), then the ranks still running
    (``running``: rank -> its stack, ``grace_s`` after the first failure), then the ranks that lost a peer."""
    deaths, running = deaths or {}, running or {}
    causes = sorted((f for f in failures if not f.lost_peer), key=lambda f: f.time)
    peers = sorted((f for f in failures if f.lost_peer), key=lambda f: f.time)
    if not causes and not deaths and not running and peers:
        causes, peers = peers[:1], peers[1:]
    heads = [death(r, code) for r, code in sorted(deaths.items(), key=lambda rc: (rc[1] > 0, rc[0]))]  # signals first
    heads += [f"rank {f.rank} raised {f.last_line}" for f in causes]
    stalled = not heads         # with no death or error of its own, a rank still running is the cause
    if stalled and len(running) == 1:
        heads += [f"rank {r} stalled: it had not failed but was still running {grace_s:.1f} s after the first rank "
                  "failed, when every other rank had failed waiting for it (timed out, or lost a rank that did); "
                  "it was stopped" for r in running]
    elif stalled:
        heads += [f"ranks {', '.join(map(str, sorted(running)))} had not failed but were still running "
                  f"{grace_s:.1f} s after the first rank failed: one of them stalled and the others waited for it "
                  "(their stacks below tell which); they were stopped"]
    lines = [f"{fn_name}: " + "; ".join(heads)]
    lines += [f"--- rank {f.rank} traceback ---\n{f.traceback.rstrip()}" for f in causes]
    waited = "" if stalled else f"was still running {grace_s:.1f} s after the first failure (waiting for a peer) and "
    lines += [f"--- rank {r} {waited}was here when it was stopped (its Python stack, most recent call first) ---\n"
              f"{stack or '(no stack came back)'}" for r, stack in sorted(running.items())]
    lines += [f"--- rank {f.rank} then failed because it lost a peer (a consequence of the above, not a cause): "
              f"{f.last_line}" for f in peers]
    return "\n".join(lines)
