"""Benchmark (issue 15 part 2): elastic restart under torchrun, examples/resume.py.

Per round, the same job twice under ``torchrun --standalone --max-restarts 3``: uninterrupted, and with
one rank SIGKILLed at the start of a step on the first attempt. From the example's ``elastic:`` lines
(wall-clock stamps) and torchrun's own log lines, the restart is split into:

  detect        the kill -> torchrun sends SIGTERM to the surviving ranks (its monitor noticed)
  start         -> the restarted rank 0 has imported torch and autopar
  group         -> every rank has joined the new process group
  build         -> parallelize (trace, plan from the kept plan.json) and the optimizer are done
  load          -> the newest complete checkpoint is loaded
  first step    -> the first resumed step has run
  restart       the kill -> the first resumed step, in all

and the walls of both runs, their difference and the steps lost (done since the checkpoint, redone).
Also checks the final parameters are bit-identical. Prints medians over the rounds.

    .venv/bin/python bench/elastic.py [--nprocs 4] [--rounds 3] [--steps 20] [--every 5] [--kill-at 13]
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
STAMP = re.compile(r"^elastic: (.*) t=([0-9.]+)$")
SIGTERM = re.compile(r"^[WE](\d{4}) (\d\d:\d\d:\d\d\.\d+) .*Sending process \d+ closing signal SIGTERM")


def run(nprocs: int, ckpt: str, out: str, args, *extra: str) -> tuple[list[tuple[str, float]], list[float], float]:
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nprocs),
           "--max-restarts", "3", str(ROOT / "examples" / "resume.py"), "--steps", str(args.steps),
           "--ckpt-dir", ckpt, "--save-every", str(args.every), "--out", out, *extra]
    start = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    wall = time.time() - start
    if done.returncode:
        raise SystemExit(f"torchrun failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    lines = [(m.group(1), float(m.group(2))) for m in map(STAMP.match, done.stdout.splitlines()) if m]
    year = datetime.date.today().year
    terms = []
    for m in map(SIGTERM.match, done.stderr.splitlines()):
        if m:       # glog stamps are local time without a year
            when = datetime.datetime.strptime(f"{year}{m.group(1)} {m.group(2)}", "%Y%m%d %H:%M:%S.%f")
            terms.append(when.timestamp())
    return lines, terms, wall


def at(lines, prefix: str) -> float:
    return next(t for msg, t in lines if msg.startswith(prefix))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--kill-at", type=int, default=13)
    ap.add_argument("--kill-rank", type=int, default=2)
    args = ap.parse_args()
    resumed = (args.kill_at - 1) // args.every * args.every
    rows: dict[str, list[float]] = {}
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="autopar_elastic_") as d:
            plain, _, plain_wall = run(args.nprocs, f"{d}/plain", f"{d}/plain.pt", args)
            killed, terms, killed_wall = run(args.nprocs, f"{d}/killed", f"{d}/killed.pt", args, "--kill-rank",
                                             str(args.kill_rank), "--kill-at-step", str(args.kill_at))
            a, b = torch.load(f"{d}/plain.pt"), torch.load(f"{d}/killed.pt")
            same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        kill = at(killed, f"rank {args.kill_rank} kills itself")
        marks = [("detect", min(terms)), ("start", at(killed, "attempt 1 imported")),
                 ("group", at(killed, "attempt 1 joined")), ("build", at(killed, "attempt 1 built")),
                 ("load", at(killed, "attempt 1 resumed")), ("first step", at(killed, "attempt 1 trained"))]
        prev = kill
        for name, t in marks:
            rows.setdefault(name, []).append(t - prev)
            prev = t
        rows.setdefault("restart", []).append(prev - kill)
        rows.setdefault("wall uninterrupted", []).append(plain_wall)
        rows.setdefault("wall killed", []).append(killed_wall)
        rows.setdefault("wall difference", []).append(killed_wall - plain_wall)
        print(f"round {r}: bit-identical {same}; restart {prev - kill:.2f} s; walls {plain_wall:.1f} s, "
              f"{killed_wall:.1f} s", flush=True)
        if not same:
            raise SystemExit("the killed run did not end bit-identical to the uninterrupted one")
    print(f"\n{args.nprocs} ranks, {args.steps} steps, checkpoint every {args.every}, rank {args.kill_rank} killed at "
          f"step {args.kill_at} (resumed at {resumed}: {args.kill_at - 1 - resumed} steps redone); medians of "
          f"{args.rounds} rounds")
    for name, vals in rows.items():
        print(f"  {name:20s} {statistics.median(vals):7.2f} s   ({', '.join(f'{v:.2f}' for v in vals)})")


if __name__ == "__main__":
    main()
