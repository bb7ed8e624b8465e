"""``solver/spec_rows.py``: a node's spec row is built once per costing and rebuilt when its strategies change."""
from types import SimpleNamespace

from autopar.sharding.placements import R, Shard, Spec
from autopar.sharding.redistribute import cached_steps, redistribute_steps
from autopar.solver.spec_rows import SpecRow, spec_row


def _st(out, ins):
    return SimpleNamespace(output=out, inputs=ins)


def test_a_row_is_kept_per_costing_and_rebuilt_for_other_strategies():
    a, b = Spec((Shard(0), R)), Spec((R, R))
    c = SimpleNamespace(_tables={})
    cands = SimpleNamespace(strategies={"x": [_st(a, (b,)), _st(b, ())]})
    row = spec_row(c, cands, "x", "out", None)
    assert row == (a, b) and hash(row) == hash((a, b)) and isinstance(row, SpecRow)
    assert spec_row(c, cands, "x", "out", None) is row
    assert spec_row(c, cands, "x", "in", 0) == (b, None)       # past an op's inputs: None
    cands.strategies["x"] = [_st(b, ())]                          # other strategies under the same name
    assert spec_row(c, cands, "x", "out", None) == (b,)


def test_cached_steps_are_the_steps():
    pairs = [(Spec((Shard(0), R)), Spec((R, Shard(1)))), (Spec((R, R)), Spec((Shard(0), Shard(0)))),
             (Spec((Shard(1), Shard(0))), Spec((Shard(0), Shard(1))))]
    for src, dst in pairs:
        assert list(cached_steps(src, dst)) == redistribute_steps(src, dst)
        assert cached_steps(src, dst) is cached_steps(src, dst)
