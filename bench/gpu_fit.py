"""The rates a GPU preset is fitted from, measured on the card: matmul efficiency by smallest dimension,
fused attention, grouped expert GEMMs, streaming bandwidth, kernel launches, the optimizer step, and
decoder layers at the shapes the paper tables cost (for checking the fitted preset's predictions).

Run on a CUDA machine: ``python bench/gpu_fit.py --device cuda --out DIR`` (``--small``: tiny shapes,
a CPU smoke test). Writes ``DIR/fit.jsonl``, one JSON object per measurement, and prints each line.
All in bf16 unless named; CUDA events, median of the repetitions after warm-up.

- ``matmul``: a linear layer's training matmuls (``y = x W^T`` forward, both backward matmuls,
  ``6 T K N`` FLOPs, called directly ten times per timed region) at token counts ``T`` and the
  weight shapes of the tables (Llama-3 8B, Llama-3 405B's tensor-parallel slices at tp 8, Mixtral's
  and DeepSeek-V3's experts, GPT): fraction of peak, keyed by the smallest of ``T, K, N`` (what
  ``DeviceSpec.matmul_eff`` reads); ``linears``: the same for each per-rank linear of the tables.
- ``attention``: ``scaled_dot_product_attention`` forward + backward, causal and not, head dims
  64 / 128 and DeepSeek's 192 / 128: FLOPs as autopar counts them (``compute._sdpa_flops`` times
  the causal share, ``causal_attention.causal_fraction``) over the time.
- ``grouped_mm``: ``torch._grouped_mm`` of ``E`` experts (forward + backward) vs one dense matmul
  of the same FLOPs.
- ``stream``: elementwise ops (add, mul, SiLU, a cast) at their bytes over the datasheet bandwidth.
- ``launch``: seconds per kernel of a long run of tiny kernels.
- ``optimizer``: AdamW (foreach and fused) over fp32 parameters: seconds per parameter and per tensor.
- ``layer``: one Hugging Face decoder layer (+ embedding and head) forward + backward under
  autocast bf16, its step with AdamW, and the peak memory (the prediction is made on the CPU
  machine with ``autopar.plan(..., Mesh(1, device=preset))``); ``--compiled``: the same forward +
  backward through ``torch.compile`` (eager / compiled = the preset's ``compiled_speedup``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")

from bench.gpu_calibration import grouped_mm_step, timed  # noqa: E402

PEAK_BF16 = 989.4e12  # H100 SXM dense bf16, the preset's peak
HBM = 3.35e12


class Sink:
    def __init__(self, path: str | None):
        self.fh = open(path, "w") if path else None

    def emit(self, **row) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        if self.fh:
            self.fh.write(line + "\n")
            self.fh.flush()


def matmuls(dev, sink, small: bool) -> None:
    shapes = {"llama8b_mlp": (4096, 14336), "llama8b_qkv": (4096, 6144), "l405_tp8_mlp": (16384, 6656),
              "l405_tp8_qkv": (16384, 2304), "l405_tp8_o": (2048, 16384), "deepseek_expert": (7168, 2048),
              "mixtral_expert": (4096, 14336), "square_8k": (8192, 8192), "gpt_1k": (1024, 4096)}
    tokens = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
    if small:
        shapes, tokens = {"tiny": (64, 128)}, (16, 64)
    for name, (k, n) in shapes.items():
        for t in tokens:
            s = _three_matmuls(dev, t, k, n)
            sink.emit(kind="matmul", shape=name, tokens=t, k=k, n=n, min_dim=min(t, k, n), seconds=s,
                      efficiency=6.0 * t * k * n / s / PEAK_BF16)


def _three_matmuls(dev, t: int, k: int, n: int) -> float:
    """Seconds of a linear layer's three training matmuls (``x W^T``, ``g W``, ``g^T x``) called
    directly, ten times in one timed region (the GPU's time, not autograd's per-call CPU time)."""
    x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    g = torch.randn(t, n, device=dev, dtype=torch.bfloat16)

    def step():
        for _ in range(10):
            x @ w.t()
            g @ w
            g.t() @ x

    return timed(step, dev, reps=5, warmup=1) / 10


# the per-rank linear layers of the tables' layers: (name, tokens, in features, out features)
TABLE_LINEARS = [
    *[(f"l405_tp8_{n}", 8192, k, o) for n, k, o in (("q", 16384, 2048), ("kv", 16384, 128), ("o", 2048, 16384),
                                                     ("gate_up", 16384, 6656), ("down", 6656, 16384),
                                                     ("head", 16384, 16032))],
    *[(f"llama8b_tp2_{n}", t, k, o) for t in (2048, 8192) for n, k, o in (
        ("q", 4096, 2048), ("kv", 4096, 512), ("o", 2048, 4096), ("gate_up", 4096, 7168), ("down", 7168, 4096),
        ("head", 4096, 64128))],
    *[(f"mixtral_{n}", 4096, k, o) for n, k, o in (("q", 4096, 4096), ("kv", 4096, 1024), ("router", 4096, 8))],
    *[(f"mixtral_expert_rows{t}", t, 4096, 14336) for t in (512, 1024, 2048)],
    *[(f"deepseek_{n}", 4096, k, o) for n, k, o in (
        ("q_a", 7168, 1536), ("q_b", 1536, 24576), ("kv_a", 7168, 576), ("kv_b", 512, 32768), ("o", 16384, 7168),
        ("shared_up", 7168, 2048), ("shared_down", 2048, 7168), ("router", 7168, 256))],
    *[(f"gpt18b_tp8_{n}", 2048, k, o) for n, k, o in (("qkv", 6144, 2304), ("o", 768, 6144), ("fc1", 6144, 3072),
                                                      ("fc2", 3072, 6144))],
]


def table_linears(dev, sink, small: bool) -> None:
    cases = [("tiny", 32, 64, 16)] if small else TABLE_LINEARS
    for name, t, k, n in cases:
        s = _three_matmuls(dev, t, k, n)
        sink.emit(kind="table_linear", shape=name, tokens=t, k=k, n=n, min_dim=min(t, k, n), seconds=s,
                  efficiency=6.0 * t * k * n / s / PEAK_BF16)


def attention(dev, sink, small: bool) -> None:
    cases = [(16, 128, 128), (32, 128, 128), (16, 64, 64), (16, 192, 128)]
    seqs = (1024, 2048, 4096, 8192, 16384, 32768)
    if small:
        cases, seqs = [(2, 16, 16)], (64, 128)
    for heads, d, dv in cases:
        for s in seqs:
            batch = max(1, 16384 // s)
            for causal in (True, False):
                try:
                    q = torch.randn(batch, heads, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
                    k = torch.randn(batch, heads, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
                    v = torch.randn(batch, heads, s, dv, device=dev, dtype=torch.bfloat16, requires_grad=True)
                    g = torch.randn(batch, heads, s, dv, device=dev, dtype=torch.bfloat16)

                    def step():
                        F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)

                    sec = timed(step, dev, reps=6, warmup=2)
                except Exception as err:  # noqa: BLE001 - a kernel this build lacks is a finding
                    sink.emit(kind="attention", heads=heads, d=d, dv=dv, seq=s, causal=causal,
                              error=f"{type(err).__name__}: {str(err)[:160]}")
                    continue
                share = (s * (s + 1) / 2) / (s * s) if causal else 1.0
                fwd = (2.0 * batch * heads * s * s * d + 2.0 * batch * heads * s * s * dv) * share
                sink.emit(kind="attention", heads=heads, d=d, dv=dv, seq=s, batch=batch, causal=causal,
                          seconds=sec, efficiency=3.0 * fwd / sec / PEAK_BF16)
                del q, k, v, g


def grouped(dev, sink, small: bool) -> None:
    if not hasattr(torch, "_grouped_mm"):
        sink.emit(kind="grouped_mm", error="torch._grouped_mm is missing")
        return
    cases = [(4, 7168, 2048, r) for r in (256, 512, 1024, 2048, 4096)]
    cases += [(8, 7168, 2048, 1024), (32, 7168, 2048, 256), (2, 4096, 14336, 2048), (1, 4096, 14336, 4096)]
    if small:
        cases = [(2, 64, 128, 32)]
    for e, h, f, per in cases:
        tokens = e * per
        step = grouped_mm_step(dev, e, per, h, f)
        try:
            sec = timed(step, dev, reps=8, warmup=2)
        except Exception as err:  # noqa: BLE001
            sink.emit(kind="grouped_mm", experts=e, rows=per, error=f"{type(err).__name__}: {str(err)[:160]}")
            continue
        flops = 6.0 * tokens * h * f
        sink.emit(kind="grouped_mm", experts=e, rows_per_expert=per, hidden=h, ffn=f, min_dim=min(per, h, f),
                  seconds=sec, efficiency=flops / sec / PEAK_BF16)
        del step


def stream(dev, sink, small: bool) -> None:
    n = (1 << 14) if small else (1 << 28)  # 512 MiB of bf16
    a = torch.randn(n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, device=dev, dtype=torch.bfloat16)
    ops = {"add": (lambda: a + b, 3), "mul": (lambda: a * b, 3), "silu": (lambda: F.silu(a), 2),
           "to_fp32": (lambda: a.float(), 3), "copy": (lambda: a.clone(), 2)}
    for name, (fn, words) in ops.items():
        sec = timed(fn, dev, reps=10, warmup=2)
        moved = words * n * 2 if name != "to_fp32" else n * 2 + n * 4
        sink.emit(kind="stream", op=name, bytes=moved, seconds=sec, bandwidth=moved / sec,
                  efficiency=moved / sec / HBM)
    del a, b


def launches(dev, sink) -> None:
    x = torch.zeros(16, device=dev)

    def many():
        for _ in range(2000):
            x.add_(1.0)

    sec = timed(many, dev, reps=5, warmup=1)
    sink.emit(kind="launch", kernels=2000, seconds_per_kernel=sec / 2000)


def optimizer(dev, sink, small: bool) -> None:
    total = (1 << 16) if small else 1_000_000_000
    for tensors in (100, 1000):
        params = [torch.nn.Parameter(torch.randn(total // tensors, device=dev)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.randn_like(p)
        for mode in ("foreach", "fused"):
            try:
                opt = torch.optim.AdamW(params, lr=1e-4, **{mode: True})
                sec = timed(opt.step, dev, reps=5, warmup=2)
            except Exception as err:  # noqa: BLE001
                sink.emit(kind="optimizer", mode=mode, tensors=tensors, error=f"{type(err).__name__}: {err}"[:200])
                continue
            sink.emit(kind="optimizer", mode=mode, params=total, tensors=tensors, seconds=sec,
                      seconds_per_param=sec / total, bytes_per_param_at_hbm=sec * HBM / total)
            del opt
        del params
        if dev == "cuda":
            torch.cuda.empty_cache()


def _layer_config(case: str, small: bool):
    import transformers as tf

    common = dict(use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0, num_hidden_layers=1)
    if case == "llama8b":
        cfg = tf.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                             vocab_size=128256, max_position_embeddings=8192, **common)
        seq = 8192
    elif case == "l405_tp8_slice":  # one tp-8 rank's share of a Llama-3 405B layer (16 q heads, 1 kv head)
        cfg = tf.LlamaConfig(hidden_size=16384, intermediate_size=6656, num_attention_heads=16, num_key_value_heads=1,
                             head_dim=128, vocab_size=32000, max_position_embeddings=8192, **common)
        seq = 8192
    else:  # mixtral
        cfg = tf.MixtralConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                               num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                               max_position_embeddings=4096, **common)
        seq = 4096
    if small:
        cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size = 64, 128, 128
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 4, 2, 16
        seq = 64
    cfg._attn_implementation = "sdpa"
    return cfg, seq


def _op_times(fn, dev: str) -> list:
    """(aten op, seconds on the device of the kernels it launched itself, calls) of one ``fn()``,
    largest first."""
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        if dev == "cuda":
            torch.cuda.synchronize()
    key = "self_device_time_total" if dev == "cuda" else "self_cpu_time_total"
    ops = [(e.key, getattr(e, key, 0) / 1e6, e.count) for e in prof.key_averages() if e.key.startswith("aten::")]
    return sorted((o for o in ops if o[1] > 0), key=lambda o: -o[1])[:60]


def layers(dev, sink, small: bool, profile: bool = False, compiled: bool = False) -> None:
    import transformers as tf

    from bench.gpu_calibration import measure_layer
    from examples.hf_zoo import LogitsOnly, lm_loss

    for case in ("llama8b", "l405_tp8_slice", "mixtral"):
        try:
            cfg, seq = _layer_config(case, small)
            cls = tf.MixtralForCausalLM if case == "mixtral" else tf.LlamaForCausalLM
            if case == "mixtral":
                cfg._experts_implementation = "grouped_mm"
            torch.manual_seed(0)
            with torch.device(dev):
                model = LogitsOnly(cls(cfg))
            if case == "mixtral":  # autopar's bf16 casts the expert weights itself (autocast skips _grouped_mm)
                for mod in model.modules():
                    if type(mod).__name__.endswith("Experts"):
                        mod.to(torch.bfloat16)
            x = torch.randint(0, cfg.vocab_size, (1, seq), device=dev)
            fwd_bwd, full, sec, mem = measure_layer(model, x, dev, lm_loss)
            sink.emit(kind="layer", case=case, seq=seq, fwd_bwd=sec, step=full, peak_bytes=mem,
                      params=sum(p.numel() for p in model.parameters()))
            if profile:
                sink.emit(kind="layer_ops", case=case, ops=_op_times(fwd_bwd, dev))
                model.zero_grad(set_to_none=True)
            if compiled and case != "mixtral":
                t0 = time.perf_counter()
                csec = measure_layer(torch.compile(model), x, dev, lm_loss)[2]
                sink.emit(kind="layer_compiled", case=case, seq=seq, eager_fwd_bwd=sec, compiled_fwd_bwd=csec,
                          compiled_speedup=sec / csec, seconds_with_compile=time.perf_counter() - t0)
                model.zero_grad(set_to_none=True)
            del model
        except Exception as err:  # noqa: BLE001 - one failed case must not hide the others
            sink.emit(kind="layer", case=case, error=f"{type(err).__name__}: {str(err)[:300]}")
        if dev == "cuda":
            torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke test)")
    ap.add_argument("--out", default=None, help="folder for fit.jsonl")
    ap.add_argument("--only", default="matmul,attention,grouped,stream,launch,optimizer,layers")
    ap.add_argument("--profile", action="store_true", help="layers: also each aten op's device time")
    ap.add_argument("--compiled", action="store_true", help="layers: also forward + backward through torch.compile")
    args = ap.parse_args(argv)
    path = os.path.join(args.out, "fit.jsonl") if args.out else None
    sink, dev = Sink(path), args.device
    if dev == "cuda":
        sink.emit(kind="device", name=torch.cuda.get_device_name(), torch=torch.__version__)
    parts = {"matmul": lambda: matmuls(dev, sink, args.small),
             "linears": lambda: table_linears(dev, sink, args.small), "attention": lambda: attention(dev, sink, args.small),
             "grouped": lambda: grouped(dev, sink, args.small), "stream": lambda: stream(dev, sink, args.small),
             "launch": lambda: launches(dev, sink), "optimizer": lambda: optimizer(dev, sink, args.small),
             "layers": lambda: layers(dev, sink, args.small, args.profile, args.compiled)}
    for name in args.only.split(","):
        t0 = time.perf_counter()
        try:
            parts[name]()
        except Exception as err:  # noqa: BLE001 - one failed part must not hide the others
            sink.emit(kind="part", part=name, error=f"{type(err).__name__}: {str(err)[:300]}")
        sink.emit(kind="part", part=name, seconds=time.perf_counter() - t0)
        if dev == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
