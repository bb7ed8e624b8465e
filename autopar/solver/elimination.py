"""Exact solve of an unbudgeted reduced class graph by variable (bucket) elimination, numpy.

``class_graph.reduce_graph`` eliminates the classes of degree <= 2 (min-plus products along
chains and leaves). What it leaves has higher degree: a transformer layer's tied classes form a
small core of a few tens of classes, on which a CP-SAT run costs mostly its set-up (docs/solver.md).
Without a memory budget the problem is a pure min-sum over a graph of unary and pairwise terms,

    min_i  sum_a c_a[i_a] + sum_{(a,b)} R_ab[i_a, i_b],

and elimination solves it exactly: pick a class v, gather every factor f_j whose scope holds v,
and replace them by one factor on the union U of their scopes without v,

    f_new(i_U) = min_{i_v} sum_j f_j(i_U, i_v),        arg_v(i_U) = the minimising i_v,

until no class is left (the sum of the scalar factors is the optimum); then the picks are read
back in reverse order, each from its ``arg`` table at the picks of its scope (which were
eliminated later, so are known). The order: each rule of ``ORDERS`` (the step of fewest sums
next, |U|·|v|; the smallest new table next, |U|, min-weight) is simulated on the scopes alone and
the one of fewest sums in all is run. On a transformer layer's core (12 classes of up to 63
candidates, 18 edges) fewest-sums-next eliminates the small classes first, fill-in then joins the
large ones into 4-way tables: 1.5e8 sums where the smallest-table order does 1.1e7 (the fewest
over every order, by a DP over the subsets eliminated, on the Llama-3 8B search's problems). The
optimum is the same under any order; equal minima may be picked differently. A step of more than ``LIMIT`` sums or a table over
``TABLE`` entries returns None and the caller uses CP-SAT. The sums of one step are done one
candidate of v at a time, so the working set is one table over U, each partial sum of the factors as
small as its scopes allow (``_sum_into``). No rounding: the result is optimal (inf = forbidden, propagated; an infinite
optimum means no finite assignment).
"""
from __future__ import annotations

import math

import numpy as np

from autopar.core import search_memo
from autopar.solver.class_graph import ClassGraph

LIMIT = 64_000_000     # sums one elimination step may do (its table times the class's candidates)
TABLE = 4_000_000      # entries of the largest table it may keep (32 MB of float64)
DENSE = 1_000_000      # a step's sums done in one array (8 MB of float64) up to this many

Factor = tuple[tuple[int, ...], np.ndarray]     # (scope: classes, one array axis each in this order, values)


def _initial_factors(g: ClassGraph, active: list[int]) -> list[Factor]:
    factors: list[Factor] = [((a,), np.asarray(g.compute[a], dtype=float)) for a in active]
    factors += [((a, b), np.asarray(m, dtype=float)) for (a, b), m in g.edges.items()]
    return factors


def _aligned(factor: Factor, scope: tuple[int, ...], sizes: dict[int, int]) -> np.ndarray:
    """``factor``'s values as an array that broadcasts over ``scope``'s axes."""
    own, values = factor
    order = sorted(range(len(own)), key=lambda k: scope.index(own[k]))
    values = values.transpose(order) if len(own) > 1 else values
    shape = [sizes[c] if c in own else 1 for c in scope]
    return values.reshape(shape)


def _by_sums(v: int, around: set[int], sizes: dict[int, int]) -> tuple:
    """The step's sums first (its new table times v's candidates)."""
    table = math.prod(sizes[c] for c in around)
    return table * sizes[v], len(around), v


def _by_table(v: int, around: set[int], sizes: dict[int, int]) -> tuple:
    """The new table's entries first (min-weight): a class of many candidates is summed out while
    its neighbours are few, before fill-in joins them to more."""
    table = math.prod(sizes[c] for c in around)
    return table, table * sizes[v], v


ORDERS = (_by_sums, _by_table)   # the elimination orders tried; the one of fewest sums in all is run


def _order(nbrs: dict[int, set[int]], sizes: dict[int, int], key) -> tuple[list[tuple[int, tuple[int, ...], int]], int]:
    """The steps (class, its neighbours, sums) of eliminating every class, each time the one ``key``
    ranks first, and their sums in all. ``nbrs``: each class and the classes it shares a factor with
    (not changed)."""
    nbrs = {v: set(a) for v, a in nbrs.items()}
    steps, total = [], 0
    while nbrs:
        v = min(nbrs, key=lambda c: key(c, nbrs[c], sizes))
        scope = tuple(sorted(nbrs[v]))
        entries = math.prod(sizes[c] for c in scope) * sizes[v]
        for u in scope:                 # the new factor joins v's neighbours to each other
            nbrs[u] |= set(scope)
            nbrs[u] -= {u, v}
        del nbrs[v]
        steps.append((v, scope, entries))
        total += entries
    return steps, total


