"""Sharded checkpoints (torch.distributed.checkpoint) reshard: saved under one plan and world size,
loaded under another, the full model and optimizer state are bit-identical and training goes on
as it would have; bad inputs give clear errors; a failed save leaves the previous checkpoint."""
from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import autopar
from autopar import Shard
from conftest import run_ranks
from examples.models import GPT, lm_loss
from oracle import make_batch, rel_error

MODEL = functools.partial(GPT, vocab=65, hidden=32, heads=4, layers=2, seq=8, qkv_bias=False)
BATCH, LR = 64, 1e-2


def _megatron():
    autopar.shard({"blocks.*.fc1": ColwiseParallel(), "blocks.*.proj": RowwiseParallel(),
                   "blocks.*.fc2": RowwiseParallel()}, axis="tp")
    autopar.shard("blocks.*.qkv", weight={"tp": Shard(0, 3)})     # q, k, v each split by heads


PLANS = {   # name: (ranks, mesh shape, axis names, mode, annotate, zero, pipeline schedule)
    "data4": (4, (4,), None, "data", None, 0, None),
    "data2": (2, (2,), None, "data", None, 0, None),
    "auto2": (2, (2,), None, "auto", None, 0, None),
    "auto4": (4, (4,), None, "auto", None, 0, None),
    "tp4": (4, (4,), ("tp",), "semi_auto", _megatron, 0, None),
    "tp2": (2, (2,), ("tp",), "semi_auto", _megatron, 0, None),
    "dp2tp2": (4, (2, 2), ("dp", "tp"), "semi_auto", _megatron, 0, None),
    "zero3": (2, (2,), None, "data", None, 3, None),
    "zero1_dp2tp2": (4, (2, 2), ("dp", "tp"), "semi_auto", _megatron, 1, None),
    "zero2_4": (4, (4,), None, "data", None, 2, None),
    "pp2": (2, (2,), ("pp",), "auto", None, 0, "1f1b"),
    "pp2tp2": (4, (2, 2), ("pp", "tp"), "semi_auto", _megatron, 0, "gpipe"),
    "3d": (8, (2, 2, 2), ("pp", "dp", "tp"), "semi_auto", _megatron, 0, "1f1b"),
}
PAIRS = [("data4", "auto2"), ("tp4", "data2"), ("auto4", "dp2tp2"), ("data2", "tp4"), ("zero3", "tp2"),
         ("pp2", "data2"), ("zero1_dp2tp2", "zero3"), ("pp2tp2", "zero2_4"),
         ("3d", "tp2")]


@functools.lru_cache(maxsize=None)
def _plan_json(name: str) -> str:
    _, shape, names, mode, annotate, zero, schedule = PLANS[name]
    x, y = make_batch("tokens", BATCH, vocab=65, seq=8)
    autopar.clear_annotations()
    if schedule:
        autopar.set_auto_parallel_context(schedule=schedule, microbatches=2)
    if annotate:
        annotate()
    torch.manual_seed(0)
    plan = autopar.plan(MODEL(), autopar.Mesh(shape, axis_names=names, device="cpu"), example_inputs=(x,),
                        loss_fn=lm_loss, example_target=y, mode=mode)
    autopar.clear_annotations()
    autopar.reset_auto_parallel_context()
    if zero:
        plan = dataclasses.replace(plan, memory_options=dataclasses.replace(plan.memory_options, zero=zero))
    return plan.to_json()


def _build(plan_json: str, seed: int = 0, model=MODEL):
    x, y = make_batch("tokens", BATCH, vocab=65, seq=8)
    plan = autopar.Plan.from_json(plan_json)
    torch.manual_seed(seed)
    pm = autopar.parallelize(model(), plan.mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, plan=plan)
    return pm, torch.optim.AdamW(pm.parameters(), lr=LR), (x, y)


