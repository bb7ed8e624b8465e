"""Benchmark (issue 3): autopar tensor parallelism vs torch DTensor TP, and the solve time
of a 48-layer GPT on tp=8.

Part 1, step time on 4 gloo ranks (one thread each), one process group, interleaved rounds.
Two models (bench/tp_models.py): a wide residual MLP (d -> 4d -> d blocks) and a stack of
pre-LN transformer blocks (separate q/k/v so Megatron column/row splits apply), MSE loss,
AdamW. Contenders per model:

  autopar-auto  autopar.parallelize(..., Mesh(4, axis_names=("tp",)), mode="auto")
  autopar-semi  (only when AUTO's parameter placements are not Megatron's) the Megatron plan
                given as annotations: autopar.shard({"blocks.*.q": ColwiseParallel(), ...},
                axis="tp"), mode="semi_auto"
  dtensor       torch parallelize_module(model, init_device_mesh("cpu", (4,), ("tp",)),
                {...: ColwiseParallel()/RowwiseParallel()}) - the expert Megatron plan

Prints whether AUTO's plan is Megatron-style, medians, ratios autopar/dtensor (target
<= 1.0) and spread.

Part 2: autopar.plan of a GPT-2-XL-sized GPT (48 layers, 1.5B parameters) on the meta
device for Mesh(8, axis_names=("tp",), device="a100-80gb"), mode "auto", in a fresh
process: wall time, plan.solve_time (target <= 10 s), what it chose.

    .venv/bin/python bench/tensor_parallel.py [--quick] [--reps N] [--skip-plan] [--skip-step]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Ratio, check, header, interleaved, run_fresh, training_step  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

CASES = {
    "mlp": {"kind": "mlp", "d": 1024, "ffn": 4096, "depth": 2, "batch": 64},
    "blocks": {"kind": "blocks", "hidden": 256, "heads": 8, "layers": 4, "seq": 128, "batch": 8},
}
QUICK_CASES = {
    "mlp": {"kind": "mlp", "d": 512, "ffn": 2048, "depth": 2, "batch": 32},
    "blocks": {"kind": "blocks", "hidden": 128, "heads": 8, "layers": 2, "seq": 64, "batch": 8},
}


def build(case: dict):
    from tp_models import BlockStack, WideMLP

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if case["kind"] == "mlp":
        model = WideMLP(case["d"], case["ffn"], case["depth"])
        x = torch.randn(case["batch"], case["d"], generator=g)
    else:
        model = BlockStack(case["hidden"], case["heads"], case["layers"])
        x = torch.randn(case["batch"], case["seq"], case["hidden"], generator=g)
    return model, x, torch.randn(x.shape, generator=g)


def plan_summary(plan, case: dict) -> dict:
    from tp_models import expected_specs

    model, _, _ = build(case)
    want = expected_specs(case["kind"], model)
    got = {n: d.spec for n, d in plan.params.items() if d.kind == "parameter"}
    diffs = sorted(n for n in want if got.get(n) != want[n])
    colls = Counter(f"{c.kind}/{c.phase}" for c in plan.collectives(0))
    return {"megatron": not diffs, "param_diffs": len(diffs), "example_diff": diffs[:3],
            "example_got": [got.get(n) for n in diffs[:3]], "collectives": dict(colls),
            "n_collectives": sum(colls.values()), "step_time": plan.step_time}


def rank_tp_times(rank: int, case: dict, reps: int, warmup: int, force_semi: bool) -> dict:
    import autopar
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from tp_models import torch_plan

    world = dist.get_world_size()
    model, x, y = build(case)
    fns, info = {}, {}

    def autopar_contender(mode):
        model, _, _ = build(case)
        pmodel = autopar.parallelize(model, autopar.Mesh(world, axis_names=("tp",)), example_inputs=(x,),
                                     loss_fn=F.mse_loss, example_target=y, mode=mode)
        step, losses = training_step(pmodel, x, y)

        return step, pmodel, losses

    autopar.clear_annotations()
    autopar.reset_auto_parallel_context()
    fns["autopar-auto"], pm_auto, l_auto = autopar_contender("auto")
    info["auto"] = plan_summary(pm_auto.plan, case)
    losses = {"autopar-auto": l_auto}
    if force_semi or not info["auto"]["megatron"]:
        autopar.shard(torch_plan(case["kind"]), axis="tp")
        try:
            fns["autopar-semi"], pm_semi, losses["autopar-semi"] = autopar_contender("semi_auto")
        finally:
            autopar.clear_annotations()
        info["semi"] = plan_summary(pm_semi.plan, case)

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    tmodel, _, _ = build(case)
    tmodel = parallelize_module(tmodel, mesh, torch_plan(case["kind"]))
    topt = torch.optim.AdamW(tmodel.parameters(), lr=1e-3)
    losses["dtensor"] = []

    def dtensor_step():
        loss = F.mse_loss(tmodel(x), y)
        loss.backward()
        topt.step()
        topt.zero_grad()
        losses["dtensor"].append(float(loss.detach()))

    fns["dtensor"] = dtensor_step
    times = interleaved(fns, reps=reps, warmup=warmup)
    return {"times": times, "info": info, "first_loss": {k: v[0] for k, v in losses.items()}}


def step_benchmark(cases: dict, reps: int, warmup: int, force_semi: bool = False, nprocs: int = 4) -> dict:
    from autopar.runtime.launch import RankPool

    pool = RankPool(nprocs, timeout_s=600)
    out = {}
    try:
        for name, case in cases.items():
            out[name] = pool.run(rank_tp_times, case, reps, warmup, force_semi, timeout_s=900)[0]
    finally:
        pool.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller models, fewer rounds (~1-2 min)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--semi", action="store_true", help="run the SEMI_AUTO Megatron version even if AUTO is Megatron")
    ap.add_argument("--skip-plan", action="store_true")
    ap.add_argument("--skip-step", action="store_true")
    ap.add_argument("--profile", default=None, help="calibration profile for the 'cpu' device (sets AUTOPAR_PROFILE "
                    "for this process and its ranks; default: whatever AUTOPAR_PROFILE / the machine's profile says)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.profile:
        os.environ["AUTOPAR_PROFILE"] = os.path.abspath(args.profile)
    cases = QUICK_CASES if args.quick else CASES
    reps = args.reps or (6 if args.quick else 20)
    print(header("tensor parallel: autopar vs torch DTensor parallelize_module"))
    from autopar.cost_models.devices import get_device

    print(f"# cost model 'cpu' device: {get_device('cpu').notes}")
    record = {}
    if not args.skip_step:
        res = step_benchmark(cases, reps, warmup=2 if args.quick else 3, force_semi=args.semi)
        for name, r in res.items():
            print(f"\n## {name} {cases[name]}: 4 gloo ranks x 1 thread, tp=4, AdamW, {reps} interleaved rounds")
            for which, s in r["info"].items():
                print(f"autopar {which}: Megatron column/row parameter placements: {s['megatron']}"
                      + ("" if s["megatron"] else f" ({s['param_diffs']} parameters differ, e.g. "
                                                   f"{list(zip(s['example_diff'], s['example_got']))})")
                      + f"; predicted step {s['step_time'] * 1e3:.1f} ms; {s['n_collectives']} collectives/step on "
                        f"rank 0: {s['collectives']}")
            print("first-step loss: " + ", ".join(f"{k} {v:.6f}" for k, v in r["first_loss"].items()))
            t = r["times"]
            rec = {}
            for contender in [k for k in t if k.startswith("autopar")]:
                ratio = Ratio(contender, "dtensor", t[contender], t["dtensor"])
                print(ratio.line())
                print(check(f"{contender}/dtensor step-time ratio", ratio.ratio, 1.0))
                rec[contender] = ratio.to_dict()
            record[name] = {"case": cases[name], "ratios": rec, "info": r["info"]}
    if not args.skip_plan:
        from data_parallel import XL

        print(f"\n## planning GPT {XL} (48 layers) on the meta device, Mesh(8, axis_names=('tp',), "
              "device='a100-80gb'), mode auto, fresh process")
        row = run_fresh("data_parallel", "plan_gpt", {"mode": "auto", "axis_names": ["tp"]})
        print(f"params {row['params'] / 1e9:.3f} B  plan() wall {row['plan_s']:.1f} s (CPU {row['plan_cpu_s']:.1f} s)  solve_time "
              f"{row['solve_time']:.2f} s  (model build {row['build_s']:.1f} s)  peak RSS {row['peak_rss_mib']:.0f} MiB")
        print(f"chose degrees {row['degrees']}, sharded parameter fraction {row['sharded_param_fraction']:.2f}, "
              f"collectives {row['collectives']}, predicted step {row['step_time']:.3f} s, "
              f"{row['mem_gb']:.1f} GiB/device")
        print(check("solve_time s", row["solve_time"], 10.0) + "   " + check("plan() wall s", row["plan_s"], 10.0))
        record["plan"] = row
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
