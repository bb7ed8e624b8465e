"""Benchmark (issue 34): published mixture-of-experts training throughputs, planned by autopar on
simulated clusters (``bench/paper_table.py --table moe``).

Rows (``MOE_ROWS``), models built on the meta device from Hugging Face configs:

* **Mixtral 8x7B on 64 H100** (Megatron-Core): **468 TFLOP/s per GPU** (MCore v0.9, the headline of
  ``megatron/core/transformer/moe/README.md``, github.com/NVIDIA/Megatron-LM). The layout is the
  README's "Reference Best Parallel Mapping" table (its MCore v0.8 edition, 438 TF) and the benchmark
  recipe of github.com/yanring/Megatron-MoE-ModelZoo
  (``runtime_configs/benchmarking/runtime.conf``: ``[Mixtral-8x7B]`` TP1 PP4 EP8 CP1 VPP8 MBS1 GBS256,
  alltoall dispatcher, grouped GEMM, 8 nodes, seq 4096; ``model_configs/benchmarking/*.yaml``:
  ``--use-flash-attn``, ``--use-distributed-optimizer``, ``--overlap-grad-reduce``,
  ``--overlap-param-gather``, ``--sequence-parallel``, bf16, and no ``--recompute-*`` or
  ``--moe-layer-recompute`` flag: no recomputation). TFLOP/s counted as Megatron counts them
  (``megatron_flops``, its ``num_floating_point_operations``: 12 B s L h^2 ((1 + g/a + s/h) + f/h k
  3/2 + V/(2 L h))).

  What FORCED expresses of it: the mesh (pp 4, dp 2, ep 8: dense ops data-parallel over dp x ep =
  16), the micro-batch (1 sequence per data-parallel rank: 16 microbatches), bf16, no recomputation
  (``recompute="none"``), attention as SDPA with ``is_causal`` (the HF model built with
  ``attn_implementation="sdpa"``: no mask is materialised or sent between stages,
  ``autopar/frontend/causal_sdpa.py``; flash attention's FLOPs counted in full as Megatron counts
  them), the 8 virtual pipeline stages (``virtual_stages=8``: interleaved 1F1B, one layer per
  virtual stage). The distributed optimizer is ZeRO-1 over the data-parallel ranks. What it cannot:
  the overlap of the gradient reduce and parameter gather with compute.
* **DeepSeek-V3 671B on 2048 H800** (DeepSeek-V3 technical report, arXiv 2412.19437): PP16 x EP64
  (spanning 8 nodes) x ZeRO-1 data parallelism, no tensor parallelism, sequence 4096, batch 15360
  sequences at the end of its batch-size schedule. The report gives no TFLOP/s; it gives 180K H800
  GPU hours per trillion training tokens (section 1). Per GPU::

      tokens / GPU-second = 1e12 / (180e3 x 3600) = 1543
      FLOPs / token       = 6 x 37e9 (activated parameters; forward + backward, attention left out)
      TFLOP/s per GPU     = 6 x 37e9 x 1543 / 1e12 = 342.6

  DeepSeek ran its GEMMs in FP8 with DualPipe overlapping the all-to-alls; autopar plans bf16 and
  adds communication to compute where it does not model overlap. Its attention is MLA (SDPA with
  ``is_causal``, as for Mixtral).

* **DeepSeek-V3, two hops** (``deepseek_v3_two_hop``): the same layout with its ep 64 named as two axes,
  ``"expert"`` (8, across the nodes) and ``"ep"`` (8, inside a node): the dispatch then sends a token
  once per destination node over InfiniBand and fans it out over NVLink (``collectives/moe_dispatch.py``),
  as DeepSeek-V3's node-limited routing does (report section 3.2). Its forced plan is data-parallel over
  dp x expert x ep = 128 as the one-hop row's (``solver/data_start.py``; before, §34g, it was not).

For each row: FORCED, the published layout as a named mesh ``("pp", "dp", "ep")`` (every
``moe_experts`` node takes "ep" on the "ep" axis, ``solver/moe_axes.py``; dense ops data-parallel over
``dp x ep``), bf16 mixed precision, the row's recomputation (``MoeRow.recompute``; None lets the
planner pick) and ZeRO-1 (both sources shard the optimizer state over the data-parallel ranks), in
SEMI_AUTO (the planner picks the schedule where the row does not fix it;
microbatches are the published ones: one sequence per data-parallel rank, ``batch / (dp x ep)``);
AUTO, autopar's own plan on an unnamed mesh of the same GPUs. Both models are built with
``attn_implementation="sdpa"``. Each job runs in its own process (``paper_table.run_isolated`` style) with a hard timeout.

    PYTHONPATH=. .venv/bin/python bench/paper_table.py --table moe [--rows mixtral_8x7b] [--skip-auto]
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

import autopar
from bench.common import run_call_isolated

TOLERANCE = 0.25


@dataclass(frozen=True)
class MoeRow:
    name: str
    family: str                  # "mixtral" | "deepseek_v3"
    config: dict                 # the HF config's fields
    device: str
    gpus: int
    mesh: tuple                  # forced (pp, dp, ep)
    seq: int
    batch: int                   # global batch, sequences
    zero: int
    tflops: float                # published (or derived) TFLOP/s per GPU
    source: str
    gpus_per_node: int = 8
    flops_kind: str = "megatron"  # how TFLOP/s is counted: "megatron" or "6n" (6 x activated parameters)
    activated: float = 0.0       # activated parameters per token ("6n")
    recompute: str | None = None  # the published recomputation ("none", ...); None: the planner picks
    extra: dict = field(default_factory=dict)   # further auto-parallel context settings of the FORCED plan
    axis_names: tuple = ("pp", "dp", "ep")      # the forced mesh's axes; two expert axes ("expert" across nodes,
                                                # "ep" inside one): the two-hop, node-de-duplicated dispatch


MIXTRAL_8X7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                    max_position_embeddings=32768)
DEEPSEEK_V3 = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                   num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
                   n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3,
                   q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                   max_position_embeddings=4096)

MOE_ROWS = [
    MoeRow("mixtral_8x7b", "mixtral", MIXTRAL_8X7B, "h100", 64, (4, 2, 8), 4096, 256, 1, 468.0,
           "Megatron-Core MoE README (MCore v0.9): TP1 EP8 PP4 VP8, 64 H100, seq 4096, GBS 256", recompute="none",
           extra={"virtual_stages": 8}),
    MoeRow("deepseek_v3", "deepseek_v3", DEEPSEEK_V3, "h800", 2048, (16, 2, 64), 4096, 15360, 1, 342.6,
           "DeepSeek-V3 report: PP16 EP64 ZeRO-1 on 2048 H800; 180K GPU hours / 1T tokens -> 342.6 TF (6N)",
           flops_kind="6n", activated=37e9, extra={"solver_time_limit": 120.0}),
    MoeRow("deepseek_v3_two_hop", "deepseek_v3", DEEPSEEK_V3, "h800", 2048, (16, 2, 8, 8), 4096, 15360, 1, 342.6,
           "the deepseek_v3 row, its ep 64 as 8 nodes x 8 GPUs: a token crosses InfiniBand once per destination node "
           "(DeepSeek-V3 report 3.2), then fans out over NVLink", flops_kind="6n", activated=37e9,
           extra={"solver_time_limit": 120.0}, axis_names=("pp", "dp", "expert", "ep")),
]

EXTRA_ROWS: list = []     # rows selected by name only (``--rows``): none at present


def megatron_flops(cfg: dict, batch: int, seq: int) -> float:
    """Megatron-LM's ``num_floating_point_operations`` (training.py) for a SwiGLU GQA MoE model."""
    h, L, a = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    g, f, k, v = cfg["num_key_value_heads"], cfg["intermediate_size"], cfg["num_experts_per_tok"], cfg["vocab_size"]
    return 12 * batch * seq * L * h * h * ((1 + g / a + seq / h) + f / h * k * 1.5 + v / (2 * L * h))


