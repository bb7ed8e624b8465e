"""Bad arguments (meshes, inputs at step, losses, stage tags, leftover annotations, plan files) get one clear error
naming the argument at fault, what it got and what to do: the cases one process shows (the ones on ranks are in
tests/ranks/test_bad_inputs.py)."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import autopar
from examples.models import GPT, MLP, lm_loss
from oracle import make_batch


@pytest.mark.parametrize("shape, error, text", [
    (2.5, TypeError, r"Mesh\(2.5\): size 2.5 is a float, not a whole number of devices; .*e.g. Mesh\(4\)"),
    ("4", TypeError, r"Mesh\('4'\): size '4' is a str"),
    (True, TypeError, r"size True is a bool"),
    (0, ValueError, r"Mesh\(0\): size 0 has no devices; every axis needs at least 1 device"),
    (-2, ValueError, r"size -2 has no devices"),
    ((2, 0), ValueError, r"Mesh\(\(2, 0\)\): axis 1 size 0 has no devices"),
    ((), ValueError, r"the shape names no axis"),
])
def test_bad_mesh_shape(shape, error, text):
    with pytest.raises(error, match=text):
        autopar.Mesh(shape)


def test_bad_mesh_options():
    with pytest.raises(ValueError, match=r"Mesh\(memory_gb=0\): the per-device memory cap must be a number of GiB > 0"):
        autopar.Mesh(2, memory_gb=0)
    with pytest.raises(ValueError, match=r"Mesh\(gpus_per_node=0\): must be a whole number >= 1"):
        autopar.Mesh(2, gpus_per_node=0)
    with pytest.raises(TypeError, match=r"Mesh\(axis_names='dp'\): give a tuple of names.*axis_names=\('dp',\)"):
        autopar.Mesh(2, axis_names="dp")


def test_step_names_an_input_or_target_of_another_dtype():
    x, y = make_batch("tokens", 8)
    pm = autopar.parallelize(GPT(qkv_bias=False, layers=1, hidden=32), autopar.Mesh(1), example_inputs=(x,),
                             loss_fn=lm_loss, example_target=y, mode="data")
    with pytest.raises(TypeError, match=r"input 0 has dtype torch.float32 but the model was planned with an example "
                                        r"of dtype torch.int64 \(shape \[8, 16\]\); pass a torch.int64 tensor"):
        pm.step(x.float(), target=y)
    with pytest.raises(TypeError, match=r"target has dtype torch.float32 but .* dtype torch.int64"):
        pm.step(x, target=y.float())
    with pytest.raises(TypeError, match=r"input 0 has dtype torch.int32"):
        pm(x.int())
    with pytest.raises(ValueError, match=r"input 0 has shape \[4, 16\] but the model was planned for the global shape "
                                         r"\[8, 16\]"):
        pm.step(x[:4], target=y[:4])
    assert torch.isfinite(pm.step(x, target=y))


@pytest.mark.parametrize("loss_fn, text", [
    (lambda o, t: F.cross_entropy(o, t, reduction="none"),
     r"loss_fn returned a tensor of shape \[8\], not a scalar: .*Reduce it in loss_fn with .mean\(\) or .sum\(\), "
     r"e.g. reduction='mean' instead of reduction='none'"),
    (lambda o, t: (F.cross_entropy(o, t), o.sum()), r"loss_fn returned a tuple of 2 values, not one scalar tensor"),
])
def test_loss_that_is_not_one_scalar_is_refused_at_plan_time(loss_fn, text):
    x, y = make_batch("vector", 8)
    with pytest.raises(ValueError, match=text):
        autopar.plan(MLP(), autopar.Mesh(2), example_inputs=(x,), loss_fn=loss_fn, example_target=y, mode="data")


RULE = (r"Rule: pipeline_stage\(layer, k\) starts stage k at a whole layer of the model "
        r"\(blocks.0, blocks.1, blocks.2, blocks.3\); stage numbers increase along the layers")


@pytest.mark.parametrize("tags, text", [
    ([("blocks.1", 2), ("blocks.3", 1)],
     r"pipeline_stage tags out of order: 'blocks.1' starts stage 2 but 'blocks.3', later in the model, is tagged "
     r"stage 1"),
    ([("blocks.0", 1)], r"pipeline_stage\('blocks.0', 1\): 'blocks.0' is the first layer, which always starts stage 0"),
    ([("blocks.2.fc2", 1)], r"'blocks.2.fc2' is inside layer 'blocks.2'; tag the whole layer, e.g. "
                            r"pipeline_stage\('blocks.2', 1\)"),
    ([("wte", 1)], r"'wte' is not a layer \(its ops run in layer 'blocks.0'\)"),
    ([("blocks.1", 1), ("blocks.2", 1)], r"'blocks.1' and 'blocks.2' both start stage 1"),
    ([("blocks.1", 3)], r"leave 3 stage\(s\) \(0 to 2\) for the 1 layer\(s\) from the first layer before 'blocks.1'"),
])
def test_bad_stage_tags_get_one_message_with_the_rule(tags, text):
    x, y = make_batch("tokens", 8)
    for module, k in tags:
        autopar.pipeline_stage(module, k)
    with pytest.raises(autopar.PlanError) as err:
        autopar.plan(GPT(qkv_bias=False, layers=4, hidden=32), autopar.Mesh(max(k for _, k in tags) + 1),
                     example_inputs=(x,), loss_fn=lm_loss, example_target=y, mode="semi_auto")
    msg = str(err.value)
    assert re.search(text, msg), msg
    assert re.search(RULE, msg) and msg.count("Rule:") == 1 and "fixed boundaries" not in msg, msg


def _semi_auto_plan(model, mesh):
    x, y = make_batch("vector" if isinstance(model, MLP) else "tokens", 8)
    loss = F.cross_entropy if isinstance(model, MLP) else lm_loss
    return autopar.plan(model, mesh, example_inputs=(x,), loss_fn=loss, example_target=y, mode="semi_auto")


def test_annotations_of_an_earlier_model_point_to_clear_annotations():
    old = GPT(qkv_bias=False, layers=2, hidden=32)
    autopar.shard(old.wte, weight={"tp": autopar.Shard(0)})
    with pytest.raises(ValueError, match=r"shard\(\) was given a module object \(Embedding\) that is not part of the "
                                         r"model being planned. .*call autopar.clear_annotations\(\)"):
        _semi_auto_plan(GPT(qkv_bias=False, layers=2, hidden=32), autopar.Mesh(2, axis_names=("tp",)))
    autopar.clear_annotations()
    autopar.pipeline_stage(old.blocks[1], 1)
    with pytest.raises(ValueError, match=r"pipeline_stage\(\) was given a module object \(Block\) .*"
                                         r"autopar.clear_annotations\(\)"):
        _semi_auto_plan(GPT(qkv_bias=False, layers=2, hidden=32), autopar.Mesh(2))
    autopar.clear_annotations()
    autopar.shard("layers.*", weight={"mp": autopar.Shard(0)})
    with pytest.raises(autopar.PlanError, match=r"unknown mesh axis 'mp'.*autopar.clear_annotations\(\)"):
        _semi_auto_plan(MLP(), autopar.Mesh(2, axis_names=("tp",)))


def test_data_mode_warns_that_it_ignores_annotations():
    x, y = make_batch("vector", 8)
    autopar.shard("layers.0", weight={"tp": autopar.Shard(0)})
    autopar.pipeline_stage("layers.1", 1)
    with pytest.warns(UserWarning, match=r"DATA mode ignores the annotations that are set \(shard\('layers.0'\), "
                                         r"pipeline_stage\('layers.1', 1\)\).*autopar.clear_annotations\(\)"):
        plan = autopar.plan(MLP(), autopar.Mesh(2), example_inputs=(x,), loss_fn=F.cross_entropy, example_target=y,
                            mode="data")
    assert plan.degrees["dp"] == 2


@pytest.mark.parametrize("mode, axes, tag, candidate", [
    ("data", None, False, "mesh (2,), no memory options"),
    ("semi_auto", None, False, "mesh (2,), "),
    ("auto", None, False, "mesh (2"),
    ("semi_auto", ("pp",), False, "mesh (2, 1), pp=2 sub-mesh {'tp': 1}"),          # a named pipeline axis
    ("semi_auto", None, True, "mesh (2, 1), pp=2 sub-mesh {'tp': 1}"),              # stage tags
])
def test_nothing_fits_gives_the_breakdown_on_every_path(mode, axes, tag, candidate):
    x, y = make_batch("tokens", 32)
    model = GPT(qkv_bias=False, layers=4, hidden=32)
    if tag:
        autopar.pipeline_stage(model.blocks[2], 1)
    with pytest.raises(autopar.PlanError) as err:
        autopar.plan(model, autopar.Mesh(2, axis_names=axes, memory_gb=300 / 2**20), example_inputs=(x,),
                     loss_fn=lm_loss, example_target=y, mode=mode)
    msg = str(err.value)
    assert f"the smallest candidate ({candidate}" in msg, msg
    assert re.search(r"needs [\d.]+ [KM]iB per device \(parameters [\d.]+ KiB, gradients [\d.]+ KiB, optimizer "
                     r"state [\d.]+ KiB, activations [\d.]+ [KM]iB.*\) but the cap is 300 KiB. (About \d+ devices "
                     r"would fit|One row of the batch per device already needs [\d.]+ KiB of activations: split "
                     r"the layers)", msg), msg


def test_arguments_of_the_wrong_kind_name_what_they_got():
    x, y = make_batch("vector", 8)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        autopar.parallelize("mlp", autopar.Mesh(1), example_inputs=(x,), loss_fn=F.cross_entropy, example_target=y)
    with pytest.raises(TypeError, match=r"mesh must be an autopar.Mesh \(or a device count\), got tuple \(2, 2\); "
                                        r"e.g. autopar.Mesh\(4\)"):
        autopar.plan(MLP(), (2, 2), example_inputs=(x,))
    with pytest.raises(TypeError, match="loss_fn must be a function .*; got a str"):
        autopar.plan(MLP(), autopar.Mesh(2), example_inputs=(x,), loss_fn="cross_entropy", example_target=y)
    with pytest.raises(TypeError, match=r"shard_input\(index, placements\): index is the position of the example "
                                        r"input \(0, 1, ...\), got 'x'"):
        autopar.shard_input("x", {"dp": autopar.Shard(0)})
    with pytest.raises(ValueError, match="microbatches must be None or a positive int, got -2"):
        autopar.set_auto_parallel_context(microbatches=-2)
    with pytest.raises(ValueError, match="memory_budget_gb must be a number > 0 or None, got 0"):
        autopar.set_auto_parallel_context(memory_budget_gb=0)


def test_a_loss_that_fails_on_the_target_is_reported_as_the_loss():
    x, y = make_batch("vector", 8)
    text = (r"(?s)could not trace loss_fn\(model output, example_target\): ValueError: Expected input batch_size "
            r"\(8\) to match target batch_size \(4\).*example_target has shape \[4\], dtype torch.int64")
    with pytest.raises(autopar.TraceError, match=text):
        autopar.plan(MLP(), autopar.Mesh(2), example_inputs=(x,), loss_fn=F.cross_entropy, example_target=y[:4])


@pytest.mark.parametrize("text, error, message", [
    ("", ValueError, r"plan JSON is empty"),
    ("[1, 2]", ValueError, r"plan JSON holds a list, not a plan"),
    ('{"format_version": 2}', ValueError, r"plan JSON is not a complete autopar plan \(KeyError: 'mode'\)"),
    ('{"name": "gpt2", "n_layer": 2}', ValueError, r"a JSON object without 'format_version' \(its keys: 'name', "
                                                   r"'n_layer'\); pass a plan JSON written by Plan.save"),
])
def test_plan_load_of_a_bad_file_names_the_file(tmp_path, text, error, message):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(error, match=rf"{re.escape(str(path))} is not an autopar plan: {message}"):
        autopar.Plan.load(path)
    with pytest.raises(IsADirectoryError, match=r"is a folder, not a plan file"):
        autopar.Plan.load(tmp_path)