def _train(pm, opt, batch, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        losses.append(float(pm.step(batch[0], target=batch[1])))
        opt.step()
        opt.zero_grad()
    return losses


def _save_job(rank, plans: dict, root: str):
    """Per plan: 2 steps, save, 2 more steps (the run the round trip is compared with)."""
    out = {}
    for name, js in plans.items():
        pm, opt, batch = _build(js)
        _train(pm, opt, batch, 2)
        saved = pm.full_state_dict()
        pm.save(f"{root}/{name}", optimizer=opt)
        rand = torch.rand(4)                # the RNG stream right after the save
        out[name] = {"saved": saved, "rand": rand, "losses": _train(pm, opt, batch, 2), "end": pm.full_state_dict()}
    return out


def _load_job(rank, src: str, dst: str, plan_json: str, root: str):
    pm, opt, batch = _build(plan_json, seed=rank + 1)   # other initial values: all must come from the checkpoint
    step = pm.load(f"{root}/{src}", optimizer=opt)
    rand = torch.rand(4)
    pm.save(f"{root}/{src}-{dst}", optimizer=opt)
    return {"step": step, "rand": rand, "losses": _train(pm, opt, batch, 2), "end": pm.full_state_dict(),
            "degrees": pm.plan.degrees}


def _read(path) -> dict:
    """The whole checkpoint on one process (DCP's own converter): every tensor in full."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = f"{path}.pt"
    dcp_to_torch_save(str(path), out)
    return torch.load(out, weights_only=False)


class _Saved:
    """The source runs of PAIRS, saved on first use: every source plan of one world size in one job."""

    def __init__(self, root):
        self.root, self._runs = root, {}

    def __getitem__(self, name: str) -> dict:
        if name not in self._runs:
            n = PLANS[name][0]
            mine = {a: _plan_json(a) for a in sorted({a for a, _ in PAIRS}) if PLANS[a][0] == n}
            per_rank = run_ranks(n, _save_job, mine, str(self.root))
            for a in mine:
                self._runs[a] = {**per_rank[0][a], "rands": [r[a]["rand"] for r in per_rank]}
        return self._runs[name]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return _Saved(tmp_path_factory.mktemp("ckpt"))


@pytest.mark.parametrize("src,dst", [pytest.param(a, b, marks=pytest.mark.slow) if PLANS[a][0] == 8 else (a, b)
                                     for a, b in PAIRS], ids=[f"{a}->{b}" for a, b in PAIRS])
def test_checkpoint_reshards_with_optimizer_state(saved, src, dst):
    a, root = saved[src], saved.root
    got = run_ranks(PLANS[dst][0], _load_job, src, dst, _plan_json(dst), str(root))
    before, after = _read(root / src), _read(root / f"{src}-{dst}")
    # the checkpoint holds the full state the source run had when it saved ...
    plan = autopar.Plan.from_json(_plan_json(src))
    for name, d in plan.params.items():
        assert torch.equal(before[f"model.{name}"], a["saved"][d.aliases[0]]), name
    # ... and the target plan, having loaded it, saves it back bit for bit: model, optimizer moments, steps
    keys = sorted(k for k in before if k.startswith(("model.", "optim.")))
    assert keys == sorted(k for k in after if k.startswith(("model.", "optim.")))
    assert any(k.endswith(".exp_avg_sq") for k in keys) and any(k.endswith(".step") for k in keys)
    for k in keys:
        assert torch.equal(before[k], after[k]), k
    assert before["autopar"]["optimizer"] == after["autopar"]["optimizer"]
    # training goes on as the source run did (same data, fp32 tolerance: another plan sums in another order)
    for r, g in enumerate(got):
        assert g["step"] == 2
        assert torch.equal(g["rand"], a["rands"][r % len(a["rands"])]), "RNG state not restored"
        for x, y in zip(g["losses"], a["losses"]):
            assert abs(x - y) <= 1e-5 * abs(y), (g["losses"], a["losses"], g["degrees"])
        whole = rel_error(torch.cat([g["end"][k].flatten() for k in a["end"]]),
                          torch.cat([a["end"][k].flatten() for k in a["end"]]))
        assert whole <= 1e-5, whole
        for k, v in a["end"].items():
            assert rel_error(g["end"][k], v) <= 1e-3, k


def test_replicated_pieces_are_written_once(saved):
    """A DATA plan on 4 ranks holds 4 copies of everything, on 2 ranks 2 copies: both checkpoints hold one."""
    root = saved.root
    assert saved["data4"] and saved["data2"]         # both saved
    one = 3 * sum(p.numel() * 4 for p in MODEL().parameters())        # parameters and AdamW's 2 moments
    written = {n: sum(f.stat().st_size for f in (root / n).glob("*.distcp")) for n in ("data4", "data2")}
    assert one <= written["data4"] < 2 * one, (written, one)
    assert abs(written["data4"] - written["data2"]) < 0.05 * one, written


def _same_plan_job(rank, plan_json: str, path: str):
    """Reloading under the same plan is bit-exact: the next 2 steps too."""
    a, opt_a, batch = _build(plan_json)
    _train(a, opt_a, batch, 2)
    a.save(path, optimizer=opt_a)
    b, opt_b, _ = _build(plan_json, seed=rank + 1)
    b.load(path, optimizer=opt_b)
    la, lb = _train(a, opt_a, batch, 2), _train(b, opt_b, batch, 2)
    sa, sb = a.full_state_dict(), b.full_state_dict()
    return la == lb and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("name", ["pp2", "tp2", "data4"])
def test_same_plan_reload_trains_on_bit_identically(tmp_path, name):
    """data4: 4 ranks sum in an order that depends on where a gradient lies in DDP's bucket (2 cannot
    tell), so the reloaded module's first step must use the buckets the saving one uses by then."""
    assert all(run_ranks(PLANS[name][0], _same_plan_job, _plan_json(name), str(tmp_path / "ckpt")))


