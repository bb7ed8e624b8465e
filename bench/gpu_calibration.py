"""The GPU cost model measured on the card it costs: kernel rates against the preset's
assumptions, and one-layer training steps measured against autopar's prediction.

Run on a CUDA machine (``python bench/gpu_calibration.py --device cuda --preset h100``); on the
CPU, ``--small`` runs the same code on tiny shapes as a smoke test. Prints one JSON line per
measurement and a table. What is measured, in bf16:

- dense matmuls of a linear layer's training step (``y = x W^T``, forward + both backward
  matmuls = ``6 T H F`` FLOPs) by token count ``T``: the fraction of the preset's peak reached,
  beside the preset's ``matmul_eff(min_dim)``;
- fused causal attention (``scaled_dot_product_attention``, forward + backward) by sequence:
  the fraction of peak counted the way autopar counts it (``cost_models/compute._sdpa_flops``:
  the full ``S x S`` product, backward twice the forward) and counted as the causal kernel
  works (half of it), beside the preset's attention efficiency;
- grouped expert GEMMs (``torch._grouped_mm``, an MoE layer's experts: ``E`` experts of
  ``T/E`` rows each) against one dense matmul of the same FLOPs;
- one decoder layer of Mixtral 8x7B (seq 4096) and of a Llama-3-8B-shaped model (seq 8192) as
  Hugging Face writes them: forward + backward of the language-model loss measured, and the same
  model planned on ``Mesh(1, device=preset)`` with ``mixed_precision="bf16"`` (predicted forward +
  backward = ``step_time - optimizer_time``); measured under ``torch.autocast`` bf16 with fp32
  weights and AdamW (the recipe ``"bf16"`` stands for), with the step's peak allocated memory.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")


def timed(fn, device: str, reps: int = 10, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU, perf_counter on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def emit(rows: list, **row) -> None:
    rows.append(row)
    print(json.dumps(row), flush=True)


def matmul_curve(dev, spec, rows, tokens, hidden, ffn):
    peak = spec.peak("bf16") if hasattr(spec, "peak") else spec.peak_flops["bf16"]
    for t in tokens:
        x = torch.randn(t, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(ffn, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(t, ffn, device=dev, dtype=torch.bfloat16)

        def step():
            (x @ w.t()).backward(g)

        s = timed(step, dev)
        eff = 6 * t * hidden * ffn / s / peak
        emit(rows, kind="matmul", tokens=t, hidden=hidden, ffn=ffn, seconds=s, efficiency=eff,
             preset_efficiency=spec.matmul_eff(min(t, hidden, ffn)))


def attention_curve(dev, spec, rows, seqs, heads, head_dim):
    peak = spec.peak_flops["bf16"]
    for s in seqs:
        q, k, v = (torch.randn(1, heads, s, head_dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        g = torch.randn(1, heads, s, head_dim, device=dev, dtype=torch.bfloat16)

        def step():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)

        sec = timed(step, dev)
        counted = 3 * 4.0 * heads * s * s * head_dim  # autopar: full S x S, backward 2x forward
        emit(rows, kind="attention", seq=s, heads=heads, head_dim=head_dim, seconds=sec,
             efficiency_as_counted=counted / sec / peak, efficiency_causal=counted / 2 / sec / peak,
             preset_efficiency=spec.attention_efficiency or spec.compute_efficiency)


def grouped_mm_step(dev: str, experts: int, per: int, hidden: int, ffn: int):
    """Forward + backward of ``torch._grouped_mm`` over ``experts`` experts of ``per`` rows each (bf16)."""
    tokens = experts * per
    x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(experts, hidden, ffn, device=dev, dtype=torch.bfloat16, requires_grad=True)
    offs = torch.arange(per, tokens + 1, per, device=dev, dtype=torch.int32)
    g = torch.randn(tokens, ffn, device=dev, dtype=torch.bfloat16)

    def step():
        torch._grouped_mm(x, w, offs=offs).backward(g)

    return step


def grouped_experts(dev, spec, rows, tokens, experts, hidden, ffn):
    peak = spec.peak_flops["bf16"]
    if not hasattr(torch, "_grouped_mm"):
        emit(rows, kind="grouped_mm", error="torch._grouped_mm is missing")
        return
    per = tokens // experts
    step = grouped_mm_step(dev, experts, per, hidden, ffn)
    x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(tokens, ffn, device=dev, dtype=torch.bfloat16)
    try:
        sec = timed(step, dev)
    except Exception as err:  # noqa: BLE001 - a kernel this build lacks is a finding
        emit(rows, kind="grouped_mm", error=f"{type(err).__name__}: {str(err)[:200]}")
        return
    dense_w = torch.randn(ffn, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)

    def dense():
        (x @ dense_w.t()).backward(g)

    dsec = timed(dense, dev)
    emit(rows, kind="grouped_mm", tokens=tokens, experts=experts, rows_per_expert=per, hidden=hidden, ffn=ffn,
         seconds=sec, efficiency=6 * tokens * hidden * ffn / sec / peak, dense_seconds=dsec,
         grouped_over_dense=sec / dsec)


def _hf_layer(family: str, small: bool):
    import transformers as tf

    common = dict(use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0, num_hidden_layers=1)
    if family == "mixtral":
        cfg = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                   num_local_experts=8, num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=4096)
        if small:
            cfg.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=128, num_local_experts=4)
        return tf.MixtralConfig(**cfg, **common), tf.MixtralForCausalLM, (64 if small else 4096)
    cfg = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
               vocab_size=128256, max_position_embeddings=8192)
    if small:
        cfg.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    return tf.LlamaConfig(**cfg, **common), tf.LlamaForCausalLM, (64 if small else 8192)


def measure_layer(model, x, dev: str, loss_fn):
    """(forward + backward function, step seconds, forward + backward seconds, peak bytes) of ``model``
    trained on ``x`` with ``loss_fn(model(x), x)`` under autocast bf16 and AdamW (foreach): the step's
    peak allocated memory on a GPU (nan on the CPU)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def fwd_bwd():
        with torch.autocast(device_type=dev, dtype=torch.bfloat16):
            loss = loss_fn(model(x), x)
        loss.backward()

    def step():
        fwd_bwd()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    full = timed(step, dev, reps=5, warmup=1)
    mem = torch.cuda.max_memory_allocated() if dev == "cuda" else math.nan
    sec = timed(fwd_bwd, dev, reps=5, warmup=1)
    opt.zero_grad(set_to_none=True)
    return fwd_bwd, full, sec, mem


