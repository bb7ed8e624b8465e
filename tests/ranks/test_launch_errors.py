"""autopar.launch says which rank failed and why, the cause first: a rank that raised (not the peers
that lost it), a rank killed by a signal, a script without a main guard."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.runtime.rank_failure import Failure, describe


def _raise_while_peer_waits(rank):
    if rank == 1:
        time.sleep(0.3)
        raise ValueError("the real cause")
    dist.all_reduce(torch.ones(1))


def test_the_rank_that_raised_leads_its_peers_follow():
    with pytest.raises(autopar.RankError) as err:
        autopar.launch(_raise_while_peer_waits, nprocs=2, timeout_s=20)
    msg = str(err.value)
    assert msg.startswith("autopar.launch(_raise_while_peer_waits): rank 1 raised ValueError: the real cause\n"), msg
    # rank 0 follows the cause: it either failed on the lost peer already, or (on a loaded machine) was
    # still waiting for it when the grace period ended and was stopped; both are said after the cause
    follow = [m for m in ("--- rank 0 then failed because it lost a peer", "--- rank 0 was still running") if m in msg]
    assert follow, msg
    assert msg.index("--- rank 1 traceback ---") < msg.index(follow[0]), msg
    assert 'raise ValueError("the real cause")' in msg


def _killed(rank):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


def test_a_rank_killed_by_sigkill_is_named_with_what_to_check():
    with pytest.raises(autopar.RankError) as err:
        autopar.launch(_killed, nprocs=2, timeout_s=20)
    msg = str(err.value)
    assert msg.startswith("autopar.launch(_killed): rank 1 was killed by signal SIGKILL: it did not raise."), msg
    assert "OOM killer" in msg and "dmesg" in msg and "kill -9" in msg


def test_launch_without_a_main_guard_is_one_clear_error(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import autopar

        def work(rank):
            pass

        autopar.launch(work, nprocs=2, timeout_s=20)
    """))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0
    assert "autopar.launch(work) ran again in every process it started: they import" in out.stderr, out.stderr
    assert 'under `if __name__ == "__main__":`' in out.stderr
    assert out.stderr.count("Traceback") == 1 and "bootstrapping phase" not in out.stderr, out.stderr


def test_describe_orders_causes_before_lost_peers():
    lost = Failure(0, 1.0, "Traceback ...\nRuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1")
    cause = Failure(2, 2.0, "Traceback ...\nKeyError: 'w'")
    msg = describe("fn", [lost, cause])
    assert msg.startswith("fn: rank 2 raised KeyError: 'w'\n--- rank 2 traceback ---"), msg
    assert msg.endswith("(a consequence of the above, not a cause): RuntimeError: [pair.cc:553] Connection closed "
                        "by peer [127.0.0.1]:1")
    assert describe("fn", [lost]).startswith("fn: rank 0 raised RuntimeError")     # only peers: the first leads
    assert "rank 3 exited with code 3 without raising" in describe("fn", [], {3: 3})
