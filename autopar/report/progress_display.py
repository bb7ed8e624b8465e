"""A live line for a running search (``autopar plan``, ``autopar.plan(progress=True)``): stage,
candidates evaluated, best plan so far, elapsed time against the budget. Uses tqdm when it is
installed (the ``progress`` extra), else rewrites one line on stderr."""
from __future__ import annotations

import sys
import time

from autopar.solver.progress import SearchProgress  # noqa: F401  (the type it renders)


class ProgressDisplay:
    """``on_update`` for :class:`SearchProgress`; ``close()`` ends the line."""

    def __init__(self, stream=None, min_interval_s: float = 0.2):
        self.stream = stream or sys.stderr
        self.min_interval_s = min_interval_s
        self._last = 0.0
        self._bar = None
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        if tqdm is not None:
            self._bar = tqdm(total=None, unit=" candidates", file=self.stream, leave=True,
                             bar_format="{desc} | {n} candidates | {elapsed} | {postfix}")

    def __call__(self, progress: SearchProgress) -> None:
        now = time.perf_counter()
        if now - self._last < self.min_interval_s and not progress.stopped:
            return
        self._last = now
        best = (f"best {progress.best_time * 1e3:.1f} ms/step ({progress.best})" if progress.fitting
                else "no plan fits yet")
        budget = f" of {progress.time_budget_s:g} s" if progress.time_budget_s else ""
        stop = " — time budget reached" if progress.stopped else ""
        if self._bar is not None:
            self._bar.set_description_str(f"planning: {progress.stage}", refresh=False)
            self._bar.n = progress.evaluated
            self._bar.set_postfix_str(best + budget + stop)
            return
        self.stream.write(f"\rplanning [{progress.elapsed():6.1f} s{budget}] {progress.stage} | "
                          f"{progress.evaluated} candidates | {best}{stop}\033[K")
        self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            self.stream.write("\n")
            self.stream.flush()
