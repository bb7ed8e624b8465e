"""Benchmark (issue 35 part 5): Llama 3 405B's published 4-D layouts, planned by autopar on a simulated
H100 cluster (``bench/paper_table.py --table llama3``).

Source: Grattafiori et al., "The Llama 3 Herd of Models" (arXiv 2407.21783), Table 3 (405B: 126 layers,
model dimension 16384, FFN 53248, 128 heads, 8 key/value heads, vocabulary 128256) and Table 4 (the
scaling configurations of 405B pre-training on H100-80GB, 8 per server, BF16):

=====  ======  ==  ==  ==  ===  =======  ========  ======  =======  ====
row    GPUs    TP  CP  PP  DP   seq      batch/DP  tokens  TFLOP/s  MFU
=====  ======  ==  ==  ==  ===  =======  ========  ======  =======  ====
8k_8k   8,192   8   1  16   64    8,192        32     16M      430   43%
8k_16k 16,384   8   1  16  128    8,192        16     16M      400   41%
128k   16,384   8  16  16    8  131,072        16     16M      380   38%
=====  ======  ==  ==  ==  ===  =======  ========  ======  =======  ====

The paper's data parallelism is FSDP (model, optimizer and gradients sharded over dp, parameters not
resharded after the forward pass). FORCED runs ZeRO-1 on dp (the optimizer state and fp32 masters
sharded, Megatron's distributed optimizer: the stage autopar runs with a pipeline,
``runtime/pipeline_zero.py``); the gradients stay whole, so it holds more than the paper's FSDP, with
the same communication volume per step.

Model: Hugging Face ``LlamaForCausalLM`` from the config above on the meta device, SDPA attention (so
the context-parallel strategies of ``sharding/rules/attention.py`` apply). For each row:

* FORCED: the published layout as a named mesh ``("pp", "dp", "cp", "tp")`` (``cp`` left out when 1),
  bf16 mixed precision, ZeRO-1, one sequence per microbatch (``batch/DP`` microbatches, as the paper's
  micro-batch of one sequence), SEMI_AUTO (the planner picks schedule and recomputation);
* AUTO: autopar's own plan on an unnamed ``Mesh(gpus, device="h100")`` (bf16, everything else chosen).

TFLOP/s per GPU = ``step_flops(row) / predicted step / GPUs`` (``flops_per_token``: the paper does not
print its formula; this is the usual model-FLOPs count with causal attention). ``--scale k`` divides
the model's widths, layers, vocabulary, sequence and batch by ``k`` (the mesh stays): a quick smoke
run of each row's plans. Each job runs in its own process with a hard timeout.

    PYTHONPATH=. .venv/bin/python bench/paper_table.py --table llama3 [--rows 8k_8k,128k] [--skip-auto]
        [--time-budget S] [--hard-timeout S] [--scale K]
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import time
from dataclasses import dataclass

import torch

import autopar
from bench.common import run_call_isolated

TOLERANCE = 0.25
DEVICE, GPUS_PER_NODE = "h100", 8
SOURCE = "Llama 3 Herd of Models (arXiv 2407.21783), Table 4"


@dataclass(frozen=True)
class LlamaRow:
    name: str
    gpus: int
    tp: int
    cp: int
    pp: int
    dp: int
    seq: int
    batch: int                   # global batch, sequences (batch/DP x DP)
    tflops: float                # published TFLOP/s per GPU
    mfu: float                   # published BF16 MFU
    layers: int = 126
    hidden: int = 16384
    ffn: int = 53248
    heads: int = 128
    kv_heads: int = 8
    vocab: int = 128256
    source: str = SOURCE

    def __post_init__(self):
        if self.tp * self.cp * self.pp * self.dp != self.gpus:
            raise ValueError(f"row {self.name}: tp x cp x pp x dp = {self.tp * self.cp * self.pp * self.dp} "
                             f"!= gpus {self.gpus}")

    @property
    def microbatches(self) -> int:
        """One sequence per microbatch: batch/DP."""
        return self.batch // self.dp

    @property
    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The forced named mesh (outermost first: pp, dp, cp, tp; an axis of size 1 left out)."""
        axes = [("pp", self.pp), ("dp", self.dp), ("cp", self.cp), ("tp", self.tp)]
        kept = [(n, s) for n, s in axes if s > 1] or [("dp", 1)]
        return tuple(s for _, s in kept), tuple(n for n, _ in kept)

    def config(self) -> dict:
        return dict(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.ffn,
                    num_hidden_layers=self.layers, num_attention_heads=self.heads,
                    num_key_value_heads=self.kv_heads, max_position_embeddings=self.seq, rope_theta=500000.0)


ROWS = [
    LlamaRow("8k_8k", 8192, 8, 1, 16, 64, 8192, 32 * 64, 430.0, 0.43),
    LlamaRow("8k_16k", 16384, 8, 1, 16, 128, 8192, 16 * 128, 400.0, 0.41),
    LlamaRow("128k", 16384, 8, 16, 16, 8, 131072, 16 * 8, 380.0, 0.38),
]


