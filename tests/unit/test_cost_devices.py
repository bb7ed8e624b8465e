import dataclasses
import json

import pytest
import torch

from autopar.cost_models import calibrate as cal
from autopar.cost_models import profile as prof
from autopar.cost_models.devices import (
    DeviceSpec,
    Link,
    axis_link,
    axis_nodes,
    get_device,
    preset_names,
)

GPU_PRESETS = ["v100-16gb", "a100-40gb", "a100-80gb", "h100", "h100-sxm", "h200"]


@pytest.fixture
def no_profile(tmp_path, monkeypatch):
    path = tmp_path / "none.json"
    monkeypatch.setenv("AUTOPAR_PROFILE", str(path))
    return path


def _profile(**machine):
    fp = prof.fingerprint()
    fp.update(machine)
    return {
        "machine": fp,
        "peak_flops": {"fp32": 3e10, "bf16": 6e10},
        "memory_bandwidth": 7e9,
        "kernel_overhead": 2e-6,
        "link": {"bandwidth": 8e8, "latency": 4e-4},
    }


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_gpu_presets(name):
    dev = get_device(name)
    assert isinstance(dev, DeviceSpec)
    assert set(dev.peak_flops) >= {"fp32", "tf32", "bf16", "fp16"}
    assert dev.devices_per_node == 8
    assert dev.intra_node_link.bandwidth > dev.inter_node_link.bandwidth
    assert 0 < dev.compute_efficiency <= 1 and dev.kernel_overhead > 0


def test_datasheet_numbers():
    a100 = get_device("a100-80gb")
    assert a100.flops_per_s(torch.bfloat16) == 312e12
    assert a100.flops_per_s(torch.float32) == 19.5e12
    assert a100.intra_node_link.bandwidth == 300e9  # 600 GB/s NVLink, both directions
    assert a100.inter_node_link.bandwidth == 25e9  # 200 Gbit/s per GPU
    assert a100.memory_bytes == 80 * 2**30
    assert get_device("h100-sxm") == get_device("h100")
    assert get_device("H200").memory_bytes == 141 * 2**30
    v100 = get_device("v100-16gb")
    assert v100.flops_per_s(torch.float16) == 125e12
    assert v100.inter_node_link.bandwidth == pytest.approx(25e9 / 8 / 8)  # 25 Gbit/s shared by 8


def test_tf32_and_other_dtypes():
    a100 = get_device("a100-40gb")
    tf32 = DeviceSpec(**{**a100.__dict__, "allow_tf32": True})
    assert tf32.flops_per_s(torch.float32) == 156e12
    assert a100.flops_per_s(torch.float64) == pytest.approx(19.5e12 / 2)
    assert a100.flops_per_s(torch.int64) == 19.5e12


def test_overrides_and_frozen():
    dev = get_device("a100-80gb", memory_gb=0.5, gpus_per_node=4)
    assert dev.memory_bytes == 2**29 and dev.devices_per_node == 4
    assert dev.with_memory(123).memory_bytes == 123
    with pytest.raises(Exception):
        dev.memory_bytes = 1
    with pytest.raises(ValueError):
        get_device("h100", memory_gb=0)


def test_unknown_device_lists_presets():
    with pytest.raises(ValueError) as err:
        get_device("tpu-v9")
    assert "tpu-v9" in str(err.value)
    for name in preset_names():
        assert name in str(err.value)
    assert set(GPU_PRESETS + ["cpu"]) <= set(preset_names())


def test_link_for_and_axis_link():
    dev = get_device("h100")
    assert dev.link_for(False) is dev.intra_node_link
    assert dev.link_for(True) is dev.inter_node_link
    assert axis_link(dev, 8, 1) == dev.intra_node_link  # tp=8 inside a node
    assert axis_link(dev, 2, 4) == dev.intra_node_link  # 2 x stride 4 = 8 devices
    assert axis_link(dev, 2, 8) == dev.inter_node_link  # dp over nodes
    assert axis_link(dev, 4, 4) == dev.inter_node_link  # 16 devices span 2 nodes
    assert axis_nodes(dev, 64, 8) == 64 and axis_nodes(dev, 1, 1) == 1
    assert Link(1e9, 1e-5).time(1e9) == pytest.approx(1.00001)


def test_ranks_sharing_cores_run_slower(no_profile):
    """Without measurements: k/cores once ranks outnumber cores."""
    dev = dataclasses.replace(get_device("cpu"), cores=2, sharing=(), shared_links=())
    assert dev.shared_by(2) is dev
    four = dev.shared_by(4)
    assert four.peak_flops["fp32"] == dev.peak_flops["fp32"] / 2
    assert four.memory_bandwidth == dev.memory_bandwidth / 2
    assert four.kernel_overhead == dev.kernel_overhead * 2
    assert four.optimizer_tensor_overhead == dev.optimizer_tensor_overhead * 2
    assert get_device("a100-80gb").shared_by(64) == get_device("a100-80gb")


