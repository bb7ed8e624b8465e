"""Property-based fuzzing of training (issue 15 part 6): random MLP / transformer jobs x meshes x
modes x memory options, each trained through autopar and compared with one device.

The cases are drawn by the hypothesis strategy ``tests/fuzz_cases.cases`` from ``--seed`` (printed;
the same seed draws the same cases) and judged by ``tests/fuzz_check.check_case``: a case trains
like one device (1e-5 in fp32; torch DDP's noise where the plan reorders sums and 1e-5 fails; 2x
torch FSDP2's distance under bf16), or is refused by an autopar error on every rank. Anything else
is a failure, shrunk (``tests/fuzz_shrink.py``) to a small case that fails the same way.
AUTO's measured choice is off (``AUTOPAR_AUTOTUNE_TOP_K=0``), as in the suite: plans do not
depend on the machine's load.

    nice .venv/bin/python bench/fuzz.py --cases 300 [--seed S] [--shrink-budget 40] [--json out.json]
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [p for p in (ROOT, os.path.join(ROOT, "tests")) if p not in sys.path]
os.environ.setdefault("AUTOPAR_AUTOTUNE_TOP_K", "0")

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402

from autopar.runtime.launch import RankPool  # noqa: E402
from fuzz_cases import Case, cases  # noqa: E402
from fuzz_check import Outcome, check_case  # noqa: E402
from fuzz_shrink import shrink, signature  # noqa: E402


def draw_cases(n: int, at: int, per_run: int = 10) -> list[Case]:
    """``n`` distinct cases drawn by the hypothesis strategy from seed ``at``: runs of ``per_run``
    examples from seeds ``at * 100003 + j``, each without its first (hypothesis starts every run
    with the simplest case, and one long run draws streaks of near-copies of a case)."""
    out: dict[Case, None] = {}
    j = 0
    while len(out) < n:
        drawn: list[Case] = []

        @seed(at * 100003 + j)
        @settings(max_examples=per_run + 1, database=None, phases=[Phase.generate], deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(cases())
        def collect(case):
            drawn.append(case)

        collect()
        out.update(dict.fromkeys(drawn[1:]))
        j += 1
    return list(out)[:n]


class Pools:
    """One spawned process group per world size, replaced after a failure (as tests/conftest.py)."""

    def __init__(self, timeout_s: float):
        self.timeout_s, self.pools = timeout_s, {}

    def run(self, n: int, fn, *args, **kwargs) -> list:
        pool = self.pools.get(n)
        if pool is None or pool.broken:
            if pool is not None:
                pool.close()
            pool = self.pools[n] = RankPool(n, timeout_s=self.timeout_s)
        return pool.run(_fresh_call, fn, *args, **kwargs)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()


def _fresh_call(rank, fn, *args, **kwargs):
    import autopar

    autopar.reset_auto_parallel_context()
    autopar.clear_annotations()
    return fn(rank, *args, **kwargs)


def _line(i: int, n: int, o: Outcome) -> str:
    c = o.case
    what = (f"{c.model.family} {c.ranks}r {c.shape}{c.axis_names or ''} {c.mode}{'<' + c.source if c.source else ''}"
            f" {c.optim} mp={c.mixed_precision} z={c.zero} rc={c.recompute} acc={c.accumulation} micro={c.micro}")
    tail = o.plan + (f" [{o.bar}]" if o.bar else "") if o.status == "trained" else o.detail.splitlines()[0][:160]
    line = f"[{i + 1}/{n}] {o.status:8s} {o.seconds:5.1f}s  {what}  ::  {tail}"
    if o.status != "failed":
        return line
    return line + f"\n    case: {c!r}\n    " + o.detail[-2000:].replace("\n", "\n    ")


def _summary(outcomes: list[Outcome], shrunk: list[dict], elapsed: float, at: int) -> str:
    by = collections.Counter(o.status for o in outcomes)
    lines = [f"seed {at}: {len(outcomes)} cases, {by['trained']} trained like one device, {by['refused']} refused "
             f"with an autopar error, {by['failed']} failed; {elapsed:.0f} s "
             f"({elapsed / max(1, len(outcomes)):.1f} s per case)"]
    trained = [o for o in outcomes if o.status == "trained"]
    bars = collections.Counter(o.bar.split(" (")[0] for o in trained)
    lines.append("bars met: " + ", ".join(f"{b} {k}" for b, k in bars.most_common()))
    kinds = collections.Counter()
    for o in trained:
        c, plan = o.case, o.plan
        kinds[c.mode] += 1
        for part, name in (("dp=1 ", "dp>1"), ("tp=1 ", "tp>1"), ("pp=1 ", "pp>1")):
            if part not in plan:
                kinds[name] += 1
        for opt in ("ZeRO", "accumulation", "recompute", "bf16"):
            if opt in plan:
                kinds[opt] += 1
        if not plan.split("; ")[2].startswith("0/"):
            kinds["params split"] += 1
        if c.memory_fraction:
            kinds["memory cap"] += 1
    lines.append("trained cases by mode / what the plan used: " + ", ".join(f"{k} {v}" for k, v in kinds.most_common()))
    refusals = collections.Counter(o.detail.splitlines()[0][:110] for o in outcomes if o.status == "refused")
    lines.append(f"refusals ({sum(refusals.values())}, distinct messages {len(refusals)}):")
    lines += [f"  {k:4d} x {msg}" for msg, k in refusals.most_common()]
    for s in shrunk:
        lines += [f"FAILURE ({s['signature']}): {s['detail'][:600]}", f"  case:   {s['case']}",
                  f"  shrunk ({s['runs']} runs): {s['shrunk']}", f"  shrunk detail: {s['shrunk_detail'][:600]}"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--seed", type=int, default=None, help="draws the same cases again (default: random, printed)")
    ap.add_argument("--shrink-budget", type=int, default=40, help="case runs spent shrinking each failure")
    ap.add_argument("--timeout", type=float, default=90.0, help="process-group timeout (s): a hang fails after it")
    ap.add_argument("--json", default=None, help="write every outcome here")
    args = ap.parse_args()
    at = args.seed if args.seed is not None else random.randrange(2**31)
    print(f"seed {at} (python bench/fuzz.py --cases {args.cases} --seed {at} replays it)", flush=True)
    pools = Pools(args.timeout)
    t0 = time.perf_counter()
    todo = draw_cases(args.cases, at)
    outcomes: list[Outcome] = []
    try:
        for i, case in enumerate(todo):
            outcomes.append(check_case(case, pools.run))
            print(_line(i, len(todo), outcomes[-1]), flush=True)
        shrunk = []
        for o in (o for o in outcomes if o.status == "failed"):
            sig = signature(o)
            last: dict = {}

            def fails(c: Case) -> bool:
                got = check_case(c, pools.run)
                if got.status == "failed" and signature(got) == sig:
                    last["detail"] = got.detail
                    return True
                return False

            small, runs = shrink(o.case, fails, args.shrink_budget)
            shrunk.append({"signature": sig, "detail": o.detail, "case": repr(o.case), "shrunk": repr(small),
                           "runs": runs, "shrunk_detail": last.get("detail", o.detail)})
            print(f"shrunk a failure ({sig}) in {runs} runs: {small!r}", flush=True)
    finally:
        pools.close()
    elapsed = time.perf_counter() - t0
    print(_summary(outcomes, shrunk, elapsed, at))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seed": at, "seconds": elapsed, "shrunk": shrunk,
                       "outcomes": [dict(dataclasses.asdict(o), case=repr(o.case)) for o in outcomes]}, f, indent=1)


if __name__ == "__main__":
    main()
