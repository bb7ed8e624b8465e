"""What a running search reports, and when a time budget stops it.

The search (``search.make_plans``) calls ``enter`` at each stage (ZeRO stage, recomputation
choice, accumulation, pipeline candidates), ``record`` after each candidate it evaluates, and
asks ``out_of_time`` before solving another one. With ``time_budget_s`` set, once at least one plan
fits and less of the budget is left than a candidate takes, no further candidate is solved: the best plan so far is
returned and its report says the search was cut short (``stopped_note``). Without a fitting plan
the search goes on to the first one (a budget never turns a plannable model into an error).
``on_update(progress)`` is called after each change (a display: ``autopar/report/progress_display.py``).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from autopar.plan.degree_keys import degrees_text


@dataclass
class SearchProgress:
    time_budget_s: float | None = None
    on_update: Callable[["SearchProgress"], None] | None = None
    started: float = field(default_factory=time.perf_counter)
    stage: str = ""
    evaluated: int = 0               # candidates solved (fitting or not)
    fitting: int = 0                 # of which fit memory
    best_time: float = math.inf      # predicted step time of the best fitting plan so far
    best: str = ""                   # its description
    stopped: bool = False            # the budget cut the search short
    keep: int = 1                    # how many best plans the search returns (``cutoff``)
    kept_times: list = field(default_factory=list)   # the ``keep`` best whole-step times, ascending
    marks: list = field(default_factory=list)        # elapsed seconds at each ``record``
    stopped_at: float | None = None                  # elapsed seconds when the budget stopped the search
    stopped_gap: float = 0.0                         # a candidate's seconds (``typical``) then

    def __post_init__(self):
        if self.time_budget_s is not None and not (isinstance(self.time_budget_s, (int, float))
                                                   and self.time_budget_s > 0):
            raise ValueError(f"time_budget must be a positive number of seconds, got {self.time_budget_s!r}")

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def enter(self, stage: str) -> None:
        self.stage = stage
        self._update()

    def record(self, plans: list, failed: int = 0, step_time: Callable | None = None) -> None:
        """``plans``: the fitting plans one candidate solve produced; ``failed``: candidates that did
        not fit; ``step_time(plan)``: a plan's whole-step time (default ``plan.step_time``)."""
        self.evaluated += len(plans) + failed
        self.marks.append(self.elapsed())
        self.fitting += len(plans)
        for p in plans:
            t = step_time(p) if step_time else p.step_time
            if t < self.best_time:
                self.best_time = t
                self.best = _describe(p)
            if not p.redundant_axes():  # AUTO ranks a plan that wastes an axis after every other
                self.kept_times = sorted(self.kept_times + [t])[:self.keep]
        self._update()

    def cutoff(self) -> float | None:
        """The whole-step time a candidate must beat to be among the ``keep`` best plans that waste
        no mesh axis (None until there are that many)."""
        return self.kept_times[-1] if len(self.kept_times) >= self.keep else None

    def out_of_time(self) -> bool:
        """True once a fitting plan exists and what is left of the budget is less than a candidate
        takes (``typical``): a candidate is not started that would end after the budget."""
        if self.time_budget_s is None or self.fitting == 0:
            return False
        if not self.stopped and self.time_budget_s - self.elapsed() > self.typical():
            return False
        if not self.stopped:
            self.stopped, self.stopped_at, self.stopped_gap = True, self.elapsed(), self.typical()
            self._update()
        return True

    def typical(self) -> float:
        """Seconds a candidate takes: the median of the last five intervals between records (0 before two)."""
        recent = self.marks[-6:]
        gaps = sorted(b - a for a, b in zip(recent, recent[1:]))
        return gaps[len(gaps) // 2] if gaps else 0.0

    def time_limit(self, limit: float) -> float:
        """A solver's time limit cut, once a plan fits, to what is left of the budget (at least
        0.5 s: CP-SAT then returns its best assignment so far, or the hint)."""
        if self.time_budget_s is None or not self.fitting:
            return limit
        return max(0.5, min(limit, self.time_budget_s - self.elapsed()))

    def stopped_note(self) -> str:
        if not self.stopped:
            return ""
        early = (f" at {self.stopped_at:.1f} s, the next candidate not started (~{self.stopped_gap:.1f} s each)"
                 if self.stopped_at is not None and self.stopped_at < self.time_budget_s else "")
        return (f"search stopped by the time budget of {self.time_budget_s:g} s after {self.evaluated} candidates "
                f"(during: {self.stage}){early}; this is the best plan found so far, not necessarily the best there is")

    def _update(self) -> None:
        if self.on_update is not None:
            self.on_update(self)


def _describe(plan) -> str:
    opts = plan.memory_options.summary()
    return degrees_text(plan.degrees) + (f", {opts}" if opts != "none" else "")
