"""Command line: ``autopar demo | plan | report | calibrate``."""
from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
from pathlib import Path
from autopar.cost_models.devices import mesh_device


def _demo(argv) -> int:
    root = Path(__file__).resolve().parent.parent
    if (root / "examples" / "demo.py").exists() and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        demo = importlib.import_module("examples.demo")
    except ImportError as err:
        print(f"autopar demo needs the repository's examples/ folder (run it from a clone): {err}", file=sys.stderr)
        return 2
    return demo.main(argv)


EXAMPLE = "examples.factories:gpt2_small"
RETURNS = "(model, example_inputs) or (model, example_inputs, loss_fn, example_target)"


class CliError(Exception):
    """What went wrong, in one line for stderr, and the exit code (2: a usage error)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def load_factory(spec: str) -> tuple:
    """Import MODULE, call FACTORY() and check that it returned ``RETURNS``; (model, inputs, loss_fn, target)."""
    mod_name, colon, fn_name = spec.partition(":")
    if not (colon and mod_name and fn_name):
        raise CliError(f"FACTORY must be MODULE:FUNCTION, e.g. {EXAMPLE}; got {spec!r}", 2)
    if "." not in sys.path:
        sys.path.insert(0, ".")
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as err:
        if err.name and (mod_name == err.name or mod_name.startswith(err.name + ".")):
            raise CliError(f"no module named {mod_name!r} (from {spec!r}): run from the folder that holds it, or add "
                           "that folder to PYTHONPATH", 2) from None
        raise CliError(f"importing {mod_name!r} failed: {err}") from None
    except Exception as err:  # noqa: BLE001 - the user's module: its error, in one line
        raise CliError(f"importing {mod_name!r} failed: {type(err).__name__}: {err}") from None
    fn = getattr(module, fn_name, None)
    if fn is None:
        names = sorted(n for n, v in vars(module).items()
                       if inspect.isfunction(v) and v.__module__ == module.__name__ and not n.startswith("_"))
        raise CliError(f"module {mod_name!r} has no {fn_name!r}; its functions: {', '.join(names) or 'none'}", 2)
    if not callable(fn):
        raise CliError(f"{spec} is not a function (a {type(fn).__name__} object); name a function returning "
                       f"{RETURNS}", 2)
    try:
        made = fn()
    except Exception as err:  # noqa: BLE001 - the user's factory: its error, in one line
        raise CliError(f"{spec}() raised {type(err).__name__}: {err}") from None
    return _check_made(spec, made)


def _check_made(spec: str, made) -> tuple:
    import torch
    import torch.nn as nn

    if not isinstance(made, (tuple, list)) or len(made) not in (2, 4):
        what = f"a {type(made).__name__}" + (f" of {len(made)}" if isinstance(made, (tuple, list)) else "")
        raise CliError(f"{spec}() returned {what}; it must return {RETURNS}", 2)
    model, inputs, *rest = made
    if not isinstance(model, nn.Module):
        raise CliError(f"{spec}() returned a {type(model).__name__} as the model; it must be a torch.nn.Module "
                       f"({RETURNS})", 2)
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else inputs
    if not isinstance(inputs, (tuple, list)) or not all(isinstance(x, torch.Tensor) for x in inputs):
        raise CliError(f"{spec}() returned example_inputs that are not a tensor or a tuple of tensors ({RETURNS})", 2)
    loss_fn, target = rest or (None, None)
    return model, tuple(inputs), loss_fn, target


def _mesh(args):
    import autopar

    try:
        shape = tuple(int(v) for v in args.mesh.lower().split("x"))
    except ValueError:
        raise CliError(f"--mesh must look like 8 or 8x8, got {args.mesh!r}", 2) from None
    axes = tuple(args.axes.split(",")) if args.axes else None
    try:
        mesh = autopar.Mesh(shape, axis_names=axes, device=args.device, gpus_per_node=args.gpus_per_node)
    except (TypeError, ValueError) as err:
        raise CliError(f"--mesh {args.mesh}" + (f" --axes {args.axes}" if args.axes else "") + f": {err}", 2) from None
    try:
        mesh_device(mesh)
    except ValueError as err:
        raise CliError(f"--device {args.device}: {err}", 2) from None
    return mesh


def _check_out(out: Path) -> None:
    """Refuse an --out that cannot be written before planning, not after."""
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out} is a file; give a folder (plan.json, report.txt and the pictures are written "
                       "into it)", 2)
    existing = next(p for p in [out, *out.parents] if p.exists())
    if not os.access(existing, os.W_OK):
        raise CliError(f"--out {out}: {existing} is not writable", 2)


def _plan(argv) -> int:
    import autopar
    from autopar.plan.plan import write_atomic

    ap = argparse.ArgumentParser(prog="autopar plan", description="Plan a model without running it.")
    ap.add_argument("factory", help=f"MODULE:FUNCTION returning {RETURNS}, e.g. {EXAMPLE}")
    ap.add_argument("--mesh", default="8")
    ap.add_argument("--axes", default=None, help="comma-separated axis names, e.g. dp,tp")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--gpus-per-node", type=int, default=None)
    ap.add_argument("--mode", default="auto")
    ap.add_argument("--out", default=None, help="folder for plan.json, report.txt and the plan's pictures (PNG)")
    ap.add_argument("--time-budget", type=float, default=None, metavar="S",
                    help="stop the search after S seconds (once a plan fits) and report the best so far")
    ap.add_argument("--quiet", action="store_true", help="no live progress line")
    args = ap.parse_args(argv)
    if args.time_budget is not None and args.time_budget <= 0:
        ap.error(f"--time-budget must be a positive number of seconds, got {args.time_budget:g}")
    try:
        mode = autopar.ParallelMode.parse(args.mode)
    except ValueError as err:
        raise CliError(f"--mode: {err}", 2) from None
    mesh = _mesh(args)
    out = Path(args.out) if args.out else None
    if out is not None:
        _check_out(out)
    model, inputs, loss_fn, target = load_factory(args.factory)
    try:
        p = autopar.plan(model, mesh, example_inputs=inputs, loss_fn=loss_fn, example_target=target, mode=mode,
                         time_budget=args.time_budget, progress=not args.quiet)
    except (autopar.PlanError, autopar.TraceError, ValueError) as err:
        raise CliError(f"cannot plan {args.factory}: {err}") from None
    report = p.report()
    print(report)
    if out is not None:
        try:
            out.mkdir(parents=True, exist_ok=True)
            p.save(out / "plan.json")               # each file whole or not at all
            pictures, listed = _pictures(p, out)
            write_atomic(out / "report.txt", report + "\n\n" + "\n".join(listed))
        except OSError as err:
            raise CliError(f"cannot write to --out {out}: {err}") from None
        print(f"\nwrote {', '.join(str(f) for f in [out / 'plan.json', out / 'report.txt', *pictures])}")
    return 0


PICTURES_SKIPPED = "pictures skipped: matplotlib is not installed (pip install 'autopar[plot]' to draw them)"


def _pictures(plan, out: Path) -> tuple[list[Path], list[str]]:
    """Draw the plan's pictures into ``out``: (their paths, report.txt's lines naming them); without
    matplotlib, none, and one line saying so (printed too: the plan and report are written all the same)."""
    from autopar.report.pictures import PicturesUnavailable, picture_lines, save_pictures

    try:
        paths = save_pictures(plan, out)
    except PicturesUnavailable:
        print(f"\n{PICTURES_SKIPPED}")
        return [], [PICTURES_SKIPPED]
    return paths, picture_lines(paths)


def _report(argv) -> int:
    from autopar.plan.plan import Plan

    ap = argparse.ArgumentParser(prog="autopar report", description="Print the report of a saved plan.")
    ap.add_argument("plan", help="a plan JSON (autopar plan --out DIR writes DIR/plan.json)")
    args = ap.parse_args(argv)
    try:
        plan = Plan.load(args.plan)
    except (FileNotFoundError, IsADirectoryError, ValueError) as err:   # a bad argument: not a (readable) plan
        raise CliError(str(err), 2) from None
    except OSError as err:
        raise CliError(str(err)) from None
    print(plan.report())
    return 0


def _calibrate(argv) -> int:
    from autopar.cost_models import calibrate

    return calibrate.main(argv) or 0


COMMANDS = {"demo": _demo, "plan": _plan, "report": _report, "calibrate": _calibrate}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"autopar: unknown command {argv[0]!r}", file=sys.stderr)
        print("usage: autopar {demo|plan|report|calibrate} [options]\n"
              "  demo       train a small GPT on 4 CPU processes and check it against one process\n"
              f"  plan       plan MODULE:FACTORY (e.g. {EXAMPLE}) on a (simulated) mesh and print the report\n"
              "  report     print the report of a saved plan.json\n"
              "  calibrate  measure this machine for the cost model", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except CliError as err:
        print(f"autopar {argv[0]}: error: {err}", file=sys.stderr)
        return err.code


if __name__ == "__main__":
    sys.exit(main())