def layer_case(dev, preset, rows, family: str, attn: str, experts_impl: str | None, small: bool):
    """One decoder layer (+ embeddings and head) trained one step: measured vs autopar's prediction."""
    import autopar
    from examples.hf_zoo import LogitsOnly, lm_loss

    cfg, cls, seq = _hf_layer(family, small)
    cfg._attn_implementation = attn
    if experts_impl:
        try:
            cfg._experts_implementation = experts_impl
        except Exception as err:  # noqa: BLE001
            emit(rows, kind="layer", family=family, error=f"experts_implementation: {err}")
            return
    x = torch.randint(0, cfg.vocab_size, (1, seq))
    with torch.device("meta"):
        meta = LogitsOnly(cls(cfg))
    t0 = time.perf_counter()
    try:
        plan = autopar.plan(meta, autopar.Mesh(1, device=preset), example_inputs=(x,), loss_fn=lm_loss,
                            example_target=x, mode="auto", mixed_precision="bf16")
        predicted, pred_mem = plan.step_time - plan.optimizer_time, max(plan.memory_per_device)
        plan_step = plan.step_time
    except Exception as err:  # noqa: BLE001
        predicted, pred_mem, plan_step = math.nan, math.nan, math.nan
        emit(rows, kind="layer", family=family, attn=attn, error=f"plan: {type(err).__name__}: {str(err)[:300]}")
    solve = time.perf_counter() - t0
    torch.manual_seed(0)
    with torch.device(dev):
        model = LogitsOnly(cls(cfg))  # fp32 masters, bf16 compute under autocast: what "bf16" costs
    _fwd_bwd, full, sec, mem = measure_layer(model, x.to(dev), dev, lm_loss)
    emit(rows, kind="layer", family=family, attn=attn, experts=experts_impl, seq=seq, measured_fwd_bwd=sec,
         predicted_fwd_bwd=predicted, predicted_over_measured=predicted / sec, measured_step=full,
         predicted_step=plan_step, step_predicted_over_measured=plan_step / full, plan_seconds=solve,
         measured_peak_bytes=mem, predicted_peak_bytes=pred_mem, memory_predicted_over_measured=pred_mem / mem)
    del model


