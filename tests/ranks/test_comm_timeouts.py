"""A dead or stalled peer ends the job with a clear error within the communication timeout (issue 15,
part 3): every group autopar makes carries the one timeout (``comm_timeout_s``, else the default
group's); a rank whose peer died or stalled raises a ``CommError`` naming what it waited in (the
collective and its mesh axis, or the pipeline transfer and its peer rank), the step, and what to do;
``autopar.launch`` ends and leads with the rank that died or stalled.

A killed rank breaks the process group, so the failure cases run under their own ``autopar.launch``
(2 ranks, a 3 s timeout), not in the shared pool; a stall runs in the pool on groups of its own."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.collectives.watch import failure_kind, guard, note
from autopar.core.comm_timeout import DEFAULT_TIMEOUT_S, comm_timeout_s, group_timeout_s, using
from autopar.core.errors import CommError
from autopar.runtime.launch import _GRACE_S, _MIN_SETTLE_S
from autopar.runtime.rank_failure import Failure, describe
from conftest import run_ranks
from examples.models import GPT, MLP, lm_loss

TIMEOUT_S = 3.0
SLACK_S = 6.0       # a 2-core machine at load 10: a rank's error, its exit, the launcher's poll

GLOO_TIMEOUT = ("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms "
                "for recv operation to complete")
GLOO_LOST = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
             "[127.0.0.1]:1234. This is typically caused by a remote worker crashing. GLHF!")


# ---- the timeout and the message, without processes ---------------------------------------

def test_the_timeout_is_the_call_then_the_context_then_the_default():
    assert comm_timeout_s() == DEFAULT_TIMEOUT_S                 # no process group in this process
    autopar.set_auto_parallel_context(comm_timeout_s=7)
    assert comm_timeout_s() == 7.0
    with using(2.5):
        assert comm_timeout_s() == 2.5
    assert comm_timeout_s() == 7.0
    for bad in (0, -1, "5", True):
        with pytest.raises(ValueError, match=r"comm_timeout_s must be a number of seconds > 0 \(or None: the "
                                             r"default process group's timeout\)"):
            autopar.set_auto_parallel_context(comm_timeout_s=bad)
    with pytest.raises(ValueError, match="comm_timeout_s must be a number of seconds > 0"):
        autopar.parallelize(torch.nn.Linear(2, 2), autopar.Mesh(1), example_inputs=(torch.ones(1, 2),),
                            comm_timeout_s=0)


def test_guard_names_the_collective_the_step_and_what_to_do():
    with pytest.raises(CommError) as err:
        with guard("pmodel.step (step 4 of this process)", 3.0):
            note("all_reduce", "dp", "bwd")
            raise RuntimeError(GLOO_TIMEOUT)
    msg = str(err.value)
    assert msg.startswith("pmodel.step (step 4 of this process) timed out after 3 s waiting in the all_reduce over "
                          "mesh axis 'dp' (backward): a peer rank did not take part in time; it stalled"), msg
    assert "Check the other ranks' logs" in msg and "comm_timeout_s=..." in msg and "(now 3 s)" in msg
    assert msg.endswith("(torch.distributed: Timed out waiting 3000ms for recv operation to complete)"), msg
    assert "\n" not in msg and err.value.how == "timeout" and err.value.timeout_s == 3.0

    with pytest.raises(CommError) as err:
        with guard("pmodel.step (step 2 of this process)", 5.0):
            note("p2p receive", peer=3, detail="of the gradient of transfer 0 (add), microbatch 1, from rank 3")
            raise RuntimeError(GLOO_LOST)
    msg = str(err.value)
    assert "failed in the p2p receive of the gradient of transfer 0 (add), microbatch 1, from rank 3: a peer rank " \
           "closed its connection: it died (killed or crashed)" in msg, msg
    assert "Check rank 3's log for the first error" in msg and err.value.peer == 3
    assert msg.endswith("(torch.distributed: Connection closed by peer [127.0.0.1]:1234)"), msg


def test_guard_leaves_other_errors_alone():
    with pytest.raises(ValueError, match="not communication"):
        with guard("pmodel.step (step 1 of this process)"):
            raise ValueError("not communication")
    with pytest.raises(RuntimeError, match="^shape mismatch$"):
        with guard("pmodel.step (step 1 of this process)"):
            raise RuntimeError("shape mismatch")
    assert failure_kind(RuntimeError("Got the following error when running the callback: RuntimeError: "
                                     "Application timeout caused pair closure")) == "timeout"
    assert failure_kind(RuntimeError("the timeout argument is wrong")) is None


def test_launch_leads_with_the_stalled_rank_and_its_stack():
    lost = Failure(0, 1.0, "Traceback ...\nautopar.core.errors.CommError: rank 0: pmodel.step (step 2 of this process) "
                           "timed out after 3 s waiting in the all_reduce over mesh axis 'd0' (backward): ...")
    msg = describe("fn", [lost], running={1: '  File "train.py", line 9 in fn'}, grace_s=0.5)
    assert msg.startswith("fn: rank 1 stalled: it had not failed but was still running 0.5 s after the first rank "
                          "failed, when every other rank had failed waiting for it"), msg
    assert '--- rank 1 was here when it was stopped (its Python stack, most recent call first) ---\n  File ' \
           '"train.py", line 9 in fn' in msg
    assert msg.endswith("then failed because it lost a peer (a consequence of the above, not a cause): "
                        "autopar.core.errors.CommError: rank 0: pmodel.step (step 2 of this process) timed out after 3 s "
                        "waiting in the all_reduce over mesh axis 'd0' (backward): ...")
    two = describe("fn", [lost], running={1: "", 2: ""}, grace_s=6.0)
    assert two.startswith("fn: ranks 1, 2 had not failed but were still running 6.0 s after the first rank failed: "
                          "one of them stalled"), two
    killed = describe("fn", [lost], {2: -signal.SIGKILL}, running={1: ""}, grace_s=2.0)
    assert killed.startswith("fn: rank 2 was killed by signal SIGKILL"), killed
    assert "--- rank 1 was still running 2.0 s after the first failure (waiting for a peer) and was here" in killed


# ---- every group autopar makes carries the timeout (the shared pool) -------------------------

def _group_timeouts(rank, seconds):
    from autopar.core.comm_timeout import world_group

    autopar.set_auto_parallel_context(zero=1)
    torch.manual_seed(0)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    pm = autopar.parallelize(MLP(), autopar.Mesh((2, 2), axis_names=("dp", "tp")), example_inputs=(x,),
                             loss_fn=F.cross_entropy, example_target=y, mode="auto", comm_timeout_s=seconds)
    pm.step(x, target=y)
    groups = {f"axis {n}": g.group for n, g in pm._axes.items()}
    groups.update({f"zero {s.label}": s.group for s in pm._zero.sets}, world=pm._world)
    with using(seconds):
        groups["spare world"] = world_group()
    return {"module": pm.comm_timeout_s, "default": group_timeout_s(),
            "groups": {k: group_timeout_s(g) for k, g in groups.items()}}


@pytest.mark.parametrize("seconds", [None, 7.0])
def test_every_group_a_module_uses_has_the_timeout(seconds):
    for r in run_ranks(4, _group_timeouts, seconds):
        want = seconds if seconds is not None else r["default"]      # None: the default group's (the pool's)
        assert r["module"] == want
        assert r["groups"] and set(r["groups"].values()) == {want}, r["groups"]
        assert any(k.startswith("zero dp") for k in r["groups"]), r["groups"]


def _pipeline_timeouts(rank):
    autopar.set_auto_parallel_context(schedule="1f1b", microbatches=2)
    torch.manual_seed(0)
    x = torch.randint(0, 32, (4, 8))
    pm = autopar.parallelize(GPT(vocab=32, hidden=16, heads=2, layers=2, seq=8, qkv_bias=False),
                             autopar.Mesh((2,), axis_names=("pp",)), example_inputs=(x,), loss_fn=lm_loss,
                             example_target=x, comm_timeout_s=6.0)
    pm.step(x, target=x)
    return {"executor": pm._executor.timeout_s, "pp": group_timeout_s(pm._axes["pp"].group),
            "ties": [group_timeout_s(g) for g in pm._ties.values()]}


def test_pipeline_waits_and_tie_groups_use_the_timeout():
    for r in run_ranks(2, _pipeline_timeouts):
        assert r["executor"] == r["pp"] == 6.0
        assert r["ties"] == [6.0]           # GPT's tied embedding: its stages' group


def _slow_build(rank):
    """Rank 1 builds its module 4 s later than rank 0 (as a slower rank under load does) under a 2 s
    timeout: set-up waits for it; the groups it makes then time out after 2 s."""
    import autopar.api as api

    real = api.build_parallel_module

    def late(*args, **kwargs):
        time.sleep(4.0)
        return real(*args, **kwargs)

    autopar.set_auto_parallel_context(schedule="1f1b", microbatches=2)
    torch.manual_seed(0)
    x = torch.randint(0, 32, (4, 8))
    if rank == 1:
        api.build_parallel_module = late
    try:
        pm = autopar.parallelize(GPT(vocab=32, hidden=16, heads=2, layers=2, seq=8), autopar.Mesh((2,), axis_names=("pp",)),
                                 example_inputs=(x,), loss_fn=lm_loss, example_target=x, comm_timeout_s=2.0)
        loss = pm.step(x, target=x)
    finally:
        api.build_parallel_module = real
    return float(loss), group_timeout_s(pm._axes["pp"].group)


def test_a_rank_slower_to_build_its_module_is_waited_for_and_its_groups_keep_the_timeout():
    out = run_ranks(2, _slow_build)
    assert all(t == 2.0 for _, t in out), out
    assert all(loss == loss for loss, _ in out), out         # both trained a step


# ---- a peer that dies or stalls under autopar.launch ----------------------------------------

def _mark(folder: str, name: str, **data) -> None:
    with open(os.path.join(folder, f"{name}.json"), "w") as f:
        json.dump({"t": time.time(), **data}, f)


def _read(folder: str, name: str) -> dict:
    with open(os.path.join(folder, f"{name}.json")) as f:
        return json.load(f)


def _train(rank, plan: str, what: str, folder: str):
    """Four steps; rank 1 dies in the middle of step 3's backward, or sleeps before step 3 (well past DDP's
    first forward, where it agrees on its buckets)."""
    torch.manual_seed(0)
    if plan == "pipeline":
        autopar.set_auto_parallel_context(schedule="1f1b", microbatches=2)
        x = y = torch.randint(0, 32, (4, 8))
        model, loss, mesh = GPT(vocab=32, hidden=16, heads=2, layers=2, seq=8), lm_loss, ("pp",)
    else:
        x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
        model, loss, mesh = MLP(), F.cross_entropy, ("dp",)
    pm = autopar.parallelize(model, autopar.Mesh((2,), axis_names=mesh), example_inputs=(x,), loss_fn=loss,
                             example_target=y, mode="auto" if plan == "pipeline" else "data")
    for step in (1, 2, 3, 4):
        if rank == 1 and step == 3:
            _mark(folder, "event")
            if what == "kill":
                next(pm.parameters()).register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
            else:
                time.sleep(60)
        try:
            pm.step(x, target=y)
        except CommError as err:
            _mark(folder, f"rank{rank}", message=str(err))
            raise


def _launch(plan: str, what: str, folder) -> tuple[str, float]:
    """The RankError text and the seconds from the kill or stall to launch returning."""
    with pytest.raises(autopar.RankError) as err:
        autopar.launch(_train, nprocs=2, args=(plan, what, str(folder)), timeout_s=TIMEOUT_S)
    return str(err.value), time.time() - _read(folder, "event")["t"]


def test_a_rank_killed_mid_step_is_named_and_its_peer_fails_at_once(tmp_path):
    msg, ended = _launch("data", "kill", tmp_path)
    assert msg.startswith("autopar.launch(_train): rank 1 was killed by signal SIGKILL: it did not raise."), msg
    peer = _read(tmp_path, "rank0")
    assert peer["message"].startswith("rank 0: pmodel.step (step 3 of this process) failed in the all_reduce over "
                                      "mesh axis 'dp' (backward): a peer rank closed its connection: it died "
                                      "(killed or crashed)"), peer
    assert "Check the other ranks' logs for the first error" in peer["message"]
    assert peer["t"] - _read(tmp_path, "event")["t"] < TIMEOUT_S        # at once, not after the timeout
    assert ended < TIMEOUT_S + _GRACE_S + SLACK_S, ended


def _stalled_collective(rank, seconds):
    """Rank 1 sleeps through step 3 (in the pool: its process group lives on; only the groups made for
    ``seconds``, which no other test uses, see the timeout, and they are dropped after)."""
    from autopar.core import comm_timeout
    from autopar.collectives import groups

    torch.manual_seed(0)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    pm = autopar.parallelize(MLP(), autopar.Mesh((2,), axis_names=("dp",)), example_inputs=(x,),
                             loss_fn=F.cross_entropy, example_target=y, mode="data", comm_timeout_s=seconds)
    try:
        pm.step(x, target=y)
        pm.step(x, target=y)            # well past DDP's first forward, where it agrees on its buckets
        if rank == 1:
            time.sleep(seconds + 1.5)
            return None
        t0 = time.perf_counter()
        try:
            pm.step(x, target=y)
        except CommError as err:
            return str(err), time.perf_counter() - t0
        return "no error", time.perf_counter() - t0
    finally:
        comm_timeout._WORLD_GROUPS.pop(seconds, None)
        for cache in (groups._DM_CACHE, groups._SPANS):
            for key in [k for k in cache if k[-1] == seconds]:
                del cache[key]


def test_a_stalled_rank_times_its_peer_out_within_the_timeout():
    seconds = 2.0
    message, waited = run_ranks(2, _stalled_collective, seconds)[0]
    assert message.startswith("rank 0: pmodel.step (step 3 of this process) timed out after 2 s waiting in the "
                              "all_reduce over mesh axis 'dp'"), message
    assert "it stalled (stuck in other code, waiting on something else, or much slower than this rank)" in message
    assert "comm_timeout_s=...) or parallelize(..., comm_timeout_s=...) (now 2 s)" in message
    assert seconds - 0.5 < waited < seconds + SLACK_S, waited


def test_a_pipeline_stage_waiting_on_a_stalled_peer_names_the_transfer_and_the_peer(tmp_path):
    msg, ended = _launch("pipeline", "stall", tmp_path)
    assert msg.startswith("autopar.launch(_train): rank 1 stalled: it had not failed but was still running"), msg
    assert "--- rank 1 was here when it was stopped" in msg and "in _train" in msg, msg
    event = _read(tmp_path, "event")["t"]
    peer, failed = _read(tmp_path, "rank0")["message"], _read(tmp_path, "rank0")["t"]
    assert TIMEOUT_S - 0.5 < failed - event < TIMEOUT_S + SLACK_S, failed - event
    assert peer.startswith("rank 0: pmodel.step (step 3 of this process) timed out after 3 s waiting in the p2p "
                           "receive of the gradient of transfer "), peer
    assert "microbatch 0, from rank 1 (pipeline stage 1)" in peer and "Check rank 1's log" in peer, peer
    assert ended < TIMEOUT_S + _MIN_SETTLE_S + SLACK_S, ended