def elimination_order(nbrs: dict[int, set[int]], sizes: dict[int, int],
                      limit: int = LIMIT) -> list[tuple[int, tuple[int, ...], int]]:
    """The steps of the order in ``ORDERS`` that does the fewest sums in all among those whose every
    step is within ``limit`` sums and ``TABLE`` entries (the first on a tie; the first order when
    none is: ``eliminate_best`` then hands the problem to CP-SAT)."""
    orders = [_order(nbrs, sizes, key) for key in ORDERS]
    within = [o for o in orders if all(e <= limit and e // sizes[v] <= TABLE for v, _, e in o[0])]
    return min(within or orders[:1], key=lambda o: o[1])[0]


def _min_over_last(parts: list[np.ndarray], shape: list[int], n: int) -> tuple[np.ndarray, np.ndarray]:
    """min and argmin over the last axis of sum(parts), in blocks of at most ``DENSE`` sums: a
    block of the scope's first axis is summed whole (its rows times the class's candidates) and
    reduced by numpy, so the working set stays in cache; where one row of the scope is already over
    ``DENSE``, one value of the last axis at a time. Every path adds the parts in the same order and
    keeps the first of equal minima: the same floats and picks."""
    row = math.prod(shape[1:]) * n
    if shape and row <= DENSE < math.prod(shape) * n:
        step = max(1, DENSE // row)
        best, arg = np.empty(shape), np.empty(shape, dtype=np.int32)
        for a in range(0, shape[0], step):
            b = min(a + step, shape[0])
            best[a:b], arg[a:b] = _min_over_last([p[a:b] if p.shape[0] > 1 else p for p in parts],
                                                 [b - a] + list(shape[1:]), n)
        return best, arg
    if math.prod(shape) * n <= DENSE:
        total = np.empty(list(shape) + [n])
        _sum_into(parts, total)
        arg = total.argmin(axis=-1)
        return np.take_along_axis(total, arg[..., None], axis=-1)[..., 0], arg.astype(np.int32)
    best = np.full(shape, np.inf)
    arg = np.zeros(shape, dtype=np.int32)
    total = np.empty(shape)
    better = np.empty(shape, dtype=bool)
    for k in range(n):
        _sum_into([part[..., k if part.shape[-1] > 1 else 0] for part in parts], total)
        np.less(total, best, out=better)
        np.copyto(best, total, where=better)
        np.copyto(arg, k, where=better)
    return best, arg


def _sum_into(parts: list[np.ndarray], out: np.ndarray) -> None:
    """``out[...] = parts[0] + parts[1] + ...`` added left to right, each partial sum at the broadcast
    shape of the parts so far (a step's unary and pairwise factors come first and are small), so
    only the last addition runs over the whole table. Each entry is the same sum of the same floats
    in the same order as adding every part into a table of zeros (0 + x = x; a zero's sign aside,
    which no comparison sees): the same values and picks."""
    if not search_memo.ENABLED:
        out.fill(0.0)
        for part in parts:
            out += part
        return
    acc = parts[0]
    for part in parts[1:-1]:
        acc = acc + part
    if len(parts) > 1:
        np.add(acc, parts[-1], out=out)
    else:
        out[...] = acc


def eliminate_best(g: ClassGraph, active: list[int], limit: int | None = None) -> tuple[float, dict[int, int]] | None:
    """(optimal cost, original strategy per live class) of the reduced graph without a budget, or
    None when some elimination step would do more than ``limit`` sums or keep a table over ``TABLE``
    entries. The cost is inf when no assignment is finite (the picks are then meaningless)."""
    limit = LIMIT if limit is None else limit
    sizes = {a: len(g.cands[a]) for a in active}
    factors = _initial_factors(g, active)
    steps: list[tuple[int, tuple[int, ...], np.ndarray]] = []
    nbrs: dict[int, set[int]] = {a: set() for a in active}
    for (a, b) in g.edges:
        nbrs[a].add(b)
        nbrs[b].add(a)
    for v, scope, entries in elimination_order(nbrs, sizes, limit):
        if entries > limit or entries // sizes[v] > TABLE:
            return None
        full = scope + (v,)
        touching = [f for f in factors if v in f[0]]
        factors = [f for f in factors if v not in f[0]]
        best, arg = _min_over_last([_aligned(f, full, sizes) for f in touching], [sizes[c] for c in scope], sizes[v])
        steps.append((v, scope, arg))
        factors.append((scope, best))
    optimum = float(sum(float(values) for scope, values in factors if not scope))
    pos: dict[int, int] = {}
    for v, scope, arg in reversed(steps):
        pos[v] = int(arg[tuple(pos[c] for c in scope)])
    picked = {a: int(g.cands[a][0]) for a in g.alive}
    picked.update({a: int(g.cands[a][pos[a]]) for a in active})
    return optimum, picked
