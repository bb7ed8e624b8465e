"""MoE under mixed_precision="bf16": Mixtral with its experts expert-parallel on 4 ranks (ep 4) lands
within ``TORCH_FACTOR`` x torch FSDP2's distance (same bf16 policy, same job, 4 ranks) from the fp32
single-device run, and from the single-device run under the bf16 policy (the yardstick of
tests/ranks/test_mixed_precision.py); every rank computed with bf16 working copies."""
from __future__ import annotations

import pytest
import torch

import autopar
from conftest import _fresh_call, _pool
from moe_models import batch, lm_loss, moe_lm
from oracle import _train, distance, make_optimizer, parallel_run, reference_run
from ranks.test_mixed_precision import TORCH_FACTOR, _working_dtypes
from ranks.test_moe_exact import _annotate_experts, _roles

pytest.importorskip("transformers")

BF16 = torch.bfloat16
STEPS = 2


def _ep4_job(rank):
    x, y = batch()
    mesh = autopar.Mesh(4, axis_names=("dp",))
    return parallel_run(rank, moe_lm, lm_loss, x, y, mesh, "semi_auto", steps=STEPS, setup=_annotate_experts("dp"),
                        mixed_precision="bf16", inspect=_working_dtypes)


def _fsdp_job(rank):
    """torch's own: FSDP2 over the 4 ranks with the same policy (bf16 params, fp32 reduce), the same job."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    x, y = batch()
    torch.manual_seed(0)
    model = moe_lm()
    fully_shard(model, mesh=init_device_mesh("cpu", (4,)),
                mp_policy=MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32))
    opt = make_optimizer(model.parameters(), "sgd", 0.05)
    xl, yl = x.chunk(4)[rank], y.chunk(4)[rank]

    def step(_):
        loss = lm_loss(model(xl), yl)
        loss.backward()
        total = loss.detach().float().clone()
        torch.distributed.all_reduce(total)
        return total / 4

    def full(tensors):
        return {k: v.full_tensor().detach() if hasattr(v, "full_tensor") else v.detach() for k, v in tensors.items()}

    return _train(step, lambda: full(model.state_dict()),
                  lambda: full({n: p.grad for n, p in model.named_parameters() if p.grad is not None}), opt, STEPS)


def _both(rank):
    return {"ep4": _ep4_job(rank), "fsdp": _fsdp_job(rank)}


@pytest.mark.slow
def test_moe_ep4_bf16_within_torch_fsdp2_distance():
    results = _pool(4).run(_fresh_call, _both, timeout_s=600)
    x, y = batch()
    refs = {"fp32": reference_run(moe_lm, lm_loss, x, y, steps=STEPS),
            "bf16": reference_run(moe_lm, lm_loss, x, y, steps=STEPS, mixed_precision="bf16")}
    plan = autopar.Plan.from_json(results[0]["ep4"]["plan"])
    assert plan.memory_options.mixed_precision == "bf16" and _roles(plan) == {("dp", "ep")}, _roles(plan)
    for kind, ref in refs.items():
        torch_d = distance(results[0]["fsdp"], ref)
        assert 0 < torch_d < 5e-2, f"torch FSDP2 lands {torch_d:.3e} from the {kind} reference: the reference is off"
        for r in results:
            assert r["ep4"]["inspect"] == {"torch.bfloat16"}, r["ep4"]["inspect"]
            d = distance(r["ep4"], ref)
            assert d <= TORCH_FACTOR * torch_d, f"ep 4 bf16: {d:.3e} from the {kind} run; torch FSDP2 {torch_d:.3e}"
