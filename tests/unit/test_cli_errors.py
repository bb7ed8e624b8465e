"""`autopar plan` and `autopar report` with bad arguments: one line on stderr, a non-zero exit
(2 for usage errors), and no half-written plan.json."""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

import autopar.cli as cli

FACTORIES = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from examples.models import MLP

    def ok():
        return MLP(), (torch.randn(8, 32),), F.cross_entropy, torch.randint(0, 10, (8,))

    def returns_dict():
        return {"model": MLP()}

    def returns_a_name():
        return "mlp", (torch.randn(8, 32),)

    def raises():
        raise RuntimeError("no data here")

    def unreduced_loss():
        return (MLP(), (torch.randn(8, 32),), lambda o, t: F.cross_entropy(o, t, reduction="none"),
                torch.randint(0, 10, (8,)))

    NOT_A_FUNCTION = 3
""")


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "clifactories.py").write_text(FACTORIES)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])    # restored after the test (cli adds ".")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _run(capsys, *argv) -> tuple[int, str]:
    code = cli.main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize("argv, code, text", [
    (["nocolon"], 2, "autopar plan: error: FACTORY must be MODULE:FUNCTION, e.g. examples.factories:gpt2_small; "
                     "got 'nocolon'"),
    (["nosuchmodule:f"], 2, "no module named 'nosuchmodule' (from 'nosuchmodule:f'): run from the folder that holds "
                            "it, or add that folder to PYTHONPATH"),
    (["clifactories:nothere"], 2, "module 'clifactories' has no 'nothere'; its functions: ok, raises, returns_a_name, "
                                  "returns_dict, unreduced_loss"),
    (["clifactories:NOT_A_FUNCTION"], 2, "clifactories:NOT_A_FUNCTION is not a function (a int object)"),
    (["clifactories:returns_dict"], 2, "clifactories:returns_dict() returned a dict; it must return (model, "
                                       "example_inputs) or (model, example_inputs, loss_fn, example_target)"),
    (["clifactories:returns_a_name"], 2, "returned a str as the model; it must be a torch.nn.Module"),
    (["clifactories:raises"], 1, "clifactories:raises() raised RuntimeError: no data here"),
    (["clifactories:unreduced_loss", "--mesh", "2", "--quiet"], 1,
     "cannot plan clifactories:unreduced_loss: loss_fn returned a tensor of shape [8], not a scalar"),
    (["clifactories:ok", "--mesh", "2x"], 2, "--mesh must look like 8 or 8x8, got '2x'"),
    (["clifactories:ok", "--mesh", "0"], 2, "--mesh 0: Mesh((0,)): size 0 has no devices"),
    (["clifactories:ok", "--device", "h1000"], 2, "--device h1000: unknown device 'h1000'; presets:"),
    (["clifactories:ok", "--mode", "fast"], 2, "--mode: unknown parallel mode 'fast'"),
    (["clifactories:ok", "--out", "clifactories.py"], 2, "--out clifactories.py is a file; give a folder"),
])
def test_plan_with_a_bad_argument_prints_one_line(factories, capsys, argv, code, text):
    got, err = _run(capsys, "plan", *argv)
    assert got == code and text in err and "\n" not in err and "Traceback" not in err, err


def test_report_of_a_missing_truncated_or_folder_path(tmp_path, capsys):
    (tmp_path / "cut.json").write_text('{"format_version": 2, "mode": "da')
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    (tmp_path / "future.json").write_text('{"format_version": 99}')
    cases = [(tmp_path / "none.json", 2, f"autopar report: error: no plan file at {tmp_path / 'none.json'}"),
             (tmp_path / "cut.json", 2, f"{tmp_path / 'cut.json'} is not an autopar plan: plan JSON is not valid JSON "
                                        "(truncated, or not a plan file)"),
             (tmp_path / "config.json", 2, f"{tmp_path / 'config.json'} is not an autopar plan: a JSON object without "
                                           "'format_version' (its keys: 'model_type')"),
             (tmp_path / "future.json", 2, "plan format version 99 is not supported (expected"),
             (tmp_path, 2, f"{tmp_path} is a folder, not a plan file; pass the plan JSON inside it")]
    for path, code, text in cases:
        got, err = _run(capsys, "report", str(path))
        assert got == code and text in err and "\n" not in err, err


def test_a_failed_out_write_leaves_no_partial_plan(factories, capsys, monkeypatch):
    out = factories / "out"
    out.mkdir()
    (out / "plan.json").write_text("OLD")
    real = Path.write_text

    def disk_full(self, text, *args, **kwargs):
        real(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", disk_full)
    got, err = _run(capsys, "plan", "clifactories:ok", "--mesh", "2", "--mode", "data", "--quiet", "--out", str(out))
    assert got == 1 and f"cannot write to --out {out}: [Errno 28] No space left on device" in err, err
    assert (out / "plan.json").read_text() == "OLD" and sorted(p.name for p in out.iterdir()) == ["plan.json"]


def test_help_names_a_factory_that_exists(capsys):
    from examples import factories

    with pytest.raises(SystemExit) as done:
        cli.main(["plan", "--help"])
    assert done.value.code == 0
    assert "e.g. examples.factories:gpt2_small" in " ".join(capsys.readouterr().out.split())
    assert callable(factories.gpt2_small)
