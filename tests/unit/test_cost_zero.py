"""ZeRO cost terms (cost_models/zero.py): memory per stage, collectives and volume, times, optimizer step."""
import pytest

from autopar.cost_models.comm import axis_collective_time
from autopar.cost_models.devices import get_device
from autopar.cost_models.zero import (optimizer_step_time, shard_elements, zero3_gathered_bytes, zero_collectives,
                                      zero_comm_time, zero_comm_volume, zero_memory)

N = 1_000_000


def test_memory_per_stage_follows_the_zero_paper():
    d = 4
    m = [zero_memory(N, d, s) for s in range(4)]
    assert (m[0].weights, m[0].grads, m[0].optimizer) == (4 * N, 4 * N, 8 * N)
    assert (m[1].weights, m[1].grads, m[1].optimizer) == (4 * N, 4 * N, 2 * N)
    assert (m[2].weights, m[2].grads, m[2].optimizer) == (4 * N, N, 2 * N)
    assert (m[3].weights, m[3].grads, m[3].optimizer) == (N, N, 2 * N)
    assert m[0].total == 16 * N and m[3].total == 4 * N
    # mixed precision (bf16 weights and grads, fp32 master + 2 moments = 12 B): the paper's 16Ψ → 16Ψ/d at stage 3
    assert zero_memory(N, 8, 3, 2, 2, 12).total == 16 * N / 8
    assert zero_memory(N, 1, 3).total == 16 * N          # one rank: nothing to share


def test_chunks_are_padded_to_equal_size():
    assert shard_elements(10, 4) == 3 and shard_elements(0, 4) == 0
    assert zero_memory(10, 4, 1).optimizer == 3 * 8


def test_collectives_and_volume_per_stage():
    d, b = 4, 4 * N
    assert zero_collectives(N, d, 0) == [("all_reduce", b, "bwd")]
    assert zero_collectives(N, d, 1) == zero_collectives(N, d, 2) == [("reduce_scatter", b, "bwd"),
                                                                      ("all_gather", b, "step")]
    assert sorted(k for k, _, _ in zero_collectives(N, d, 3)) == ["all_gather", "all_gather", "reduce_scatter"]
    assert zero_collectives(N, 1, 2) == []
    ddp = zero_comm_volume(N, d, 0)
    assert ddp == pytest.approx(2 * 3 / 4 * b)
    assert zero_comm_volume(N, d, 1) == pytest.approx(ddp) == pytest.approx(zero_comm_volume(N, d, 2))
    assert zero_comm_volume(N, d, 3) == pytest.approx(1.5 * ddp)


def test_comm_time_uses_the_collective_model():
    dev = get_device("a100-80gb")
    rs = axis_collective_time("reduce_scatter", 4 * N, dev, 8)
    ag = axis_collective_time("all_gather", 4 * N, dev, 8)
    assert zero_comm_time(N, 8, 0, dev) == pytest.approx(axis_collective_time("all_reduce", 4 * N, dev, 8))
    assert zero_comm_time(N, 8, 2, dev) == pytest.approx(rs + ag)
    assert zero_comm_time(N, 8, 3, dev) == pytest.approx(rs + 2 * ag)
    # bandwidth term of a ring all-reduce = reduce-scatter + all-gather: stage 1/2 within latency of DDP
    assert zero_comm_time(N, 8, 1, dev) == pytest.approx(zero_comm_time(N, 8, 0, dev), rel=1e-3)
    assert zero_comm_time(N, 1, 3, dev) == 0.0


def test_optimizer_step_time_divides_by_d_and_gathered_layers():
    assert optimizer_step_time(8.0, 4, 0) == 8.0
    assert optimizer_step_time(8.0, 4, 1) == optimizer_step_time(8.0, 4, 3) == 2.0
    assert zero3_gathered_bytes(100) == 800 and zero3_gathered_bytes(100, 2, prefetch=False) == 200


@pytest.mark.parametrize("bad", [(-1, 2), (4, 2), (1, 0)])
def test_bad_stage_or_size_is_an_error(bad):
    stage, d = bad
    with pytest.raises(ValueError):
        zero_memory(N, d, stage)