def test_pieces_and_zero_shards_map_to_the_full_tensor():
    """Every rank's boxes (sharding/boxes.py, checkpoint_state.Layout) tile the full tensor exactly,
    for chunked and 2-D specs and for ZeRO flat shards with partial rows and padding."""
    import itertools

    from autopar.runtime.held_state import Layout
    from autopar.sharding.boxes import runs
    from autopar.sharding.placements import R
    from autopar.sharding.shard_params import local_piece

    cases = [((6, 5), (Shard(0),), (3,)), ((12, 4), (Shard(0, 3), R), (2, 2)), ((8, 6), (Shard(1), Shard(0)), (3, 2)),
             ((4, 6, 2), (Shard(1, 2), Shard(0)), (3, 2)), ((7,), (R,), (2,)), ((), (R,), (2,))]
    for shape, spec, mesh in cases:
        full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        for d in (1, 3):                        # d > 1: ZeRO shards of each rank's piece
            seen = torch.zeros(shape)
            for coords in itertools.product(*map(range, mesh)):
                piece = local_piece(full, spec, coords, mesh).contiguous()
                c = math.ceil(piece.numel() / d)
                flat = torch.nn.functional.pad(piece.reshape(-1), (0, c * d - piece.numel()))
                for i in range(d):
                    lay = Layout(shape, runs(shape, spec, coords, mesh),
                                 (i * c, min((i + 1) * c, piece.numel()), tuple(piece.shape)) if d > 1 else None)
                    t = flat[i * c:(i + 1) * c] if d > 1 else piece
                    for off, view in lay.pieces(t).parts:
                        box = tuple(slice(o, o + s) for o, s in zip(off, view.shape))
                        assert torch.equal(view, full[box]), (shape, spec, coords, i)
                        seen[box] += 1
            copies = math.prod(mesh) // math.prod(mesh[a] for a, p in enumerate(spec) if isinstance(p, Shard))
            assert torch.equal(seen, torch.full(shape, float(copies))), (shape, spec, d)


