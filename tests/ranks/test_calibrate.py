"""``autopar calibrate`` end to end on a tiny budget: it spawns ranks to time collectives and shared
cores, so it lives in the multi-process tier (the rest of the calibration math: tests/unit/test_cost_devices.py)."""
import pytest

from autopar.cost_models import calibrate as cal
from autopar.cost_models.devices import Link, get_device


@pytest.fixture
def no_profile(tmp_path, monkeypatch):
    path = tmp_path / "none.json"
    monkeypatch.setenv("AUTOPAR_PROFILE", str(path))
    return path


def test_calibrate_tiny_end_to_end(no_profile):
    profile = cal.calibrate(
        matmul_sizes=(32, 64),
        matmul_dims=(8, 32, 64),
        sharing_seconds=0.1,
        copy_bytes=1 << 16,
        collective_sizes=(1 << 10, 1 << 16),
        world_sizes=(2,),
        reps=2,
        compiled=False,     # inductor's first compile takes seconds: tests/ranks/test_compile.py measures it (slow)
    )
    assert profile["path"] == str(no_profile) and no_profile.exists()
    assert len(profile["collectives"]["all_reduce"]) == 2
    assert profile["link"]["bandwidth"] > 0 and profile["link"]["latency"] > 0
    dev = get_device("cpu")
    assert dev.peak_flops["fp32"] == pytest.approx(profile["peak_flops"]["fp32"])
    assert "calibrated" in dev.notes
    assert "GFLOP/s" in cal.summary(profile)
    assert [d for d, _ in profile["matmul_efficiency"]] == [8, 32, 64] and dev.matmul_efficiency[0][0] == 8
    assert 0 < profile["attention_efficiency"] <= 1 and dev.attention_efficiency == profile["attention_efficiency"]
    (k, *slowdowns), = profile["sharing"]
    assert k == 2 and all(f >= 1 for f in slowdowns) and dev.sharing[0][0] == 2
    (k, latency, bandwidth), = profile["shared_links"]
    assert k == 2 and latency > 0 and bandwidth > 0 and dev.shared_link(2) == Link(bandwidth, latency)
