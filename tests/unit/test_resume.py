"""CheckpointManager (runtime/resume.py): numbered checkpoints every k steps, the newest n kept, and on
start the newest COMPLETE one, so the save that was running when a rank died is skipped. Real saves
through pmodel.save on a Mesh(1) (no process group); the multi-rank, torchrun side is test_elastic.py."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import autopar
from autopar import CheckpointManager, CheckpointError, latest_checkpoint
from autopar.runtime import resume
from examples.models import GPT, lm_loss
from oracle import make_batch

MODEL = dict(vocab=32, hidden=16, heads=2, layers=1, seq=8, qkv_bias=False)


def _job(seed: int = 0):
    x, y = make_batch("tokens", 4, vocab=32, seq=8)
    torch.manual_seed(seed)
    pm = autopar.parallelize(GPT(**MODEL), autopar.Mesh(1), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                             mode="data")
    return pm, torch.optim.AdamW(pm.parameters(), lr=1e-2), (x, y)


def _steps(pm, opt, batch, first: int, last: int, ckpts=None, async_=False) -> None:
    for step in range(first, last + 1):
        pm.step(batch[0], target=batch[1])
        opt.step()
        opt.zero_grad()
        if ckpts is not None:
            fut = ckpts.maybe_save(pm, opt, step, async_=async_)
            if async_ and fut is not None:
                fut.result()


def _names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def _half_written(done: Path, step: int) -> Path:
    """What a save killed mid-way leaves: its temporary folder, data files but no .metadata."""
    tmp = done.with_name(f"step-{step}.tmp-0123456789ab")
    shutil.copytree(done, tmp)
    (tmp / ".metadata").unlink()
    return tmp


def test_saves_every_k_keeps_the_newest_n_and_resumes_from_the_newest_complete(tmp_path):
    pm, opt, batch = _job()
    ckpts = CheckpointManager(tmp_path / "run", every=2, keep=2)
    assert ckpts.resume(pm, opt) == 0                 # nothing there yet: a fresh start
    _steps(pm, opt, batch, 1, 6, ckpts)
    assert _names(tmp_path / "run") == ["step-4", "step-6"]
    at6 = pm.full_state_dict()
    dead = _half_written(tmp_path / "run" / "step-6", 8)    # the save of step 8, killed before its rename
    old = tmp_path / "run" / "step-5.tmp-ba9876543210"
    shutil.copytree(dead, old)

    again, opt2, _ = _job(seed=1)                     # other initial values: all must come from step-6
    assert CheckpointManager(tmp_path / "run", every=2).resume(again, opt2) == 6
    got = again.full_state_dict()
    assert all(torch.equal(got[k], at6[k]) for k in at6)
    _steps(pm, opt, batch, 7, 7)
    _steps(again, opt2, batch, 7, 7)
    assert all(torch.equal(a, b) for a, b in zip(pm.full_state_dict().values(), again.full_state_dict().values()))

    ckpts.save(again, opt2, 7)
    # step 7 complete; a leftover of an earlier step (5) is removed, the one of a later step (8) may still be written
    assert _names(tmp_path / "run") == ["step-6", "step-7", dead.name]


def test_async_saves_prune_before_their_future_completes(tmp_path):
    pm, opt, batch = _job()
    ckpts = CheckpointManager(tmp_path, every=1, keep=1)
    _steps(pm, opt, batch, 1, 3, ckpts, async_=True)
    assert _names(tmp_path) == ["step-3"]


def test_latest_is_the_highest_step_not_the_last_name(tmp_path):
    for step in (9, 10, 100, 20):
        (tmp_path / f"step-{step}").mkdir()
        (tmp_path / f"step-{step}" / ".metadata").write_bytes(b"")
    (tmp_path / "step-200.tmp-00000000abcd").mkdir()          # unfinished: skipped
    (tmp_path / "step-300.old-00000000abcd").mkdir()          # moved aside by a commit: skipped
    (tmp_path / "plan.json").write_text("{}")                 # anything else: ignored
    (tmp_path / "step-x").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-100"
    assert [s for s, _ in resume.complete_checkpoints(tmp_path)] == [9, 10, 20, 100]
    assert latest_checkpoint(tmp_path / "not-yet") is None


def test_a_step_folder_without_metadata_is_skipped_with_a_warning(tmp_path):
    (tmp_path / "step-4").mkdir()
    (tmp_path / "step-4" / ".metadata").write_bytes(b"")
    (tmp_path / "step-8").mkdir()
    with pytest.warns(RuntimeWarning, match=r"step-8 is not a complete checkpoint \(it has no \.metadata file, "
                                            r"which pmodel\.save writes last\); skipping it"):
        assert latest_checkpoint(tmp_path) == tmp_path / "step-4"


def test_a_directory_that_is_a_file_says_so(tmp_path):
    f = tmp_path / "ckpts"
    f.write_text("not a folder")
    with pytest.raises(CheckpointError, match=rf"the checkpoint directory {f} is a file; pass a directory \(it is "
                                              r"created on the first save if missing\)"):
        CheckpointManager(f, every=2).latest()


def test_an_unreadable_directory_says_what_to_do(tmp_path, monkeypatch):
    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "iterdir", denied)
    with pytest.raises(CheckpointError, match=rf"cannot list the checkpoint directory {tmp_path}: Permission denied; "
                                              "give this process read access to it, or pass another directory"):
        latest_checkpoint(tmp_path)


@pytest.mark.parametrize("kwargs, message", [
    (dict(every=0), "every must be a whole number >= 1, got 0"),
    (dict(every=2.5), "every must be a whole number >= 1, got 2.5"),
    (dict(every=True), "every must be a whole number >= 1, got True"),
    (dict(every=2, keep=0), "keep must be a whole number >= 1, got 0"),
])
def test_bad_settings_name_the_setting(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=f"CheckpointManager: {message}"):
        CheckpointManager(tmp_path, **kwargs)


def test_a_directory_that_is_no_path_and_a_bad_step(tmp_path):
    with pytest.raises(TypeError, match="CheckpointManager: directory must be a path, got int"):
        CheckpointManager(3, every=2)
    with pytest.raises(ValueError, match="CheckpointManager: step must be a whole number >= 0, got -1"):
        CheckpointManager(tmp_path, every=2).maybe_save(None, None, -1)


def test_a_torchrun_store_that_outlives_restarts_is_refused_before_training(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.raises(RuntimeError, match=r"torchrun may restart this job \(--max-restarts 3\) but shares its "
                                           r"rendezvous store .* Launch torchrun with "
                                           r"TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment"):
        resume.check_restartable()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")      # what the variable makes torchrun say
    resume.check_restartable()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")             # no restart: the store is never reused
    resume.check_restartable()
