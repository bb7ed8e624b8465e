"""Greedy assignments of the intra-op problem: the feasible hint a budgeted solve starts from
(``problem.build_problem`` stores it as ``IntraOpProblem.hint``)."""
from __future__ import annotations

import numpy as np

from autopar.solver.intra_op import EdgeCost, IntraOpProblem


def feasible_hint(p: IntraOpProblem) -> list[int]:
    """Greedy assignment that fits the budget: memory priced at λ s/byte (a Lagrangian
    relaxation of the memory constraint), λ raised tenfold until the greedy choice fits."""
    choice = greedy_choice(p, 0.0)
    if p.memory_budget is None:
        return choice
    price = 1e-15
    while sum(float(n.memory[s]) for n, s in zip(p.nodes, choice)) > p.memory_budget and price < 1e3:
        choice = greedy_choice(p, price)
        price *= 10
    return choice


def greedy_choice(p: IntraOpProblem, memory_price: float = 0.0) -> list[int]:
    """Graph order, each node its cheapest allowed strategy given its producers' choices
    (cost = time + memory_price · bytes); tied nodes follow the first of their group."""
    incoming: dict[int, list[EdgeCost]] = {}
    for e in p.edges:
        incoming.setdefault(e.dst, []).append(e)
    leader = {m: g[0] for g in p.ties for m in g}
    choice: list[int] = []
    for v, node in enumerate(p.nodes):
        if v in leader and leader[v] != v:
            choice.append(choice[leader[v]])
            continue
        cost = np.array(node.compute, dtype=float) + memory_price * np.asarray(node.memory, dtype=float)
        for e in incoming.get(v, []):
            if e.src < v:
                cost = cost + e.cost[choice[e.src], :]
        allowed = node.allowed if node.allowed is not None else range(len(cost))
        choice.append(min(allowed, key=lambda s: cost[s]))
    return choice
