"""Bad input gets a clear error naming the thing at fault and what to do (planning level)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar import Shard
from examples.models import GPT, MLP, lm_loss
from oracle import make_batch


def _plan(model, mesh, mode="auto", batch=8, **kw):
    x, y = make_batch("vector", batch)
    return autopar.plan(model, mesh, example_inputs=(x,), loss_fn=F.cross_entropy, example_target=y, mode=mode, **kw)


def test_batch_not_divisible_by_data_parallel_size():
    with pytest.raises(autopar.PlanError, match=r"global batch \(6.*not divisible by the data-parallel size 4"):
        _plan(MLP(), autopar.Mesh(4), mode="data", batch=6)


def test_batch_not_divisible_by_named_dp_axis():
    with pytest.raises(autopar.PlanError, match=r"not divisible by the data-parallel size 4"):
        _plan(MLP(), autopar.Mesh(4, axis_names=("dp",)), batch=6)


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 10)
        self.gate = _Gate()

    def forward(self, x):
        return self.gate(self.fc(x))


class _Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x


def test_untraceable_model_names_module_and_line():
    with pytest.raises(autopar.TraceError) as err:
        _plan(_DataDependent(), autopar.Mesh(2))
    msg = str(err.value)
    assert "in module 'gate'" in msg and "test_errors.py" in msg and "What to try" in msg


def test_missing_example_inputs():
    with pytest.raises(ValueError, match="example_inputs is required"):
        autopar.plan(MLP(), autopar.Mesh(2), example_inputs=None)


def test_loss_without_target():
    x, _ = make_batch("vector", 8)
    with pytest.raises(ValueError, match="loss_fn was given without example_target"):
        autopar.plan(MLP(), autopar.Mesh(2), example_inputs=(x,), loss_fn=F.cross_entropy)


def test_non_tensor_example_input():
    with pytest.raises(TypeError, match=r"example_inputs\[0\] is a list"):
        autopar.plan(MLP(), autopar.Mesh(2), example_inputs=([1, 2],))


def test_unknown_mode_string_lists_the_modes():
    with pytest.raises(ValueError, match=r"unknown parallel mode 'fast'.*'data'.*'semi_auto'.*'auto'"):
        _plan(MLP(), autopar.Mesh(2), mode="fast")


def test_hybrid_needs_a_plan():
    with pytest.raises(autopar.PlanError, match="HYBRID mode applies a complete plan: pass plan="):
        _plan(MLP(), autopar.Mesh(2), mode="hybrid")


def test_parallelize_needs_a_process_group_for_more_than_one_device():
    x, y = make_batch("vector", 8)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized: run under torchrun or autopar.launch"):
        autopar.parallelize(MLP(), autopar.Mesh(4), example_inputs=(x,), loss_fn=F.cross_entropy, example_target=y)


def test_parallelize_refuses_a_half_meta_model():
    x, y = make_batch("vector", 8)
    model = MLP()
    with torch.device("meta"):
        model.head = torch.nn.Linear(64, 10)
    with pytest.raises(ValueError, match="meta device and others not \\(layers.0.weight"):
        autopar.parallelize(model, autopar.Mesh(1), example_inputs=(x,), loss_fn=F.cross_entropy, example_target=y)


def test_plan_for_another_model_is_rejected():
    x, y = make_batch("vector", 8)
    plan = _plan(MLP(hidden=64), autopar.Mesh(1), mode="data")
    with pytest.raises(autopar.PlanError, match="made for a different model or input shapes"):
        autopar.parallelize(MLP(hidden=32), autopar.Mesh(1), example_inputs=(x,), loss_fn=F.cross_entropy,
                            example_target=y, plan=plan)


def test_semi_auto_unknown_axis_name():
    model = MLP()
    autopar.shard(model.layers[0], weight={"mp": Shard(0)})
    with pytest.raises(autopar.PlanError, match=r"unknown mesh axis 'mp'; the mesh has axes \('tp',\)"):
        _plan(model, autopar.Mesh(2, axis_names=("tp",)), mode="semi_auto")


def test_semi_auto_shard_dim_out_of_range():
    model = MLP()
    autopar.shard("layers.0", weight={"tp": Shard(2)})
    with pytest.raises(autopar.PlanError, match=r"Shard\(2\) is out of range for a tensor of shape \[64, 32\]"):
        _plan(model, autopar.Mesh(2, axis_names=("tp",)), mode="semi_auto")


def test_semi_auto_dim_not_divisible():
    model = MLP(hidden=66)
    autopar.shard("layers.0", weight={"tp": Shard(0)})
    with pytest.raises(autopar.PlanError, match=r"dimension 0 of size 66 is not divisible by the size 4 of mesh axis 'tp'"):
        _plan(model, autopar.Mesh(4, axis_names=("tp",)), mode="semi_auto")


def test_semi_auto_conflicting_annotations():
    model = MLP()
    autopar.shard(model.layers[0], weight={"tp": Shard(0)})
    autopar.shard("layers.*", weight={"tp": Shard(1)})
    with pytest.raises(ValueError, match=r"conflicting annotations for 'layers.0.weight' on axis 'tp': S\(0\) and S\(1\)"):
        _plan(model, autopar.Mesh(2, axis_names=("tp",)), mode="semi_auto")


def test_semi_auto_glob_matching_nothing():
    autopar.shard("decoder.*.wq", weight={"tp": Shard(0)})
    with pytest.raises(ValueError, match=r"shard\('decoder.\*.wq'\) matches no module"):
        _plan(MLP(), autopar.Mesh(2, axis_names=("tp",)), mode="semi_auto")


def test_partial_is_not_a_parameter_placement():
    with pytest.raises(ValueError, match="cannot be Partial"):
        autopar.shard("layers.0", weight={"tp": autopar.Partial()})


def test_unknown_context_key():
    with pytest.raises(ValueError, match="unknown auto-parallel context key 'paralel_mode'"):
        autopar.set_auto_parallel_context(paralel_mode="data")


def test_bad_grad_compression():
    with pytest.raises(ValueError, match="grad_compression must be None, 'bf16' or 'fp16'"):
        autopar.set_auto_parallel_context(grad_compression="int8")


def test_corrupt_plan_json(tmp_path):
    p = tmp_path / "plan.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match="plan JSON is not valid JSON"):
        autopar.Plan.load(p)


def test_mesh_axis_names_must_match_shape():
    with pytest.raises(ValueError, match=r"Mesh has 2 axes \(2, 2\) but 1 axis names"):
        autopar.Mesh((2, 2), axis_names=("dp",))


def test_lm_with_meta_model_plans_but_cannot_run():
    with torch.device("meta"):
        model = GPT(qkv_bias=False)
    x, y = make_batch("tokens", 8)
    plan = autopar.plan(model, autopar.Mesh(4), example_inputs=(x,), loss_fn=lm_loss, example_target=y, mode="data")
    assert plan.degrees["dp"] == 4


def test_plan_whose_local_implementations_miss_a_mesh_axis():
    """A decision lists one local implementation per mesh axis; a shorter list (a plan edited by
    hand, or lifted to a pipeline mesh without them) would bind its collectives to the wrong axis."""
    from autopar.passes.insert_collectives import insert_collectives
    from autopar.frontend.trace import trace

    x, y = make_batch("tokens", 8)
    torch.manual_seed(0)
    model = GPT(qkv_bias=False)
    autopar.shard("wte", weight={"tp": Shard(0)})
    plan = autopar.plan(model, autopar.Mesh(2, axis_names=("tp",)), example_inputs=(x,), loss_fn=lm_loss,
                        example_target=y, mode="semi_auto")
    assert any(any(d.local) for d in plan.nodes.values())
    traced = trace(model, (x,), lm_loss, y)
    with pytest.raises(ValueError, match=r"names local implementations for 1 mesh axes, the mesh has 2 .*make a new"):
        insert_collectives(traced.gm, plan, ("pp", "tp"), (1, 2), set(traced.params))
