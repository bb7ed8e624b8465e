"""Local implementations have one description (issue 12): every ``"family:role"`` name a sharding
rule can produce has an entry in ``sharding/local_impls.LOCAL_IMPLS`` (the plan's collective list
and its cost) and an implementation in ``collectives/local_ops.py``; and what an implementation
runs, counted per rank, is what the entry says, bytes included."""
from __future__ import annotations

import ast
import inspect
from collections import Counter
from pathlib import Path

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.collectives import comm, local_ops
from autopar.collectives.groups import axis_groups, bound_axes
from autopar.graph.grads import grad_nodes
from autopar.sharding import local_impls
from autopar.sharding.candidates import build_candidates
from autopar.sharding.local_impls import LOCAL_IMPLS, family, local_collectives
from autopar.sharding.shard_params import local_piece
from autopar.sharding.strategy import tensor_inputs
from autopar.frontend.trace import trace
from conftest import run_ranks

RULES = Path(local_impls.__file__).parent / "rules"


def rule_local_names() -> set[str]:
    """Every ``"family:role"`` string constant in the rule files (the names ``AxisStrategy.local`` takes)."""
    names = set()
    for path in sorted(RULES.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                fam, sep, role = node.value.partition(":")
                if sep and fam.isidentifier() and role.isidentifier():
                    names.add(node.value)
    return names


def test_every_local_name_a_rule_can_produce_has_an_entry_and_an_implementation():
    names = rule_local_names()
    assert {"loss:batch", "loss:vocab", "batch_norm:sync", "embedding:vocab", "mean:scale"} <= names
    for name in sorted(names):
        fam, role = name.split(":")
        assert fam in LOCAL_IMPLS, f"{name}: no entry in sharding/local_impls.LOCAL_IMPLS (its collectives)"
        assert role in LOCAL_IMPLS[fam].roles, f"{name}: LOCAL_IMPLS[{fam!r}] has no role {role!r}"
        assert fam in local_ops.IMPLS or fam in local_ops.RESCALES, f"{name}: no implementation in local_ops"
        if fam in local_ops.IMPLS:
            assert f'"{role}"' in inspect.getsource(local_ops.IMPLS[fam]), \
                f"{name}: local_ops.{local_ops.IMPLS[fam].__name__} never reads the role {role!r}"
    families = {n.split(":")[0] for n in names}
    stale = (set(LOCAL_IMPLS) | set(local_ops.IMPLS) | set(local_ops.RESCALES)) - families
    assert not stale, f"local implementations no rule produces: {sorted(stale)}"
    for fam, impl in LOCAL_IMPLS.items():
        assert {f"{fam}:{r}" for r in impl.roles} <= names, f"LOCAL_IMPLS[{fam!r}] lists roles no rule produces"


# ---- what runs is what the registry says ---------------------------------------------------------


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 8)

    def forward(self, x):
        return self.lin(x)


class Norms(nn.Module):
    """A batch norm on the raw input (its input needs no gradient) and one after a conv."""

    def __init__(self):
        super().__init__()
        self.bn0 = nn.BatchNorm2d(3)
        self.conv = nn.Conv2d(3, 4, 1)
        self.bn1 = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn1(self.conv(self.bn0(x))).mean((2, 3))


class Emb(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8, 4)

    def forward(self, ids):
        return self.emb(ids).mean(-1)