def step_flops(row: MoeRow) -> float:
    """FLOPs per step as the row's source counts them."""
    if row.flops_kind == "6n":
        return 6 * row.activated * row.batch * row.seq
    return megatron_flops(row.config, row.batch, row.seq)


def build(row: MoeRow):
    """(model, inputs, loss, target) on the meta device."""
    import transformers as tf

    from examples.hf_zoo import LogitsOnly, lm_loss

    common = dict(use_cache=False, attn_implementation="sdpa", bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if row.family == "mixtral":
        cfg, cls = tf.MixtralConfig(**row.config, **common), tf.MixtralForCausalLM
    else:
        cfg, cls = tf.DeepseekV3Config(**row.config, **common), tf.DeepseekV3ForCausalLM
    with torch.device("meta"):
        model = LogitsOnly(cls(cfg))
    x = torch.zeros(row.batch, row.seq, dtype=torch.long)
    return model, (x,), lm_loss, x


def plan_row(row: MoeRow, forced: bool, time_budget: float | None) -> tuple[autopar.Plan, float]:
    model, inputs, loss, target = build(row)
    autopar.reset_auto_parallel_context()
    autopar.clear_annotations()
    if forced:
        # the published micro-batch of 1 sequence per data-parallel rank: batch / (dp x ep) microbatches
        autopar.set_auto_parallel_context(zero=row.zero, microbatches=row.batch // math.prod(row.mesh[1:]),
                                          recompute=row.recompute, **row.extra)
        mesh = autopar.Mesh(row.mesh, axis_names=row.axis_names, device=row.device, gpus_per_node=row.gpus_per_node)
        mode = "semi_auto"
    else:
        mesh = autopar.Mesh(row.gpus, device=row.device, gpus_per_node=row.gpus_per_node)
        mode = "auto"
    try:
        t0 = time.perf_counter()
        plan = autopar.plan(model, mesh, example_inputs=inputs, loss_fn=loss, example_target=target, mode=mode,
                            mixed_precision="bf16", time_budget=time_budget)
        return plan, time.perf_counter() - t0
    finally:
        autopar.reset_auto_parallel_context()


def result(row: MoeRow, forced: bool, time_budget: float | None) -> dict:
    try:
        plan, wall = plan_row(row, forced, time_budget)
    except Exception as err:  # noqa: BLE001 - a row that cannot be planned is a finding
        return {"error": f"{type(err).__name__}: {err}"}
    tf = step_flops(row) / plan.step_time / row.gpus / 1e12
    d = plan.degrees
    return {"tflops": tf, "ratio": tf / row.tflops, "step": plan.step_time, "solve": wall,
            "degrees": " ".join(f"{k}={d[k]}" for k in ("pp", "dp", "tp", "ep") if d.get(k, 1) > 1) or "1",
            "mb": f"{plan.microbatches} {plan.schedule}" + (f" v={plan.pipeline.virtual_stages}" if plan.pipeline and
                                                            plan.pipeline.virtual_stages > 1 else ""), "options": plan.memory_options.summary(),
            "mem_gib": max(plan.memory_per_device) / 2**30, "note": plan.search_note,
            "flops_ratio": plan.flops / step_flops(row) if plan.flops else math.nan}


def run_isolated(row: MoeRow, forced: bool, budget, hard_timeout: float) -> dict:
    return run_call_isolated(result, (row, forced, budget), hard_timeout)


def _fmt(kind: str, r: dict | None) -> str:
    if r is None:
        return f"{kind}: skipped"
    if "error" in r:
        return f"{kind}: ERROR {r['error'].strip().splitlines()[-1][:300]} (wall {r.get('wall', math.nan):.0f} s)"
    flag = "" if kind == "auto" or abs(r["ratio"] - 1) <= TOLERANCE else " OFF"
    return (f"{kind}: {r['degrees']} mb {r['mb']} | {r['options']} | {r['tflops']:.1f} TF ({r['ratio']:.2f}x{flag}) | "
            f"step {r['step']:.2f} s | {r['mem_gib']:.1f} GiB | solve {r['solve']:.1f} s | planner/counted FLOPs "
            f"{r['flops_ratio']:.2f}" + (f" | {r['note']}" if r.get("note") else ""))


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="MoE rows of bench/paper_table.py")
    ap.add_argument("--rows", default=",".join(r.name for r in MOE_ROWS))
    ap.add_argument("--skip-auto", action="store_true")
    ap.add_argument("--skip-forced", action="store_true")
    ap.add_argument("--time-budget", type=float, default=60.0)
    ap.add_argument("--hard-timeout", type=float, default=900.0)
    args = ap.parse_args(argv)
    rows = {r.name: r for r in MOE_ROWS + EXTRA_ROWS}
    for name in args.rows.split(","):
        row = rows[name.strip()]
        f = None if args.skip_forced else run_isolated(row, True, None, args.hard_timeout)
        a = None if args.skip_auto else run_isolated(row, False, args.time_budget, args.hard_timeout)
        vs = ""
        if f and a and "tflops" in f and "tflops" in a:
            vs = f" | AUTO/FORCED {a['tflops'] / f['tflops']:.2f}x"
        print(f"{row.name} on {row.gpus} {row.device} | published {row.tflops:g} TF ({row.source})\n  "
              f"{_fmt('forced', f)}\n  {_fmt('auto', a)}{vs}", flush=True)
