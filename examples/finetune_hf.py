"""Fine-tune a pretrained Hugging Face model on several processes, end to end, and export it.

A tiny ``LlamaForCausalLM`` is built from a config and saved with ``save_pretrained`` to a temporary
directory: that is "the pretrained checkpoint". Then, on 2 processes (``autopar.launch``), each rank
builds the model on the meta device (nothing is allocated until the plan gives the rank its
pieces), parallelizes it, reads only its slices of the checkpoint
(``pmodel.load_pretrained``), trains a few steps and exports the result (``pmodel.save_pretrained``:
safetensors + config.json, streamed one tensor at a time to rank 0). Finally one process loads the
export with ``transformers.AutoModelForCausalLM.from_pretrained`` and checks it against the same
fine-tuning run on one process.

    python -m examples.finetune_hf                      # tensor-parallel MLPs on 2 processes
    python -m examples.finetune_hf --mode data --steps 5
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import autopar
from examples.hf_zoo import LogitsOnly, annotate_tensor_parallel, llama_config, lm_loss

LR, BATCH, SEQ = 0.05, 8, 16


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(1, 128, (BATCH, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)          # next-token targets


def build(on_meta: bool) -> LogitsOnly:
    """The model to fine-tune, wrapped to return logits (so its names are ``inner.<hf name>``)."""
    from transformers import LlamaForCausalLM

    cfg = llama_config(2, tie_word_embeddings=True)
    if on_meta:
        with torch.device("meta"):
            return LogitsOnly(LlamaForCausalLM(cfg))
    return LogitsOnly(LlamaForCausalLM(cfg))


def rank_main(rank: int, pretrained: str, out: str, mode: str, steps: int) -> None:
    world = torch.distributed.get_world_size()
    model = build(on_meta=True)            # nothing allocated: each rank makes only its pieces
    if mode == "semi_auto":
        annotate_tensor_parallel("llama")
    mesh = autopar.Mesh(world, axis_names=("tp",)) if mode == "semi_auto" else autopar.Mesh(world)
    x, y = batch(0)
    pmodel = autopar.parallelize(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, mode=mode)
    pmodel.init_weights(seed=0)              # buffers (rotary frequencies); the weights come next
    pmodel.load_pretrained(pretrained, prefix="inner.")
    opt = torch.optim.SGD(pmodel.parameters(), lr=LR, momentum=0.9)
    losses = []
    for s in range(steps):
        x, y = batch(s)
        losses.append(pmodel.step(x, target=y).item())
        opt.step()
        opt.zero_grad()
    export = pmodel.save_pretrained(out, prefix="inner.")
    if rank == 0:
        print(f"fine-tuned on {world} processes ({mode}, plan {pmodel.plan.degrees}, built on "
              f"meta): losses {[round(v, 4) for v in losses]}")
        print(f"exported {export.tensors} tensors to {', '.join(export.files)}; the writer held at most "
              f"{export.peak_bytes} bytes of gathered tensors at once")


def one_process(pretrained: str, steps: int) -> dict:
    """The same fine-tuning on one process, from transformers' own loading."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(pretrained)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for s in range(steps):
        x, y = batch(s)
        F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("data", "semi_auto", "auto"), default="semi_auto")
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="finetune_hf_") as tmp:
        pretrained, out = str(Path(tmp) / "pretrained"), str(Path(tmp) / "finetuned")
        torch.manual_seed(123)
        build(on_meta=False).inner.save_pretrained(pretrained)
        autopar.launch(rank_main, nprocs=args.nprocs, args=(pretrained, out, args.mode, args.steps))
        got = AutoModelForCausalLM.from_pretrained(out).state_dict()
        want = one_process(pretrained, args.steps)
        worst = max(float((got[k] - v).abs().max() / v.abs().max().clamp_min(1e-12)) for k, v in want.items())
        moved = max(float((got[k] - v).abs().max()) for k, v in
                    AutoModelForCausalLM.from_pretrained(pretrained).state_dict().items())
        print(f"transformers reloads the export: largest relative difference from the one-process fine-tuning "
              f"{worst:.1e} (weights moved by up to {moved:.1e} in fine-tuning)")
        if set(got) != set(want) or worst > 1e-5 or moved == 0:
            raise SystemExit("the exported model does not match the one-process fine-tuning")


if __name__ == "__main__":
    main()