# ---- bad inputs, failed saves ----------------------------------------------------------------------

def _error(fn) -> str:
    try:
        fn()
    except autopar.CheckpointError as e:
        return str(e)
    return "no error"


def _errors_job(rank, plan_json: str, root: str):
    from pathlib import Path

    from torch.distributed.checkpoint import FileSystemWriter

    out = {}
    pm, opt, batch = _build(plan_json)
    _train(pm, opt, batch, 1)
    pm.save(f"{root}/good", optimizer=opt)
    good = pm.full_state_dict()
    big = functools.partial(GPT, vocab=80, hidden=32, heads=4, layers=2, seq=8, qkv_bias=False)
    x, y = make_batch("tokens", BATCH, vocab=65, seq=8)
    other = autopar.parallelize(big(), autopar.Mesh(2), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                                mode="data")
    out["vocab"] = _error(lambda: other.load(f"{root}/good"))
    if rank == 0:
        Path(f"{root}/afile").write_text("not a directory")
        Path(f"{root}/empty").mkdir()
    torch.distributed.barrier()
    out["unwritable"] = _error(lambda: pm.save(f"{root}/afile/ckpt", optimizer=opt))
    out["missing"] = _error(lambda: pm.load(f"{root}/nothing"))
    out["empty"] = _error(lambda: pm.load(f"{root}/empty"))
    out["file"] = _error(lambda: pm.load(f"{root}/afile"))
    out["sgd"] = _error(lambda: pm.load(f"{root}/good", optimizer=torch.optim.SGD(pm.parameters(), lr=0.1)))
    decay = [p for n, p in pm.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in pm.named_parameters() if not n.endswith("weight")]
    two = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=LR)
    out["groups"] = _error(lambda: pm.load(f"{root}/good", optimizer=two))
    # a save that fails on one rank (a full disk) leaves the previous checkpoint in place
    _train(pm, opt, batch, 1)
    write = FileSystemWriter.write_data
    if rank == 1:
        def full_disk(self, plan, planner):
            raise OSError(28, "No space left on device")
        FileSystemWriter.write_data = full_disk
    try:
        out["full_disk"] = _error(lambda: pm.save(f"{root}/good", optimizer=opt))
    finally:
        FileSystemWriter.write_data = write
    fresh, fresh_opt, _ = _build(plan_json, seed=rank + 1)
    fresh.load(f"{root}/good", optimizer=fresh_opt)
    again = fresh.full_state_dict()
    out["previous_kept"] = all(torch.equal(good[k], again[k]) for k in good)
    out["left_over"] = sorted(p.name for p in Path(root).iterdir() if ".tmp-" in p.name or ".old-" in p.name)
    return out


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    results = run_ranks(2, _errors_job, _plan_json("data2"), str(tmp_path_factory.mktemp("errors")))
    for k in results[0]:
        assert results[0][k] == results[1][k] or k == "file", (k, results)     # every rank raises the same
    return results[0]


def test_checkpoint_of_a_model_with_another_vocabulary_names_the_tensor_and_both_shapes(errors):
    msg = errors["vocab"]
    assert "'wte.weight'" in msg and "[65, 32]" in msg and "[80, 32]" in msg and "checkpoint at" in msg, msg
    assert "build the model with the checkpoint's configuration" in msg, msg


def test_saving_to_an_unwritable_path_says_where_and_what_to_do(errors):
    msg = errors["unwritable"]
    assert msg.startswith("cannot write a checkpoint at ") and "afile/ckpt" in msg, msg
    assert "afile is a file, not a directory" in msg and "save it under a directory this process can write" in msg, msg


def test_loading_a_path_that_is_not_a_checkpoint(errors):
    assert "no checkpoint at" in errors["missing"] and "does not exist" in errors["missing"], errors["missing"]
    assert "is not a checkpoint: it has no .metadata file" in errors["empty"], errors["empty"]
    assert "is a file, not a checkpoint" in errors["file"], errors["file"]


