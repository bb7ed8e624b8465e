"""autopar.launch, plain torchrun (env://), and failures that name the rank instead of hanging."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

import autopar
from autopar.cost_models.calibrate import free_port


def _write_rank(rank, folder):
    with open(os.path.join(folder, f"rank{rank}"), "w") as f:
        f.write(f"{dist.get_rank()} {dist.get_world_size()}")


def test_launch_runs_every_rank_with_a_process_group(tmp_path):
    autopar.launch(_write_rank, nprocs=2, args=(str(tmp_path),))
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["0 2", "1 2"]


def _fail_on_rank_one(rank):
    if rank == 1:
        raise ValueError("boom on purpose")


def test_launch_raises_with_the_failing_ranks_traceback():
    with pytest.raises(autopar.RankError, match=r"(?s)boom on purpose"):
        autopar.launch(_fail_on_rank_one, nprocs=2, timeout_s=20)


def test_torchrun_env_init_trains(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import sys, torch, torch.nn.functional as F
        sys.path.insert(0, {os.getcwd()!r})
        import autopar
        from examples.models import MLP
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
        torch.manual_seed(0)
        pmodel = autopar.parallelize(MLP(), autopar.Mesh(2), example_inputs=(x,), loss_fn=F.cross_entropy,
                                     example_target=y, mode="data")
        loss = pmodel.step(x, target=y)
        torch.manual_seed(0)
        ref = F.cross_entropy(MLP()(x), y)
        assert abs(loss.item() - ref.item()) < 1e-5 * ref.item(), (loss, ref)
        print("RANK_OK", torch.distributed.get_rank())
    """))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), str(script)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("RANK_OK") == 2
