"""Recomputation on one GPU: autopar's recompute choices against torch's own, predicted against measured.

A Llama-shaped model (examples.models.Llama: RMSNorm, rotary, SDPA causal attention, SwiGLU) in bf16
mixed precision, STAND_ALONE on ``Mesh(1, device=preset)``, SGD; per round each contender runs one
training step (forward, backward, SGD step, zero_grad), interleaved and shuffled:

  autopar-none / autopar-full / autopar-exattn   ``recompute`` forced through the context
  autopar-exattn-compiled                        the same, ``compile=True`` (inductor)
  eager-ckpt   each layer under torch.utils.checkpoint (non-reentrant), autocast bf16
  eager-sac    each layer under torch's selective checkpointing, the SDPA kernel's outputs MUST_SAVE

For each contender: the median step, and the activation peak of one step (peak allocated during the
step minus what was allocated before it); for autopar's: the plan's predicted step and the plan's
predicted peak minus its predicted state (``plan.memory_breakdown`` when there, else the peak's
difference between choices). Prints ratios: measured / predicted per choice, exattn vs eager-sac.

    python bench/gpu_recompute.py [--layers 4 --seq 8192 --hidden 4096 --heads 32 --ffn 14336]
    python bench/gpu_recompute.py --device cpu --small      # a smoke test without a GPU
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Ratio, header, interleaved  # noqa: E402

import torch  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from recompute import _keep_attention  # noqa: E402


def _model(cfg, device):
    from examples.models import Llama

    torch.manual_seed(0)
    with torch.device(device):
        return Llama(vocab=cfg["vocab"], hidden=cfg["hidden"], heads=cfg["heads"], layers=cfg["layers"],
                     seq=cfg["seq"], ffn=cfg["ffn"])


class _Layer(torch.nn.Module):
    """One Llama layer under torch.utils.checkpoint, with or without selective checkpointing."""

    def __init__(self, layer, sac: bool):
        super().__init__()
        self.layer, self.sac = layer, sac

    def forward(self, x, cos, sin):
        if self.sac:
            from torch.utils.checkpoint import create_selective_checkpoint_contexts

            ctx = functools.partial(create_selective_checkpoint_contexts, _keep_attention)
            return checkpoint(self.layer, x, cos, sin, use_reentrant=False, context_fn=ctx)
        return checkpoint(self.layer, x, cos, sin, use_reentrant=False)


def _synced(fn, device):
    if device != "cuda":
        return fn
    return lambda: (fn(), torch.cuda.synchronize())


def _activation_peak(step, device) -> int:
    if device != "cuda":
        return 0
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def _parallelized(cfg, device, preset, choice, compiled, x, y):
    """The model STAND_ALONE on one ``preset`` device with ``recompute=choice`` (bf16 mixed precision)."""
    import autopar
    from examples.models import lm_loss

    autopar.reset_auto_parallel_context()
    autopar.set_auto_parallel_context(recompute=choice)
    try:
        return autopar.parallelize(_model(cfg, device), autopar.Mesh(1, device=preset), example_inputs=(x,),
                                   loss_fn=lm_loss, example_target=y, mode="stand_alone", mixed_precision="bf16",
                                   compile=compiled)
    finally:
        autopar.reset_auto_parallel_context()


def _autopar(cfg, device, preset, choice, compiled, x, y):
    pm = _parallelized(cfg, device, preset, choice, compiled, x, y)
    opt = torch.optim.SGD(pm.parameters(), lr=1e-4)

    def step():
        pm.step(x, target=y)
        opt.step()
        opt.zero_grad(set_to_none=False)
    return step, pm.plan


def memory_phase(cfg, dev, preset, contenders, x, y) -> None:
    """Each autopar contender alone with AdamW (the optimizer plans are costed for): the whole peak of its
    second step (state, gradients, working copies, activations) against ``plan.memory_per_device``."""
    import gc

    gib = 2 ** 30
    print("| contender (alone, AdamW) | peak GiB measured | predicted | predicted / measured | breakdown (GiB) |")
    print("|---|---|---|---|---|")
    for choice, compiled in contenders:
        pm = _parallelized(cfg, dev, preset, choice, compiled, x, y)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-5)
        cuda = dev == "cuda"
        for _ in range(2):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            pm.step(x, target=y)
            opt.step()
            opt.zero_grad(set_to_none=False)
        peak = torch.cuda.max_memory_allocated() if cuda else 1
        pred = max(pm.plan.memory_per_device)
        parts = ", ".join(f"{k} {v / gib:.2f}" for k, v in pm.plan.memory_breakdown.items()
                          if isinstance(v, (int, float)))
        print(f"| {choice}{' compiled' if compiled else ''} | {peak / gib:.2f} | {pred / gib:.2f} | "
              f"{pred / peak:.3f} | {parts} |", flush=True)
        del pm, opt
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def _eager(cfg, device, sac, x, y):
    from examples.models import lm_loss

    model = _model(cfg, device)
    model.layers = torch.nn.ModuleList(_Layer(layer, sac) for layer in model.layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step():
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke test)")
    ap.add_argument("--layers", type=int, default=None, help="default: 4 on a GPU of over 100 GiB, else 2")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--skip-compiled", action="store_true")
    ap.add_argument("--memory", action="store_true", help="only the memory phase (each contender alone, AdamW)")
    args = ap.parse_args(argv)
    layers = args.layers or (4 if args.device == "cuda" and torch.cuda.get_device_properties(0).total_memory > 100 * 2 ** 30
                             else 2)
    cfg = dict(layers=layers, seq=args.seq, hidden=args.hidden, heads=args.heads, ffn=args.ffn, vocab=args.vocab)
    if args.small:
        cfg = dict(layers=2, seq=256, hidden=128, heads=4, ffn=256, vocab=512)
    dev = args.device
    if dev == "cpu":
        torch.set_num_threads(1)
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    preset = "h200" if "H200" in name else "h100" if "H100" in name else "cpu"
    print(header("recomputation on one device: autopar's choices vs torch's checkpointing"))
    print(f"# Llama {cfg}, batch 1, bf16 mixed precision, SGD; device {name} (preset {preset!r}); {args.reps} rounds")
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg["vocab"], (1, cfg["seq"]), generator=g).to(dev)
    y = torch.randint(0, cfg["vocab"], (1, cfg["seq"]), generator=g).to(dev)
    steps, plans, peaks = {}, {}, {}
    contenders = [("none", False), ("full", False), ("except_attention", False)]
    if not args.skip_compiled:
        contenders.append(("except_attention", True))
    if args.memory:
        memory_phase(cfg, dev, preset, contenders, x, y)
        return 0
    for choice, compiled in contenders:
        key = {"none": "autopar-none", "full": "autopar-full", "except_attention": "autopar-exattn"}[choice]
        key += "-compiled" if compiled else ""
        steps[key], plans[key] = _autopar(cfg, dev, preset, choice, compiled, x, y)
    steps["eager-ckpt"] = _eager(cfg, dev, False, x, y)
    steps["eager-sac"] = _eager(cfg, dev, True, x, y)
    for key, step in steps.items():      # warm-up (the compiled first step) and each step's activation peak
        step()
        peaks[key] = _activation_peak(step, dev)
    times = interleaved({k: _synced(f, dev) for k, f in steps.items()}, args.reps, warmup=1, shuffle=True)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    gib = 2 ** 30
    print("| contender | step ms measured | predicted | measured / predicted | activation peak GiB | "
          "predicted peak GiB (whole) |")
    print("|---|---|---|---|---|---|")
    for key in steps:
        p = plans.get(key)
        pred = f"{p.step_time * 1e3:.1f}" if p else "-"
        ratio = f"{med[key] / p.step_time:.3f}" if p else "-"
        whole = f"{max(p.memory_per_device) / gib:.2f}" if p else "-"
        print(f"| {key} | {med[key] * 1e3:.1f} | {pred} | {ratio} | {peaks[key] / gib:.2f} | {whole} |")
    for a, b in (("autopar-exattn", "eager-sac"), ("autopar-full", "eager-ckpt"), ("autopar-exattn", "autopar-full"),
                 ("autopar-exattn", "autopar-none"), ("autopar-full", "autopar-none"),
                 ("autopar-exattn-compiled", "autopar-exattn")):
        if a in times and b in times:
            print(Ratio(a, b, times[a], times[b]).line())
    pn, pf, pe = (plans[k] for k in ("autopar-none", "autopar-full", "autopar-exattn"))
    pred_gain = (pf.step_time - pe.step_time) / max(pf.step_time - pn.step_time, 1e-12)
    meas_gain = (med["autopar-full"] - med["autopar-exattn"]) / max(med["autopar-full"] - med["autopar-none"], 1e-12)
    print(f"share of full's recompute time that except_attention saves: predicted {pred_gain:.3f}, measured "
          f"{meas_gain:.3f}")
    if dev == "cuda":
        for a, b in (("autopar-none", "autopar-exattn"), ("autopar-none", "autopar-full")):
            pm = max(plans[a].memory_per_device) - max(plans[b].memory_per_device)
            print(f"memory {a} - {b}: predicted {pm / gib:.2f} GiB, measured activation peaks "
                  f"{(peaks[a] - peaks[b]) / gib:.2f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