def test_loading_optimizer_state_into_another_kind_or_group_layout(errors):
    msg = errors["sgd"]
    assert "torch.optim.adamw.AdamW" in msg and "torch.optim.sgd.SGD" in msg and "build the optimizer as" in msg, msg
    msg = errors["groups"]
    assert "1 param group(s)" in msg and "has 2" in msg and "param groups" in msg, msg


def test_a_failed_save_leaves_the_previous_checkpoint_loadable(errors):
    msg = errors["full_disk"]
    assert "saving the checkpoint at" in msg and "rank 1" in msg and "No space left on device" in msg, msg
    assert "previous checkpoint there, if any, is unchanged" in msg, msg
    assert errors["previous_kept"] and errors["left_over"] == [], errors


def _async_job(rank, plan_json: str, root: str):
    """Async saves copy the state before returning: training on does not change what they write."""
    pm, opt, batch = _build(plan_json)
    states, futures = [], []
    for i in range(2):          # the second waits for the first, then replaces it
        _train(pm, opt, batch, 1)
        futures.append(pm.save(f"{root}/ckpt", optimizer=opt, async_=True))
        states.append(pm.full_state_dict())
        _train(pm, opt, batch, 1)          # runs while the checkpoint is written
        if i == 0:
            futures[0].result()
            fresh, fresh_opt, _ = _build(plan_json, seed=rank + 1)
            fresh.load(f"{root}/ckpt", optimizer=fresh_opt)
            first = fresh.full_state_dict()
    paths = [f.result() for f in futures]
    fresh, fresh_opt, _ = _build(plan_json, seed=rank + 1)
    step = fresh.load(f"{root}/ckpt", optimizer=fresh_opt)
    second = fresh.full_state_dict()
    return {"paths": paths, "step": step, "first": all(torch.equal(states[0][k], first[k]) for k in first),
            "second": all(torch.equal(states[1][k], second[k]) for k in second)}


def test_async_save_writes_the_state_at_the_call(tmp_path):
    for r in run_ranks(2, _async_job, _plan_json("zero3"), str(tmp_path)):
        assert r == {"paths": [str(tmp_path / "ckpt")] * 2, "step": 3, "first": True, "second": True}, r


def _plain_files_job(rank, plan_json: str, root: str):
    """A plain state dict on disk (torch.save, safetensors) loads into a plan, each rank reading its pieces."""
    from safetensors.torch import save_file

    torch.manual_seed(5)
    want = MODEL().state_dict()
    if rank == 0:
        torch.save(want, f"{root}/model.pt")
        save_file({k: v.clone() for k, v in want.items()}, f"{root}/model.safetensors")     # untied copies
        small = functools.partial(GPT, vocab=60, hidden=32, heads=4, layers=2, seq=8, qkv_bias=False)
        torch.save(small().state_dict(), f"{root}/small.pt")
    torch.distributed.barrier()
    out = {}
    for name in ("model.pt", "model.safetensors"):
        pm, _, _ = _build(plan_json)
        pm.load_full_state_dict(f"{root}/{name}")
        got = pm.full_state_dict()
        out[name] = got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    out["small"] = _error(lambda: pm.load_full_state_dict(f"{root}/small.pt"))
    out["ckpt_dir"] = _error(lambda: pm.load(f"{root}/model.pt"))
    return out


def test_plain_state_dict_files_load_into_a_plan(tmp_path):
    for r in run_ranks(2, _plain_files_job, _plan_json("tp2"), str(tmp_path)):
        assert r["model.pt"] and r["model.safetensors"], r
        assert "'wte.weight' has shape [60, 32] in " in r["small"] and "[65, 32] in this model" in r["small"], r
        assert "pmodel.load_full_state_dict(path)" in r["ckpt_dir"], r
