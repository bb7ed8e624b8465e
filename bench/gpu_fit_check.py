"""The fitted preset checked against the layers ``gpu_fit.py`` measured: each measured decoder layer
planned on ``Mesh(1, device=preset)`` with ``mixed_precision="bf16"`` on this machine (no GPU needed),
predicted forward + backward (``step_time - optimizer_time``), step and peak memory over the measured.

``PYTHONPATH=. python bench/gpu_fit_check.py bench/gpu_fit_h100.jsonl --preset h100``
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, ".")


def predict(case: str, preset: str) -> dict:
    import transformers as tf

    import autopar
    from bench.gpu_fit import _layer_config
    from examples.hf_zoo import LogitsOnly, lm_loss

    cfg, seq = _layer_config(case, small=False)
    cls = tf.MixtralForCausalLM if case == "mixtral" else tf.LlamaForCausalLM
    if case == "mixtral":
        cfg._experts_implementation = "grouped_mm"
    x = torch.randint(0, cfg.vocab_size, (1, seq))
    with torch.device("meta"):
        meta = LogitsOnly(cls(cfg))
    plan = autopar.plan(meta, autopar.Mesh(1, device=preset), example_inputs=(x,), loss_fn=lm_loss,
                        example_target=x, mode="auto", mixed_precision="bf16")
    return dict(fwd_bwd=plan.step_time - plan.optimizer_time, step=plan.step_time,
                peak_bytes=max(plan.memory_per_device))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("fit", help="fit.jsonl written by bench/gpu_fit.py")
    ap.add_argument("--preset", default="h100")
    args = ap.parse_args(argv)
    rows = [json.loads(line) for line in open(args.fit)]
    print("| layer | fwd+bwd measured / predicted (ratio) | step measured / predicted (ratio) | peak GiB measured / predicted (ratio) |")
    print("|---|---|---|---|")
    for r in rows:
        if r.get("kind") != "layer" or "error" in r:
            continue
        p = predict(r["case"], args.preset)
        g = 2 ** 30
        print(f"| {r['case']} seq {r['seq']} | {r['fwd_bwd'] * 1e3:.1f} / {p['fwd_bwd'] * 1e3:.1f} ms "
              f"({p['fwd_bwd'] / r['fwd_bwd']:.2f}) | {r['step'] * 1e3:.1f} / {p['step'] * 1e3:.1f} ms "
              f"({p['step'] / r['step']:.2f}) | {r['peak_bytes'] / g:.2f} / {p['peak_bytes'] / g:.2f} "
              f"({p['peak_bytes'] / r['peak_bytes']:.2f}) |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