def scaled(row: LlamaRow, k: int) -> LlamaRow:
    """The row with widths, layers, vocabulary, sequence and microbatches divided by ``k``, the mesh kept
    (key/value heads kept, so tp still splits them; heads at least twice those: GQA; layers at least
    ``pp``; at least 2 microbatches per data-parallel rank)."""
    if k == 1:
        return row
    heads = max(2 * row.kv_heads, row.heads // k)
    head_dim = max(8, row.hidden // k // heads)
    return dataclasses.replace(
        row, name=f"{row.name}/{k}", layers=max(row.pp, row.layers // k), heads=heads, hidden=heads * head_dim,
        ffn=max(8, row.ffn // k), vocab=max(64, row.vocab // k), seq=max(row.cp * 8, row.seq // k),
        batch=row.dp * max(2, row.microbatches // k))


def flops_per_token(row: LlamaRow) -> float:
    """Model FLOPs per token of one training step (forward + backward = 3 x forward, no recomputation)::

        6 x (L (2 h^2 + 2 h g d + 3 h f) + V h)  +  6 L s h

    the first term: 2 FLOPs per multiply-add of every matmul weight (q and o: h x h; k and v: h x g d,
    with g key/value heads of d = h / heads; SwiGLU's gate, up and down: h x f; the output layer
    V x h; the embedding lookup has none) times 3; the second: QK^T and AV, each 2 s h FLOPs per query
    token over all heads, halved by the causal mask (2 s h per token forward), times 3."""
    h, L, f, v, s = row.hidden, row.layers, row.ffn, row.vocab, row.seq
    gd = row.kv_heads * (h // row.heads)
    weights = L * (2 * h * h + 2 * h * gd + 3 * h * f) + v * h
    return 6 * weights + 6 * L * s * h


def step_flops(row: LlamaRow) -> float:
    return flops_per_token(row) * row.batch * row.seq


def build(row: LlamaRow):
    """(model, inputs, loss, target) on the meta device: HF LlamaForCausalLM with SDPA attention."""
    import transformers as tf

    from examples.hf_zoo import LogitsOnly, lm_loss

    cfg = tf.LlamaConfig(**row.config(), use_cache=False, attn_implementation="sdpa", bos_token_id=0,
                         eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LogitsOnly(tf.LlamaForCausalLM(cfg))
    x = torch.zeros(row.batch, row.seq, dtype=torch.long)
    return model, (x,), lm_loss, x


def forced_mesh(row: LlamaRow) -> autopar.Mesh:
    shape, names = row.mesh_shape
    return autopar.Mesh(shape, axis_names=names, device=DEVICE, gpus_per_node=GPUS_PER_NODE)


# every parameter of HF LlamaForCausalLM (inside examples.hf_zoo.LogitsOnly), by module glob
PARAM_MODULES = ("inner.model.embed_tokens", "inner.model.norm", "inner.lm_head", "inner.model.layers.*.input_layernorm",
                 "inner.model.layers.*.post_attention_layernorm") + tuple(
    f"inner.model.layers.*.{m}" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))


def annotate_data_parallel() -> None:
    """Every parameter whole on the ``dp`` axis: its compute is data-parallel there (the paper's FSDP
    shards storage only; without this the solver may use the axis as more tensor parallelism)."""
    for glob in PARAM_MODULES:
        autopar.shard(glob, weight={"dp": autopar.Replicate()})


def plan_row(row: LlamaRow, forced: bool, time_budget: float | None) -> tuple[autopar.Plan, float]:
    """(plan, wall seconds): FORCED (the published named mesh, ZeRO-1, batch/DP microbatches, SEMI_AUTO)
    or AUTO (an unnamed mesh of ``row.gpus`` H100s); bf16 mixed precision in both."""
    model, inputs, loss, target = build(row)
    autopar.reset_auto_parallel_context()
    autopar.clear_annotations()
    if forced:
        ctx = dict(zero=1 if row.dp > 1 else 0)
        if row.pp > 1:
            ctx["microbatches"] = row.microbatches
        autopar.set_auto_parallel_context(**ctx)
        if row.dp > 1:
            annotate_data_parallel()
        mesh, mode = forced_mesh(row), "semi_auto"
    else:
        mesh, mode = autopar.Mesh(row.gpus, device=DEVICE, gpus_per_node=GPUS_PER_NODE), "auto"
    try:
        t0 = time.perf_counter()
        plan = autopar.plan(model, mesh, example_inputs=inputs, loss_fn=loss, example_target=target, mode=mode,
                            mixed_precision="bf16", time_budget=time_budget)
        return plan, time.perf_counter() - t0
    finally:
        autopar.reset_auto_parallel_context()
        autopar.clear_annotations()


def forced_mismatches(row: LlamaRow, plan: autopar.Plan) -> list[str]:
    """What the forced plan does not do as published (empty when all was planned as forced)."""
    out = []
    want = {"dp": row.dp, "tp": row.tp, "pp": row.pp, "ep": 1, "cp": row.cp}
    if plan.degrees != want:
        out.append(f"degrees {plan.degrees} != {want}")
    if plan.memory_options.mixed_precision != "bf16":
        out.append(f"mixed_precision {plan.memory_options.mixed_precision!r}")
    if row.pp > 1 and plan.microbatches != row.microbatches:
        out.append(f"microbatches {plan.microbatches} != {row.microbatches}")
    return out


def result(row: LlamaRow, forced: bool, time_budget: float | None) -> dict:
    cpu0 = time.process_time()
    try:
        plan, wall = plan_row(row, forced, time_budget)
    except Exception as err:  # noqa: BLE001 - a row that cannot be planned is a finding
        return {"error": f"{type(err).__name__}: {err}", "cpu": time.process_time() - cpu0}
    tf = step_flops(row) / plan.step_time / row.gpus / 1e12
    d = plan.degrees
    out = {"tflops": tf, "ratio": tf / row.tflops, "step": plan.step_time, "solve": wall,
           "cpu": time.process_time() - cpu0,
           "degrees": " ".join(f"{k}={d[k]}" for k in ("pp", "dp", "cp", "tp", "ep") if d.get(k, 1) > 1) or "1",
           "mb": f"{plan.microbatches} {plan.schedule}" + (f" v={plan.pipeline.virtual_stages}" if plan.pipeline and
                                                           plan.pipeline.virtual_stages > 1 else ""),
           "options": plan.memory_options.summary(),
           "mem_gib": max(plan.memory_per_device) / 2**30, "note": plan.search_note,
           "flops_ratio": plan.flops / step_flops(row) if plan.flops else math.nan}
    if forced:
        out["mismatch"] = forced_mismatches(row, plan)
    return out


def run_isolated(row: LlamaRow, forced: bool, budget, hard_timeout: float) -> dict:
    return run_call_isolated(result, (row, forced, budget), hard_timeout)


def _fmt(kind: str, r: dict | None) -> str:
    if r is None:
        return f"{kind}: skipped"
    if "error" in r:
        return (f"{kind}: ERROR {r['error'].strip().splitlines()[-1][:400]} (wall {r.get('wall', math.nan):.0f} s, CPU "
                f"{r.get('cpu', math.nan):.0f} s)")
    flag = "" if kind == "auto" or abs(r["ratio"] - 1) <= TOLERANCE else " OFF"
    miss = f" | MISMATCH {'; '.join(r['mismatch'])}" if r.get("mismatch") else ""
    return (f"{kind}: {r['degrees']} mb {r['mb']} | {r['options']} | {r['tflops']:.1f} TF ({r['ratio']:.2f}x{flag}) | "
            f"step {r['step']:.2f} s | {r['mem_gib']:.1f} GiB | solve {r['solve']:.1f} s, CPU {r['cpu']:.1f} s (job wall "
            f"{r['wall']:.1f} s) | "
            f"planner/counted FLOPs {r['flops_ratio']:.2f}{miss}" + (f" | {r['note']}" if r.get("note") else ""))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Llama 3 405B rows of bench/paper_table.py (Table 4)")
    ap.add_argument("--rows", default=",".join(r.name for r in ROWS))
    ap.add_argument("--skip-auto", action="store_true")
    ap.add_argument("--skip-forced", action="store_true")
    ap.add_argument("--time-budget", type=float, default=60.0, help="AUTO's time_budget (seconds)")
    ap.add_argument("--hard-timeout", type=float, default=900.0)
    ap.add_argument("--scale", type=int, default=1, help="divide widths, layers, vocab, seq and batch by K (smoke run)")
    args = ap.parse_args(argv)
    by_name = {r.name: r for r in ROWS}
    unknown = [n for n in args.rows.split(",") if n.strip() not in by_name]
    if unknown:
        raise SystemExit(f"--rows: unknown row(s) {unknown}; the rows are {list(by_name)}")
    print(f"{SOURCE} on {DEVICE}, {GPUS_PER_NODE} per node; TF = flops_per_token x tokens / predicted step / GPUs; "
          f"AUTO time budget {args.time_budget:g} s" + (f"; --scale {args.scale}" if args.scale > 1 else ""), flush=True)
    for name in args.rows.split(","):
        row = scaled(by_name[name.strip()], args.scale)
        f = None if args.skip_forced else run_isolated(row, True, None, args.hard_timeout)
        a = None if args.skip_auto else run_isolated(row, False, args.time_budget, args.hard_timeout)
        vs = ""
        if f and a and "tflops" in f and "tflops" in a:
            vs = f" | AUTO/FORCED {a['tflops'] / f['tflops']:.2f}x"
        print(f"{row.name} on {row.gpus} {DEVICE} | published tp={row.tp} cp={row.cp} pp={row.pp} dp={row.dp} "
              f"seq {row.seq} batch {row.batch}: {row.tflops:g} TF ({row.mfu:.0%} MFU)\n  "
              f"{_fmt('forced', f)}\n  {_fmt('auto', a)}{vs}", flush=True)