def test_measured_sharing_is_used_interpolated_and_extrapolated(no_profile):
    dev = dataclasses.replace(get_device("cpu"), cores=2, sharing=((2, 1.1, 1.2, 1.5), (4, 2.5, 3.0, 3.5)))
    two = dev.shared_by(2)
    assert two.peak_flops["fp32"] == pytest.approx(dev.peak_flops["fp32"] / 1.1)
    assert two.memory_bandwidth == pytest.approx(dev.memory_bandwidth / 1.2)
    assert two.kernel_overhead == pytest.approx(dev.kernel_overhead * 1.5)
    assert dev.slowdown(3) == pytest.approx((1.8, 2.1, 2.5))
    assert dev.slowdown(8) == pytest.approx((5.0, 6.0, 7.0))
    assert dev.slowdown(1) == (1.0, 1.0, 1.0) and dev.shared_by(1) is dev


def test_ranks_sharing_a_node_use_the_link_measured_with_that_many(no_profile):
    """4 gloo ranks on 2 cores wait for the scheduler at every ring hop: their link is the one
    measured with 4 processes, not the 2-process one."""
    dev = dataclasses.replace(get_device("cpu"), cores=2, sharing=(),
                              shared_links=((2, 2e-4, 1e9), (4, 1e-3, 2e9)))
    assert dev.shared_by(2).intra_node_link == Link(1e9, 2e-4)
    assert dev.shared_by(4).intra_node_link == Link(2e9, 1e-3) == dev.shared_by(4).inter_node_link
    three = dev.shared_link(3)
    assert three.latency == pytest.approx(6e-4) and three.bandwidth == pytest.approx(1.5e9)
    assert dev.shared_link(8).latency == pytest.approx(2e-3)
    assert dev.shared_link(1) is None and dev.shared_by(1) is dev
    assert dataclasses.replace(dev, shared_links=()).shared_link(4) is None


def test_matmul_efficiency_curve_is_log_interpolated():
    dev = dataclasses.replace(get_device("a100-80gb"), matmul_efficiency=((16, 0.2), (256, 0.8)))
    assert dev.matmul_eff(4) == 0.2 and dev.matmul_eff(4096) == 0.8
    assert dev.matmul_eff(64) == pytest.approx(0.5)
    assert get_device("a100-80gb").matmul_eff(8) == get_device("a100-80gb").compute_efficiency


def test_cpu_without_profile_uses_defaults(no_profile):
    dev = get_device("cpu")
    assert dev.name == "cpu" and dev.peak_flops["fp32"] > 0 and "calibrate" in dev.notes
    assert get_device("cpu", memory_gb=0.5).memory_bytes == 2**29


def test_cpu_from_profile(no_profile):
    no_profile.write_text(json.dumps(_profile()))
    dev = get_device("cpu")
    assert dev.peak_flops["fp32"] == 3e10 and dev.flops_per_s(torch.bfloat16) == 6e10
    assert dev.memory_bandwidth == 7e9 and dev.kernel_overhead == 2e-6
    assert dev.intra_node_link == Link(8e8, 4e-4) and dev.compute_efficiency == 1.0


def test_corrupt_profile_is_a_clear_error(no_profile):
    no_profile.write_text("{not json")
    with pytest.raises(ValueError) as err:
        get_device("cpu")
    assert str(no_profile) in str(err.value)
    assert "corrupt" in str(err.value) and "autopar calibrate" in str(err.value)
    no_profile.write_text(json.dumps({"machine": {}}))
    with pytest.raises(ValueError, match="incomplete.*autopar calibrate"):
        prof.load_profile()


@pytest.mark.parametrize("field,value", [("cpu_model", "Some Other CPU 9000"), ("nproc", 1024)])
def test_profile_from_another_machine(no_profile, field, value):
    no_profile.write_text(json.dumps(_profile(**{field: value})))
    with pytest.raises(ValueError) as err:
        get_device("cpu")
    msg = str(err.value)
    assert str(no_profile) in msg and "another machine" in msg and "autopar calibrate" in msg
    assert str(value) in msg


def test_fit_alpha_beta_recovers_the_line():
    alpha, beta = 3e-5, 1 / 2e9
    rows = [[p, n, 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta] for p in (2, 4) for n in (1e3, 1e5, 1e7)]
    a, b = cal.fit_alpha_beta(rows)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)


def test_optimizer_step_time_is_bytes_plus_a_cost_per_tensor(no_profile):
    from autopar.cost_models.param_step import optimizer_step_time

    dev = get_device("cpu")
    bytes_part = 1e6 * dev.optimizer_bytes_per_param / dev.memory_bandwidth
    assert optimizer_step_time(1e6, dev, 10) == pytest.approx(bytes_part + 10 * dev.optimizer_tensor_overhead)
    assert optimizer_step_time(1e6, dev, 10, "sgd") == pytest.approx(bytes_part / 3 + 10 * dev.optimizer_tensor_overhead)
    gpu = get_device("a100-80gb")           # no per-tensor figure: 12 kernel launches
    assert optimizer_step_time(0, gpu, 10) == 0.0
    assert optimizer_step_time(1, gpu, 10) == pytest.approx(gpu.optimizer_bytes_per_param / (
        gpu.memory_bandwidth * gpu.memory_efficiency) + 120 * gpu.kernel_overhead)
