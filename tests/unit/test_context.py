"""MindSpore-style process-wide context and mode parsing."""
from __future__ import annotations

import autopar
from autopar import ParallelMode


def test_set_get_reset():
    autopar.set_auto_parallel_context(parallel_mode="data", grad_compression="bf16")
    ctx = autopar.get_auto_parallel_context()
    assert ctx["parallel_mode"] == ParallelMode.DATA and ctx["grad_compression"] == "bf16"
    autopar.reset_auto_parallel_context()
    assert autopar.get_auto_parallel_context()["parallel_mode"] == ParallelMode.AUTO


def test_mode_strings_and_members():
    for text, mode in [("data", ParallelMode.DATA), ("SEMI_AUTO", ParallelMode.SEMI_AUTO), ("auto", ParallelMode.AUTO),
                       ("hybrid", ParallelMode.HYBRID), ("stand_alone", ParallelMode.STAND_ALONE)]:
        assert ParallelMode.parse(text) is mode
    assert ParallelMode.parse(ParallelMode.AUTO) is ParallelMode.AUTO


def test_mesh_basics():
    m = autopar.Mesh((2, 4), axis_names=("dp", "tp"), device="h100")
    assert m.size == 8 and m.axis_size("tp") == 4 and m.coords(5) == (1, 1)
    assert autopar.Mesh.from_dict(m.to_dict()) == m
    assert autopar.Mesh(4).axis_names == ("d0",)