def moe_profile(dev, rows, small: bool) -> None:
    """Where a Mixtral layer's forward + backward goes: each experts implementation, fp32 weights
    under autocast and bf16 weights, with the top kernels of one step."""
    from examples.hf_zoo import LogitsOnly, lm_loss

    for impl in ("grouped_mm", "batched_mm", "eager"):
        for weights in ("fp32+autocast", "bf16"):
            cfg, cls, seq = _hf_layer("mixtral", small)
            cfg._attn_implementation = "sdpa"
            cfg._experts_implementation = impl
            torch.manual_seed(0)
            with torch.device(dev):
                model = LogitsOnly(cls(cfg))
            if weights == "bf16":
                model = model.to(torch.bfloat16)
            x = torch.randint(0, cfg.vocab_size, (1, seq), device=dev)

            def fwd_bwd():
                with torch.autocast(device_type=dev, dtype=torch.bfloat16, enabled=weights != "bf16"):
                    loss = lm_loss(model(x), x)
                loss.backward()

            try:
                sec = timed(fwd_bwd, dev, reps=5, warmup=2)
                acts = [torch.profiler.ProfilerActivity.CPU] + (
                    [torch.profiler.ProfilerActivity.CUDA] if dev == "cuda" else [])
                with torch.profiler.profile(activities=acts) as prof:
                    fwd_bwd()
                    if dev == "cuda":
                        torch.cuda.synchronize()
                key = "device_time_total" if dev == "cuda" else "cpu_time_total"
                top = sorted(prof.key_averages(), key=lambda e: -getattr(e, key, 0))[:10]
                emit(rows, kind="moe_profile", experts=impl, weights=weights, seq=seq, fwd_bwd=sec,
                     top=[(e.key[:60], round(getattr(e, key, 0) / 1e3, 2), e.count) for e in top])
            except Exception as err:  # noqa: BLE001
                emit(rows, kind="moe_profile", experts=impl, weights=weights, error=f"{type(err).__name__}: {str(err)[:200]}")
            del model
            if dev == "cuda":
                torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="h100")
    ap.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke test)")
    ap.add_argument("--skip-layers", action="store_true")
    ap.add_argument("--moe-profile", action="store_true", help="only: where a Mixtral layer's step goes")
    args = ap.parse_args(argv)
    from autopar.cost_models.devices import get_device

    spec = get_device(args.preset)
    dev, rows = args.device, []
    if dev == "cuda":
        print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    small = args.small
    if args.moe_profile:
        moe_profile(dev, rows, small)
        return 0
    h, f = (64, 128) if small else (4096, 14336)
    matmul_curve(dev, spec, rows, (16, 64) if small else (128, 512, 1024, 2048, 4096, 8192, 16384), h, f)
    attention_curve(dev, spec, rows, (64, 128) if small else (2048, 4096, 8192, 16384, 32768), 4 if small else 32,
                    16 if small else 128)
    grouped_experts(dev, spec, rows, 64 if small else 8192, 4 if small else 8, h, f)
    if not args.skip_layers:
        cases = [("mixtral", "sdpa", "grouped_mm"), ("mixtral", "eager", None), ("llama", "sdpa", None)]
        for family, attn, impl in cases:
            try:
                layer_case(dev, args.preset, rows, family, attn, impl, small)
            except Exception as err:  # noqa: BLE001 - one failed case must not hide the others
                emit(rows, kind="layer", family=family, attn=attn, error=f"{type(err).__name__}: {str(err)[:300]}")
            if dev == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
