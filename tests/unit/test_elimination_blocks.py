"""``elimination._min_over_last`` in dense blocks (the search's speed-up) gives the same floats and
picks as the plain one-candidate-at-a-time loop, on every path: one dense table, blocks of the
scope's first axis, and the loop where one row of the scope is over ``DENSE``."""
import numpy as np
import pytest

from autopar.solver import elimination


def _one_at_a_time(parts, shape, n):
    best, arg = np.full(shape, np.inf), np.zeros(shape, dtype=np.int32)
    for k in range(n):
        total = np.zeros(shape)
        for part in parts:
            total += part[..., k if part.shape[-1] > 1 else 0]
        better = total < best
        best = np.where(better, total, best)
        arg[better] = k
    return best, arg


@pytest.mark.parametrize("dense", [1_000_000, 60, 7, 0])
def test_blocks_match_the_loop(dense, monkeypatch):
    monkeypatch.setattr(elimination, "DENSE", dense)
    rng = np.random.default_rng(dense)
    for _ in range(150):
        shape = [int(s) for s in rng.integers(1, 9, size=rng.integers(0, 4))]
        n = int(rng.integers(1, 12))
        parts = []
        for _ in range(rng.integers(1, 5)):
            sh = [s if rng.random() < 0.6 else 1 for s in shape + [n]]
            # ties and forbidden (inf) entries: the first of equal minima must win on every path
            parts.append(rng.choice([0.0, 1.0, 2.5, np.inf], size=sh) if rng.random() < 0.4 else rng.random(sh))
        want_best, want_arg = _one_at_a_time(parts, shape, n)
        best, arg = elimination._min_over_last(parts, shape, n)
        assert best.shape == want_best.shape and arg.dtype == want_arg.dtype
        assert np.array_equal(best, want_best) and np.array_equal(arg, want_arg)
