"""Benchmark (issue 34, §34b): a Mixtral-like MoE on 4 CPU ranks, autopar ep 4 vs autopar DATA vs
torch DDP.

Part 1, step time: the same model (HF Mixtral from a config: 8 experts, hidden 256) and global batch
on 4 gloo ranks (one thread each) in ONE process group; per round each contender runs one training
step (forward, backward, AdamW step, zero_grad), interleaved:

  ep4      autopar.parallelize(..., Mesh(4, axis_names=("ep",)), mode="auto"): the "ep" axis makes
           every experts op expert-parallel (2 experts per rank, tokens all_to_all'd), the dense ops
           data-parallel
  data     autopar DATA (experts replicated, every gradient all-reduced)
  ddp      DistributedDataParallel(model) on the local quarter of the batch

Prints medians, ratios of medians and paired spreads, and each rank's training-state bytes
(parameters + gradients + AdamW state, local pieces) and expert weight bytes.

Part 2, peak memory: each contender alone in a fresh 4-rank pool (the same steps), peak RSS per
rank (``ru_maxrss``) and the growth over the RSS before the model was built.

    .venv/bin/python bench/moe_cpu.py [--quick] [--reps N] [--skip-rss]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Ratio, header, interleaved  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

CFG = {"vocab": 1024, "hidden": 256, "inter": 512, "experts": 8, "layers": 2, "seq": 64, "batch": 16}
QUICK_CFG = {**CFG, "layers": 1, "batch": 8}
CONTENDERS = ("ep4", "data", "ddp")


def _model(cfg):
    import transformers as tf

    from examples.hf_zoo import LogitsOnly

    torch.manual_seed(0)
    c = tf.MixtralConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["inter"],
                         num_hidden_layers=cfg["layers"], num_attention_heads=8, num_key_value_heads=8,
                         num_local_experts=cfg["experts"], num_experts_per_tok=2, max_position_embeddings=cfg["seq"],
                         use_cache=False, attn_implementation="eager", bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LogitsOnly(tf.MixtralForCausalLM(c))


def _batch(cfg):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(1, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    return x, torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)


def _state_bytes(params, opt) -> dict:
    """This rank's bytes of parameters, gradients and optimizer state (local pieces), and of expert weights."""
    def nbytes(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    ps = list(params)
    out = {"params": sum(nbytes(p) for _, p in ps), "grads": sum(nbytes(p.grad) for _, p in ps if p.grad is not None),
           "optim": sum(nbytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)),
           "experts": sum(nbytes(p) for n, p in ps if "experts" in n)}
    out["total"] = out["params"] + out["grads"] + out["optim"]
    return out


def _contender(name: str, cfg: dict):
    """(step closure, state-bytes closure) of one contender on this rank."""
    import autopar
    from examples.hf_zoo import lm_loss
    from torch.nn.parallel import DistributedDataParallel as DDP

    x, y = _batch(cfg)
    world, rank = dist.get_world_size(), dist.get_rank()
    if name == "ddp":
        model = DDP(_model(cfg))
        per = cfg["batch"] // world
        xl, yl = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step():
            lm_loss(model(xl), yl).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)

        return step, lambda: _state_bytes(model.module.named_parameters(), opt)
    autopar.reset_auto_parallel_context()
    autopar.clear_annotations()
    mesh = autopar.Mesh(world, axis_names=("ep",) if name == "ep4" else None)
    pmodel = autopar.parallelize(_model(cfg), mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                                 mode="auto" if name == "ep4" else "data")
    if name == "ep4":
        assert pmodel.plan.degrees["ep"] == world, pmodel.plan.degrees
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)

    def step():
        pmodel.step(x, target=y)
        opt.step()
        opt.zero_grad(set_to_none=False)

    return step, lambda: _state_bytes(pmodel.named_parameters(), opt)


def rank_times(rank: int, cfg: dict, reps: int, warmup: int) -> dict:
    torch.set_num_threads(1)
    made = {n: _contender(n, cfg) for n in CONTENDERS}
    times = interleaved({n: s for n, (s, _) in made.items()}, reps=reps, warmup=warmup)
    return {"times": times, "state": {n: b() for n, (_, b) in made.items()}}


def rank_rss(rank: int, name: str, cfg: dict, steps: int) -> dict:
    import resource

    def rss_now():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    torch.set_num_threads(1)
    before = rss_now()
    step, _ = _contender(name, cfg)
    for _ in range(steps):
        step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_mib": peak, "growth_mib": peak - before}


def main(argv=None) -> int:
    from autopar.runtime.launch import RankPool

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--skip-rss", action="store_true")
    args = ap.parse_args(argv)
    cfg = QUICK_CFG if args.quick else CFG
    reps = args.reps or (4 if args.quick else 10)
    print(header("MoE on 4 CPU ranks: autopar ep 4 vs autopar DATA vs torch DDP"))
    print(f"Mixtral {cfg}, top-2, AdamW, 4 gloo ranks x 1 thread, {reps} interleaved rounds")
    pool = RankPool(4, timeout_s=1800)
    try:
        res = pool.run(rank_times, cfg, reps, 2, timeout_s=1800)
    finally:
        pool.close()
    t = res[0]["times"]
    for a, b in (("ep4", "ddp"), ("data", "ddp"), ("ep4", "data")):
        print(Ratio(a, b, t[a], t[b]).line())
    print("training state per rank, MiB (params + grads + AdamW), and expert weights:")
    for n in CONTENDERS:
        s = [r["state"][n] for r in res]
        print(f"  {n:<5} total {max(x['total'] for x in s) / 2**20:7.2f}  params {max(x['params'] for x in s) / 2**20:6.2f}"
              f"  experts {max(x['experts'] for x in s) / 2**20:6.2f}")
    if not args.skip_rss:
        print("peak RSS per rank, each contender alone in a fresh 4-rank pool (3 steps), MiB (max over ranks):")
        for n in CONTENDERS:
            pool = RankPool(4, timeout_s=1800)
            try:
                rows = pool.run(rank_rss, n, cfg, 3, timeout_s=1800)
            finally:
                pool.close()
            print(f"  {n:<5} peak {max(r['peak_mib'] for r in rows):7.1f}  growth over the pre-model RSS "
                  f"{max(r['growth_mib'] for r in rows):7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
