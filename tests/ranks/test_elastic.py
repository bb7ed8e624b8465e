"""Elastic restart under torchrun (examples/resume.py): one rank SIGKILLed at a random step on the first
attempt, torchrun restarts every rank, they resume from the newest complete checkpoint, and the job ends
with the parameters of an uninterrupted run made in the test (the same script on the shared pool's ranks, no
torchrun), bit for bit (torch.equal on every tensor).

The kill step is drawn from a seed that is printed (``AUTOPAR_KILL_SEED=<seed>`` draws it again).
2 ranks run in the suite; 4 ranks (where the order of a sum over ranks can change, which 2 cannot
show) are marked slow; tests/ranks/test_checkpoint.py checks that order on 4 ranks in the shared pool.
"""
from __future__ import annotations

import contextlib
import io
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import conftest

from examples import resume as example

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "resume.py"


def _torchrun(nproc: int, ckpt: Path, out: Path, steps: int, every: int, *extra: str) -> tuple[str, float]:
    """Run the example under torchrun (standalone rendezvous, up to 3 restarts); its stdout and wall time."""
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", "3", str(SCRIPT), "--steps", str(steps), "--ckpt-dir", str(ckpt),
           "--save-every", str(every), "--out", str(out), "--timeout", "30", *extra]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    wall = time.perf_counter() - start
    assert done.returncode == 0, f"torchrun failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout, wall


def _uninterrupted(rank: int, argv: list[str]) -> str:
    """The example's run on a rank of the shared pool (its group already made): rank 0's stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        example.main(argv)
    return out.getvalue()


def _when(log: str, pattern: str) -> float:
    m = re.search(pattern + r".* t=([0-9.]+)", log)
    assert m, f"no line matching {pattern!r} in:\n{log}"
    return float(m.group(1))


def _kill_and_compare(tmp_path, nproc: int, steps: int, every: int) -> None:
    seed = int(os.environ.get("AUTOPAR_KILL_SEED", random.randrange(2 ** 31)))
    draw = random.Random(seed)
    rank, at = draw.randrange(nproc), draw.randint(1, steps)
    print(f"kill seed {seed}: rank {rank} at step {at} of {steps} (AUTOPAR_KILL_SEED={seed} draws it again)")

    start = time.perf_counter()     # the uninterrupted run: the same script on the pool's ranks (no torchrun)
    plain = conftest._pool(nproc).run(conftest._fresh_call, _uninterrupted, [
        "--steps", str(steps), "--ckpt-dir", str(tmp_path / "plain"), "--save-every", str(every),
        "--out", str(tmp_path / "plain.pt")], timeout_s=400)[0]
    plain_wall = time.perf_counter() - start
    killed, killed_wall = _torchrun(nproc, tmp_path / "killed", tmp_path / "killed.pt", steps, every,
                                    "--kill-rank", str(rank), "--kill-at-step", str(at))

    assert "attempt 1" not in plain
    assert f"elastic: rank {rank} kills itself at step {at}" in killed, killed
    resumed = (at - 1) // every * every             # the newest checkpoint saved before the kill
    expect = f"attempt 1 resumed at step {resumed}" if resumed else "attempt 1 starts from step 0"
    assert f"elastic: {expect}" in killed, killed
    assert f"elastic: attempt 1 finished {steps} steps" in killed, killed

    want, got = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "killed.pt")
    assert got.keys() == want.keys()
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, f"after the restart these differ from the uninterrupted run: {different}"
    start = example.make_model(example.parse(["--steps", "1", "--ckpt-dir", "-", "--save-every", "1"])).state_dict()
    assert not torch.equal(want["wte.weight"], start["wte.weight"]), "the uninterrupted run did not train"

    restart = _when(killed, rf"attempt 1 trained step {resumed + 1}") - _when(killed, "kills itself")
    print(f"{nproc} ranks: restart (kill to first resumed step) {restart:.1f} s; wall {killed_wall:.1f} s killed, "
          f"{plain_wall:.1f} s uninterrupted")


def test_a_rank_killed_mid_training_restarts_and_ends_bit_identical_2_ranks(tmp_path):
    _kill_and_compare(tmp_path, nproc=2, steps=8, every=3)


@pytest.mark.slow
def test_a_rank_killed_mid_training_restarts_and_ends_bit_identical_4_ranks(tmp_path):
    _kill_and_compare(tmp_path, nproc=4, steps=20, every=5)
