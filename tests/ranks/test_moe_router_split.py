"""DeepSeek-V3's group-limited router (``topk`` over groups, ``zeros_like`` + ``scatter`` of the group mask,
``topk`` of the experts, ``gather`` of their weights) runs on each rank's tokens under expert parallelism
(``sharding/rules/routing.py``), and trains like one device (the oracle: losses, gathered gradients and
parameters after SGD-with-momentum steps at 1e-5, against a one-process run made here)."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar import Shard
from autopar.frontend.moe_experts import why_not_opaque
from conftest import _fresh_call, _pool
from moe_models import _COMMON, batch, lm_loss
from oracle import assert_same_training, parallel_run, reference_run

tf = pytest.importorskip("transformers")

STEPS = 2
ROUTER_OPS = ("aten.topk", "aten.gather", "aten.scatter", "aten.zeros_like")


def _model():
    from examples.hf_zoo import LogitsOnly

    cfg = tf.DeepseekV3Config(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                              n_group=4, topk_group=2, first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16,
                              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                              **{**_COMMON, "num_key_value_heads": 4})
    torch.manual_seed(0)
    model = tf.DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():       # the zero-initialised bias would leave the group choice to ties
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.normal_(0, 0.5)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    return LogitsOnly(model)


def _setup(model):
    for path, mod in model.named_modules():
        if why_not_opaque(mod) is None:
            autopar.shard(path, **{n: {"dp": Shard(0)} for n, _ in mod.named_parameters()})
            autopar.op_strategy(path, dp="ep")


def _job(rank):
    x, y = batch()
    return parallel_run(rank, _model, lm_loss, x, y, autopar.Mesh(4, axis_names=("dp",)), "semi_auto", steps=STEPS,
                        setup=_setup)


def _trains_like_one_device(job, what: str):
    """``job`` on 4 ranks trains like one device; (its results, rank 0's plan)."""
    x, y = batch()
    ref = reference_run(_model, lm_loss, x, y, steps=STEPS)
    results = _pool(4).run(_fresh_call, job, timeout_s=600)
    for r, res in enumerate(results):
        assert_same_training(ref, res, what=f"{what} rank {r}")
    return results, autopar.Plan.from_json(results[0]["plan"])


def test_group_limited_router_runs_on_each_ranks_tokens_and_trains_like_one_device():
    _, plan = _trains_like_one_device(_job, "deepseek router ep4")
    router = {n: d for n, d in plan.nodes.items() if d.op.startswith(ROUTER_OPS) and ".mlp.gate" in d.module}
    assert {d.op.split(".")[1] for d in router.values()} >= {"topk", "gather", "scatter", "zeros_like"}, router
    assert all(str(d.output if not isinstance(d.output, list) else d.output[0]) == "[S(0)]" for d in router.values()), \
        {n: (d.op, str(d.output)) for n, d in router.items()}


def _job_two_hop(rank):
    from autopar.collectives.comm import count_collectives

    x, y = batch()

    def inspect(pmodel):
        x7, y7 = batch(seed=7)
        with count_collectives() as c:
            pmodel.step(x7, target=y7)
        return [call for call in c.calls if call[0] == "all_to_all"]
    return parallel_run(rank, _model, lm_loss, x, y, autopar.Mesh((2, 2), axis_names=("expert", "ep")), "semi_auto",
                        steps=STEPS, inspect=inspect)


@pytest.mark.slow
def test_two_ep_axes_dispatch_in_two_de_duplicated_hops_and_train_like_one_device():
    """Mesh axes "expert" (outer, the node in a real cluster) and "ep" (inner): every experts op takes "ep" on
    both, and the dispatch runs one hop per axis, a token going once to each "expert" coordinate holding one
    of its experts, then once to each rank there (``collectives/moe_dispatch.py``)."""
    results, plan = _trains_like_one_device(_job_two_hop, "deepseek two-hop")
    moe = [d for d in plan.nodes.values() if d.op.startswith("autopar.moe_experts")]
    assert moe and all(d.local == ["moe:ep", "moe:ep"] for d in moe), [d.local for d in moe]
    a2a = results[0]["inspect"]
    assert {(ax, ph) for _, _, ax, ph in a2a} == {(a, p) for a in ("expert", "ep") for p in ("fwd", "bwd")}, a2a