class Attn(nn.Module):
    """Causal grouped-query attention (4 query heads, 2 K/V heads): both sequence-split forms."""

    def __init__(self):
        super().__init__()
        self.q, self.kv = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 2).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 4, 2).transpose(1, 2).chunk(2, 1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return a.transpose(1, 2).reshape(b, t, 8)


def _nll(out, y):
    return F.nll_loss(F.log_softmax(out, -1), y, reduction="sum")


CASES = [(Head, "vector", F.cross_entropy), (Head, "vector", _nll), (Norms, "image", F.cross_entropy),
         (Emb, "ids", lambda out, y: F.mse_loss(out, y)), (Attn, "seq", F.mse_loss)]


def _inputs(kind):
    g = torch.Generator().manual_seed(0)
    if kind == "vector":
        return torch.randn(8, 6, generator=g), torch.randint(0, 8, (8,), generator=g)
    if kind == "image":
        return torch.randn(4, 3, 2, 2, generator=g), torch.randint(0, 4, (4,), generator=g)
    if kind == "seq":
        return torch.randn(2, 8, 8, generator=g), torch.randn(2, 8, 8, generator=g)
    return torch.randint(0, 8, (4, 4), generator=g), torch.randn(4, 4, generator=g)


def _value(node: fx.Node, need) -> torch.Tensor:
    v = node.meta["val"]
    g = torch.Generator().manual_seed(len(node.name))
    if v.is_floating_point():
        return torch.randn(v.shape, generator=g, dtype=v.dtype).requires_grad_(node in need)
    users = [u for u in node.users if tensor_inputs(u)]
    bound = min(tensor_inputs(u)[0].meta["val"].shape[-1 if u.target != torch.ops.aten.embedding.default else 0]
                for u in users) if users else 2
    return torch.randint(0, bound, v.shape, generator=g, dtype=v.dtype)


def _run_local(node: fx.Node, st, mesh, coords) -> list:
    need = grad_nodes(node.graph)
    full = {a: _value(a, need) for a in tensor_inputs(node)}
    local = {a: local_piece(t.detach(), spec, coords, mesh.shape).requires_grad_(t.requires_grad)
             for (a, t), spec in zip(full.items(), st.inputs)}
    args = fx.node.map_arg(node.args, lambda a: local.get(a, a))
    kwargs = fx.node.map_arg(node.kwargs, lambda a: local.get(a, a))
    roles: dict[str, list[str]] = {}
    for ax, loc in enumerate(st.local):
        if loc:
            roles.setdefault(loc.split(":")[1], []).append(mesh.axis_names[ax])
    fam = family(st)
    with comm.count_collectives() as counter:
        out = local_ops.IMPLS[fam](*args, **kwargs, _op=node.target.__name__.split(".")[0], _axes=roles)
        if out.requires_grad:
            out.sum().backward()
    return list(counter.calls)


def _job(rank):
    mesh = autopar.Mesh((2, 2), axis_names=("a", "b"))
    coords = mesh.coords(rank)
    seen, checked = set(), 0
    with bound_axes(axis_groups(mesh)):
        for model, kind, loss_fn in CASES:
            torch.manual_seed(0)
            x, y = _inputs(kind)
            gm = trace(model(), (x,), loss_fn, y).gm
            cands = build_candidates(gm, mesh.shape)
            for name, strategies in cands.strategies.items():
                node = next(n for n in gm.graph.nodes if n.name == name)
                for st in strategies:
                    fam = family(st)
                    if fam is None:
                        continue
                    seen.update(loc for loc in st.local if loc)
                    expect = [(k, int(b), mesh.axis_names[ax], ph) for k, b, ax, ph in
                              local_collectives(node, st, mesh.shape)]
                    if fam in local_ops.RESCALES:
                        assert expect == [], f"{name} {st.describe()}: a local rescale runs no collective"
                        continue
                    ran = _run_local(node, st, mesh, coords)
                    assert Counter(ran) == Counter(expect), \
                        f"rank {rank} {name} {st.describe()} {st.local}: ran {ran}, registry says {expect}"
                    checked += 1
    return seen, checked


def test_what_each_local_implementation_runs_is_what_the_registry_says():
    """Every candidate strategy with a local implementation of a vocab/batch-split loss (mean and
    sum, cross entropy and nll), synced batch norm (input with and without a gradient), the
    vocab-split embedding, a split mean and sequence-split attention (all-gather and ring, on one
    axis or both), on a 2x2 mesh: counted collectives = the entry's."""
    for seen, checked in run_ranks(4, _job):
        assert {"loss:batch", "loss:vocab", "batch_norm:sync", "embedding:vocab", "mean:scale", "attn_gather:cp",
                "attn_ring:cp"} <= seen
        assert checked >= 6
