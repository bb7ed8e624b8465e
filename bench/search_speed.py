"""Benchmark (issue 35 part 6): how long the AUTO search takes on a Hugging Face Llama-3 8B job.

Builds ``LlamaForCausalLM`` on the meta device from a ``LlamaConfig`` with the 8B sizes (hidden 4096,
32 layers, 32 heads, 8 key/value heads, FFN 14336, vocab 128256), seq 2048, global batch 64, bf16
mixed precision, and plans it with ``autopar.plan(mode="auto")`` on ``Mesh(64, device="h100",
gpus_per_node=8)`` (``--named`` plans on a named 8 x 8 (dp, tp) mesh instead). Prints the wall
time and the chosen plan; ``--profile FILE`` writes a cProfile dump of the plan call.

    PYTHONPATH=. python bench/search_speed.py [--named] [--progress] [--time-budget S] [--profile FILE] [--alternatives]

``AUTOPAR_PIPELINE_BOUND=1`` in the environment turns on the pipeline candidates' step floors (solver/pipeline_bound.py).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from examples.hf_zoo import LogitsOnly, lm_loss  # noqa: E402

SEQ, BATCH, VOCAB = 2048, 64, 128256


def llama3_8b() -> LogitsOnly:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=14336, max_position_embeddings=8192,
                      rope_theta=500000.0, use_cache=False, attn_implementation="eager",
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    with torch.device("meta"):
        return LogitsOnly(LlamaForCausalLM(cfg))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--named", action="store_true", help="plan on a named 8 x 8 (dp, tp) mesh")
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--time-budget", type=float, default=None)
    ap.add_argument("--profile", default=None, help="write a cProfile dump of the plan call here")
    ap.add_argument("--alternatives", action="store_true", help="list every candidate's outcome after the plan")
    args = ap.parse_args()
    model = llama3_8b()
    x = torch.randint(0, VOCAB, (BATCH, SEQ), device="meta")
    mesh = (autopar.Mesh((8, 8), axis_names=("dp", "tp"), device="h100", gpus_per_node=8) if args.named
            else autopar.Mesh(64, device="h100", gpus_per_node=8))
    prof = cProfile.Profile() if args.profile else None
    t0, c0 = time.perf_counter(), time.process_time()
    if prof:
        prof.enable()
    p = autopar.plan(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=x, mode="auto",
                     mixed_precision="bf16", progress=args.progress, time_budget=args.time_budget)
    if prof:
        prof.disable()
        prof.dump_stats(args.profile)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    d = p.degrees
    print(f"Llama-3 8B, seq {SEQ}, batch {BATCH}, bf16 on {mesh.shape} x h100 ({'named' if args.named else 'auto'}): "
          f"{wall:.1f} s ({cpu:.1f} s CPU, load {os.getloadavg()[0]:.1f}) | dp={d.get('dp')} tp={d.get('tp')} "
          f"pp={d.get('pp')} microbatches={p.microbatches} {p.schedule} | {p.memory_options.summary()} | "
          f"step {p.step_time:.4f} s | peak {max(p.memory_per_device) / 2**30:.2f} GiB"
          + (f" | {p.search_note}" if p.search_note else ""), flush=True)
    if args.alternatives:
        for a in sorted(p.alternatives, key=lambda a: (not a.fits, a.step_time, a.note)):
            print(f"  {'fits' if a.fits else 'no  '} {a.step_time:9.4f} s  {a.note[:230]}", flush=True)


if __name__ == "__main__":
    main()
