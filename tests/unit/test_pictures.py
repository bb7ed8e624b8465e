"""The plan's pictures: which are written for a plain and a pipelined plan, what the memory bars add
up to, `autopar plan --out` listing them in report.txt, and what happens without matplotlib."""
from __future__ import annotations

import dataclasses
import sys
import textwrap

import pytest

import autopar
import autopar.cli as cli
from autopar.report.device_memory import device_groups
from autopar.report.memory_explain import PARTS
from autopar.report.pictures import PicturesUnavailable, save_alternatives, save_timeline
from examples.models import GPT, lm_loss
from oracle import make_batch

pytest.importorskip("matplotlib")

X, Y = make_batch("tokens", 8)
PNG = b"\x89PNG"


def _plan(model, mesh, mode, **ctx):
    autopar.reset_auto_parallel_context()
    try:
        autopar.set_auto_parallel_context(**ctx)
        return autopar.plan(model, mesh, example_inputs=(X,), loss_fn=lm_loss, example_target=Y, mode=mode)
    finally:
        autopar.reset_auto_parallel_context()


@pytest.fixture(scope="module")
def flat_plan():
    return _plan(GPT(qkv_bias=False, layers=2, hidden=32), autopar.Mesh(4), "data")


@pytest.fixture(scope="module")
def pipelined_plan():
    return _plan(GPT(qkv_bias=False, layers=4, hidden=32), autopar.Mesh((2,), axis_names=("pp",)), "auto",
                 schedule="1f1b", microbatches=4)


def _names(paths):
    return sorted(p.name for p in paths)


def test_a_plain_plan_draws_its_memory(flat_plan, tmp_path):
    assert not flat_plan.alternatives and not flat_plan.stages      # DATA: no search, no pipeline
    paths = flat_plan.save_pictures(tmp_path / "pics")
    assert _names(paths) == ["memory.png"]
    assert all(p.read_bytes()[:4] == PNG for p in paths)
    assert not [p for p in (tmp_path / "pics").iterdir() if p.name.startswith(".")]   # no temporary files left
    with pytest.raises(ValueError, match=r"no pipeline stages \(degrees\['pp'\] == 1\): there is no timeline"):
        save_timeline(flat_plan, tmp_path / "t.png")
    with pytest.raises(ValueError, match="lists no alternatives"):
        save_alternatives(flat_plan, tmp_path / "a.png")


def test_memory_bars_add_up_to_each_devices_peak(flat_plan, pipelined_plan):
    [group] = device_groups(flat_plan)                    # every device holds the same: one bar
    assert group.ranks == [0, 1, 2, 3] and group.label(4) == "all 4 devices"
    assert group.total == pytest.approx(flat_plan.memory_per_device[0])
    state = flat_plan.memory_breakdown["params+grads+optimizer"]
    assert sum(group.parts[k] for k in PARTS) == pytest.approx(state)
    assert group.parts["optimizer state"] == pytest.approx(2 * group.parts["parameters"])     # AdamW, fp32
    groups = device_groups(pipelined_plan)               # one bar per pipeline rank
    assert [g.stages for g in groups] == [[0], [1]] and groups[0].label(2) == "stage 0\ndevice 0"
    for g in groups:
        assert g.total == pytest.approx(pipelined_plan.memory_per_device[g.ranks[0]])
        assert g.parts["activations"] > 0
    fullest = max(groups, key=lambda g: g.total)
    state = pipelined_plan.memory_breakdown["params+grads+optimizer"]
    assert sum(fullest.parts[k] for k in PARTS) == pytest.approx(state)


def test_thousands_of_identical_devices_draw_one_bar(flat_plan, tmp_path):
    big = dataclasses.replace(flat_plan, mesh=autopar.Mesh(3072, device="a100-80gb"),
                              memory_per_device=[flat_plan.memory_per_device[0]] * 3072)
    [group] = device_groups(big)
    assert group.label(3072) == "all 3072 devices"
    assert "memory.png" in _names(big.save_pictures(tmp_path))


def test_a_pipelined_plan_draws_its_timeline(pipelined_plan, tmp_path):
    paths = pipelined_plan.save_pictures(tmp_path)
    assert "pipeline_timeline.png" in _names(paths) and "memory.png" in _names(paths)
    assert all(p.read_bytes()[:4] == PNG for p in paths)


FACTORY = textwrap.dedent("""
    from examples.models import GPT, lm_loss
    from oracle import make_batch

    def gpt():
        x, y = make_batch("tokens", 8)
        return GPT(qkv_bias=False, layers=2, hidden=32), (x,), lm_loss, y
""")


@pytest.fixture
def factory(tmp_path, monkeypatch):
    (tmp_path / "picfactory.py").write_text(FACTORY)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_plan_out_writes_the_pictures_and_lists_them_in_the_report(factory, capsys):
    """AUTO on 2 devices compares a pipelined and a data-parallel plan: the alternatives are drawn."""
    out = factory / "out"
    assert cli.main(["plan", "picfactory:gpt", "--mesh", "2", "--quiet", "--out", str(out)]) == 0
    written = {p.name for p in out.iterdir()}
    assert {"plan.json", "report.txt", "memory.png", "alternatives.png"} <= written
    pictures = (out / "report.txt").read_text().split("\npictures:\n")[1].splitlines()
    assert sorted(line.split()[0] for line in pictures) == sorted(n for n in written if n.endswith(".png"))
    printed = capsys.readouterr().out
    assert all(f"{out / n}" in printed for n in written)


def test_without_matplotlib_the_plan_and_report_are_written_and_the_pictures_skipped(factory, capsys, monkeypatch,
                                                                                       flat_plan):
    monkeypatch.setitem(sys.modules, "matplotlib", None)           # `import matplotlib...` raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(PicturesUnavailable, match=r"needs matplotlib, which is not installed: pip install "
                                                   r"'autopar\[plot\]'"):
        flat_plan.save_pictures(factory / "pics")
    out = factory / "out"
    assert cli.main(["plan", "picfactory:gpt", "--mesh", "2", "--mode", "data", "--quiet", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["plan.json", "report.txt"]
    skipped = "pictures skipped: matplotlib is not installed (pip install 'autopar[plot]' to draw them)"
    printed = capsys.readouterr().out
    assert printed.count(skipped) == 1 and skipped in (out / "report.txt").read_text()
