"""Command line: ``autopar demo | plan | report | calibrate``."""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path


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


def _parse_mesh(text: str) -> tuple:
    try:
        return tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--mesh must look like 8 or 8x8, got {text!r}") from None


def _plan(argv) -> int:
    import autopar

    ap = argparse.ArgumentParser(prog="autopar plan", description="Plan a model without running it.")
    ap.add_argument("factory", help="MODULE:FACTORY returning (model, example_inputs[, loss_fn, example_target])")
    ap.add_argument("--mesh", default="8")
    ap.add_argument("--axes", default=None, help="comma-separated axis names, e.g. dp,tp")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--gpus-per-node", type=int, default=None)
    ap.add_argument("--mode", default="auto")
    ap.add_argument("--out", default=None, help="directory for plan.json and report.txt")
    ap.add_argument("--time-budget", type=float, default=None, metavar="S",
                    help="stop the search after S seconds (once a plan fits) and report the best so far")
    ap.add_argument("--quiet", action="store_true", help="no live progress line")
    args = ap.parse_args(argv)
    if args.time_budget is not None and args.time_budget <= 0:
        ap.error(f"--time-budget must be a positive number of seconds, got {args.time_budget:g}")
    mod_name, _, fn_name = args.factory.partition(":")
    if not fn_name:
        raise SystemExit("factory must be MODULE:FACTORY, e.g. examples.models:gpt_factory")
    sys.path.insert(0, ".")
    made = getattr(importlib.import_module(mod_name), fn_name)()
    model, inputs, *rest = made
    loss_fn, target = (rest + [None, None])[:2]
    axes = tuple(args.axes.split(",")) if args.axes else None
    mesh = autopar.Mesh(_parse_mesh(args.mesh), axis_names=axes, device=args.device, gpus_per_node=args.gpus_per_node)
    p = autopar.plan(model, mesh, example_inputs=inputs, loss_fn=loss_fn, example_target=target, mode=args.mode,
                     time_budget=args.time_budget, progress=not args.quiet)
    print(p.report())
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        p.save(out / "plan.json")
        (out / "report.txt").write_text(p.report())
        print(f"\nwrote {out / 'plan.json'} and {out / 'report.txt'}")
    return 0


def _report(argv) -> int:
    from autopar.plan import Plan

    ap = argparse.ArgumentParser(prog="autopar report")
    ap.add_argument("plan")
    args = ap.parse_args(argv)
    print(Plan.load(args.plan).report())
    return 0


def _calibrate(argv) -> int:
    from autopar.cost_models import calibrate

    return calibrate.main(argv) or 0


COMMANDS = {"demo": _demo, "plan": _plan, "report": _report, "calibrate": _calibrate}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: autopar {demo|plan|report|calibrate} [options]\n"
              "  demo       train a small GPT on 4 CPU processes and check it against one process\n"
              "  plan       plan MODULE:FACTORY on a (simulated) mesh and print the report\n"
              "  report     print the report of a saved plan.json\n"
              "  calibrate  measure this machine for the cost model", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
