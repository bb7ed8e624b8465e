"""``autopar.core.rank_start``: ranks forked from a server that preloaded torch (and autopar when the server
would import this one), with the parent's environment applied. The pool's ranks: tests/ranks/test_rank_start_ranks.py."""
from __future__ import annotations

import os
from pathlib import Path

from autopar.core import rank_start

ROOT = Path(__file__).resolve().parents[2]


def test_apply_env_makes_the_environment_the_given_one(monkeypatch):
    monkeypatch.setenv("AUTOPAR_RANK_START_OLD", "1")
    monkeypatch.delenv("AUTOPAR_RANK_START_NEW", raising=False)
    saved = dict(os.environ)
    try:
        want = {k: v for k, v in saved.items() if k != "AUTOPAR_RANK_START_OLD"}
        rank_start.apply_env({**want, "AUTOPAR_RANK_START_NEW": "2"})
        assert os.environ.get("AUTOPAR_RANK_START_NEW") == "2" and "AUTOPAR_RANK_START_OLD" not in os.environ
        assert dict(os.environ) == {**want, "AUTOPAR_RANK_START_NEW": "2"}
    finally:
        rank_start.apply_env(saved)


def test_autopar_is_preloaded_only_where_the_server_finds_this_one(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert rank_start._server_finds_this_autopar()              # the server's path starts with its cwd
    other = tmp_path / "autopar"
    other.mkdir()
    (other / "__init__.py").write_text("")
    monkeypatch.chdir(tmp_path)                                   # another autopar first on the server's path
    assert not rank_start._server_finds_this_autopar()
    monkeypatch.chdir(tmp_path / "autopar")                       # none in cwd: PYTHONPATH's first is taken
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), str(tmp_path)]))
    assert rank_start._server_finds_this_autopar()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(ROOT)]))
    assert not rank_start._server_finds_this_autopar()


def test_the_start_method_is_the_fork_server_with_torch_preloaded():
    from multiprocessing import forkserver

    assert rank_start.start_method() == "forkserver"
    assert {"torch", "torch.distributed", "torch.export", "autopar.core.rank_preload"} <= set(
        forkserver._forkserver._preload_modules)
