"""Train a tiny Hugging Face model from the zoo (examples/hf_zoo.py, docs/zoo.md) for a few steps on
several processes, printing each step's loss next to the same training on one process.

    python -m examples.hf_train --model t5 --mode auto --nprocs 2 --steps 5
    python -m examples.hf_train --model llama --mode semi_auto     # Megatron MLP split on the tp axis
"""
from __future__ import annotations

import argparse

import torch

import autopar
from examples.hf_zoo import NAMES, annotate_tensor_parallel, hf_model

LR = 0.05


def single_device_losses(name: str, steps: int) -> list[float]:
    torch.manual_seed(0)
    zm = hf_model(name)
    (args, kwargs), model = zm.inputs, zm.module
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for _ in range(steps):
        loss = zm.loss_fn(model(*args, **kwargs), zm.target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def rank_main(rank: int, name: str, mode: str, steps: int) -> None:
    world = torch.distributed.get_world_size()
    torch.manual_seed(0)
    zm = hf_model(name)
    args, kwargs = zm.inputs
    mesh = autopar.Mesh(world, axis_names=("tp",)) if mode == "semi_auto" else autopar.Mesh(world)
    if mode == "semi_auto":
        annotate_tensor_parallel(name)
    pmodel = autopar.parallelize(zm.module, mesh, example_inputs=args, example_kwargs=kwargs, loss_fn=zm.loss_fn,
                                 example_target=zm.target, mode=mode)
    opt = torch.optim.SGD(pmodel.parameters(), lr=LR, momentum=0.9)
    losses = []
    for _ in range(steps):
        losses.append(pmodel.step(*args, target=zm.target, **kwargs).item())
        opt.step()
        opt.zero_grad()
    if rank == 0:
        print(f"{name} {mode} on {world} processes, plan {pmodel.plan.degrees}")
        print(f"{'step':>4}  {'autopar':>12}  {'one process':>12}  {'rel. diff':>9}")
        for i, (a, b) in enumerate(zip(losses, single_device_losses(name, steps))):
            print(f"{i:>4}  {a:>12.6f}  {b:>12.6f}  {abs(a - b) / abs(b):>9.1e}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=NAMES, default="gpt2")
    p.add_argument("--mode", choices=("data", "semi_auto", "auto"), default="auto")
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    autopar.launch(rank_main, nprocs=args.nprocs, args=(args.model, args.mode, args.steps))


if __name__ == "__main__":
    main()
