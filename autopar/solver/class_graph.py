"""The tie-class graph of an intra-op problem and its exact pre-solve reductions.

Each class (a tie group, or one node) keeps its remaining candidate strategies ``cands`` with
their compute and memory; each class edge a matrix of resharding times, inf = forbidden, and
optionally a matrix of bytes the pair keeps (``edge_memory``: a parameter used in another
placement than the stored one keeps its gathered copy for backward, which depends on both ends).
``reduce_graph`` applies until nothing changes, each reduction exact:

    * drop strategies that no allowed pair of some edge can accompany      (``_prune_forbidden``)
    * drop strategy s of v when some t is no worse in compute, memory and workspace (if
      budgeted) and in every incident edge's row (time, and edge memory if budgeted): any
      solution using s stays as good with t                                 (``_drop_dominated``)
    * a class with one strategy left adds its edge rows (time and memory) to its neighbours
                                                                            (``_fold_fixed``)
    * an edge with R[i,j] = a_i + b_j (and its memory likewise) moves a to u and b to v
                                                                            (``_fold_separable``)
    * a class of degree <= 2 whose memory does not depend on its choice and whose edges keep
      no memory (or no budget) is
      eliminated by min-plus products, like Alpa's graph simplification: a leaf adds
      min_j (R[i,j] + c[j]) to its neighbour; a node between u and w becomes an edge
      min_j (R1[i,j] + c[j] + R2[j,k]); its choice is recovered afterwards   (``_eliminate``,
      ``recover_choices``)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

HUGE_COST = 1e6  # seconds; a compute or resharding cost at or above this forbids that choice


class InfeasibleError(ValueError):
    """No strategy assignment satisfies the memory budget or avoids forbidden choices."""


@dataclass
class Leaf:
    node: int
    parent: int
    parent_cands: np.ndarray
    choice: np.ndarray  # original strategy of node per position in parent_cands


@dataclass
class Series:
    node: int
    left: int
    right: int
    left_cands: np.ndarray
    right_cands: np.ndarray
    choice: np.ndarray  # [len left_cands, len right_cands] original strategy of node


@dataclass
class ClassGraph:
    """The reduced problem on tie classes. Matrices are indexed by positions in ``cands``; inf = forbidden."""
    members: list[list[int]]
    cands: list[np.ndarray]
    compute: list[np.ndarray]
    memory: list[np.ndarray]
    edges: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)  # key (a, b) with a < b
    nbrs: list[set[int]] = field(default_factory=list)
    alive: set[int] = field(default_factory=set)
    eliminated: list[Leaf | Series] = field(default_factory=list)
    fixed_memory: float = 0.0  # memory of eliminated classes
    budgeted: bool = False
    edge_memory: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)  # same keys; only edges keeping bytes
    workspace: dict[int, np.ndarray] = field(default_factory=dict)  # class -> [k, 2] (sum, max) terms (``Workspace``)

    def edge(self, a: int, b: int) -> np.ndarray:
        return self.edges[(a, b)] if a < b else self.edges[(b, a)].T

    def edge_mem(self, a: int, b: int) -> np.ndarray | None:
        """Bytes kept per pair of the edge (rows: a's candidates), None when it keeps none."""
        m = self.edge_memory.get((min(a, b), max(a, b)))
        return None if m is None else (m if a < b else m.T)

    def add_edge(self, a: int, b: int, matrix: np.ndarray, memory: np.ndarray | None = None) -> None:
        key, m = ((a, b), matrix) if a < b else ((b, a), matrix.T)
        self.edges[key] = self.edges[key] + m if key in self.edges else np.array(m, dtype=float)
        if memory is not None and np.any(memory):
            mem = memory if a < b else memory.T
            old = self.edge_memory.get(key)
            self.edge_memory[key] = np.array(mem, dtype=float) if old is None else old + mem
        self.nbrs[a].add(b)
        self.nbrs[b].add(a)

    def remove_edge(self, a: int, b: int) -> None:
        key = (min(a, b), max(a, b))
        del self.edges[key]
        self.edge_memory.pop(key, None)
        self.nbrs[a].discard(b)
        self.nbrs[b].discard(a)

    def restrict(self, a: int, keep: np.ndarray) -> None:
        self.cands[a], self.compute[a], self.memory[a] = self.cands[a][keep], self.compute[a][keep], self.memory[a][keep]
        if a in self.workspace:
            self.workspace[a] = self.workspace[a][keep]
        for b in self.nbrs[a]:
            key = (min(a, b), max(a, b))
            for table in (self.edges, self.edge_memory):
                if key in table:
                    table[key] = table[key][keep] if a < b else table[key][:, keep]
        if not len(self.cands[a]):
            names = ", ".join(str(v) for v in self.members[a][:4])
            raise InfeasibleError(
                f"no strategy is possible for node(s) {names}: every candidate has an infinite (>= {HUGE_COST:g} s) "
                f"compute or resharding cost with all choices of a neighbour, or is excluded by annotations/ties. "
                f"Relax the annotations or add a rule for the op")

    def memory_is_free(self, a: int) -> bool:
        """Unbudgeted, or the class's memory does not depend on its choice and no edge keeps bytes."""
        if not self.budgeted:
            return True
        mem = self.memory[a]
        return (float(mem.max() - mem.min()) <= 1e-12 * max(1.0, abs(float(mem.max())))
                and not any(self.edge_mem(a, b) is not None for b in self.nbrs[a])
                and (a not in self.workspace or not np.ptp(self.workspace[a], axis=0).any()))


@dataclass
class Workspace:
    """Workspace beside the memory row, on the classes (docs/solver.md, Transients): the budget holds
    the row + the sum terms of the picks + the largest max term of the picks."""
    peak: dict[int, np.ndarray] = field(default_factory=dict)    # active class -> max term per candidate
    added: dict[int, np.ndarray] = field(default_factory=dict)   # active class -> sum term per candidate
    floor: float = 0.0      # the largest least max term of the classes the reductions removed or fixed
    fixed: float = 0.0      # the least sum terms of those classes


def is_forbidden(x: np.ndarray) -> np.ndarray:
    return ~np.isfinite(x) | (x >= HUGE_COST)


def allowed_mask(k: int, allowed) -> np.ndarray:
    """``np.isin(np.arange(k), allowed)``: which of ``k`` candidates ``allowed`` lists (by index)."""
    idx = np.asarray(list(allowed), dtype=np.intp)
    if idx.size and (idx.min() < 0 or idx.max() >= k):
        return np.isin(np.arange(k), idx)
    mask = np.zeros(k, dtype=bool)
    mask[idx] = True
    return mask


# ---------------------------------------------------------------- reductions

def _restrict_each(g: ClassGraph, keep_of) -> bool:
    """Restrict every live class to the candidates ``keep_of(a)`` marks (None: leave it)."""
    changed = False
    for a in list(g.alive):
        keep = keep_of(a)
        if keep is not None and not keep.all():
            g.restrict(a, keep)
            changed = True
    return changed


def _prune_forbidden(g: ClassGraph) -> bool:
    def keep_of(a):
        keep = np.isfinite(g.compute[a]) & np.isfinite(g.memory[a])
        for b in g.nbrs[a]:
            keep &= np.isfinite(g.edge(a, b)).any(axis=1)
        return keep

    return _restrict_each(g, keep_of)


def _drop_dominated(g: ClassGraph) -> bool:
    def keep_of(a):
        k = len(g.cands[a])
        if k < 2:
            return None
        columns = [g.compute[a][:, None]] + ([g.memory[a][:, None]] if g.budgeted else [])
        if g.budgeted and a in g.workspace:
            columns.append(g.workspace[a])
        columns += [g.edge(a, b) for b in g.nbrs[a]]
        if g.budgeted:
            columns += [m for b in g.nbrs[a] if (m := g.edge_mem(a, b)) is not None]
        sig = np.hstack(columns)
        le = (sig[:, None, :] <= sig[None, :, :]).all(axis=2)  # le[t, s]: t no worse than s
        order = np.arange(k)
        dominates = le & (~le.T | (order[:, None] < order[None, :]))
        np.fill_diagonal(dominates, False)
        return ~dominates.any(axis=0)

    return _restrict_each(g, keep_of)


def _fold_fixed(g: ClassGraph) -> bool:
    changed = False
    for a in list(g.alive):
        if len(g.cands[a]) == 1 and g.nbrs[a]:
            for b in list(g.nbrs[a]):
                g.compute[b] = g.compute[b] + g.edge(a, b)[0]
                if (mem := g.edge_mem(a, b)) is not None:
                    g.memory[b] = g.memory[b] + mem[0]
                g.remove_edge(a, b)
            changed = True
    return changed


def _separate(m: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(row, col) with m[i, j] = row[i] + col[j], or None."""
    if not np.isfinite(m).all():
        return None
    row, col = m[:, 0], m[0, :] - m[0, 0]
    return (row, col) if np.allclose(m, row[:, None] + col[None, :], rtol=1e-12, atol=1e-15) else None


def _fold_separable(g: ClassGraph) -> bool:
    changed = False
    for (a, b), m in list(g.edges.items()):
        time = _separate(m)
        mem = g.edge_memory.get((a, b))
        kept = _separate(mem) if mem is not None else (np.zeros(len(m)), np.zeros(m.shape[1]))
        if time is None or kept is None:
            continue
        g.compute[a] = g.compute[a] + time[0]
        g.compute[b] = g.compute[b] + time[1]
        g.memory[a] = g.memory[a] + kept[0]
        g.memory[b] = g.memory[b] + kept[1]
        g.remove_edge(a, b)
        changed = True
    return changed


def _eliminate(g: ClassGraph) -> bool:
    changed = False
    for a in sorted(g.alive):
        if len(g.nbrs[a]) > 2 or not g.memory_is_free(a):
            continue
        nbrs = sorted(g.nbrs[a])
        if not nbrs:
            if len(g.cands[a]) > 1:
                g.restrict(a, np.arange(len(g.cands[a])) == np.argmin(g.compute[a]))
                changed = True
            continue
        if len(nbrs) == 1:
            b = nbrs[0]
            total = g.edge(b, a) + g.compute[a][None, :]
            best = np.argmin(total, axis=1)
            g.eliminated.append(Leaf(a, b, g.cands[b].copy(), g.cands[a][best]))
            g.compute[b] = g.compute[b] + total[np.arange(len(best)), best]
        else:
            b, c = nbrs
            total = g.edge(b, a)[:, :, None] + g.compute[a][None, :, None] + g.edge(a, c)[None, :, :]
            best = np.argmin(total, axis=1)
            g.eliminated.append(Series(a, b, c, g.cands[b].copy(), g.cands[c].copy(), g.cands[a][best]))
            g.add_edge(b, c, np.take_along_axis(total, best[:, None, :], axis=1)[:, 0, :])
        for b in nbrs:
            g.remove_edge(a, b)
        g.fixed_memory += float(g.memory[a][0])
        g.alive.discard(a)
        changed = True
    return changed


def reduce_graph(g: ClassGraph) -> None:
    passes = (_prune_forbidden, _fold_fixed, _fold_separable, _drop_dominated, _eliminate)
    while any([step(g) for step in passes]):
        pass


def recover_choices(g: ClassGraph, picked: dict[int, int]) -> dict[int, int]:
    """Choices of eliminated classes, latest elimination first (its neighbours are decided)."""
    for rec in reversed(g.eliminated):
        if isinstance(rec, Leaf):
            i = int(np.searchsorted(rec.parent_cands, picked[rec.parent]))
            picked[rec.node] = int(rec.choice[i])
        else:
            i = int(np.searchsorted(rec.left_cands, picked[rec.left]))
            j = int(np.searchsorted(rec.right_cands, picked[rec.right]))
            picked[rec.node] = int(rec.choice[i, j])
    return picked
