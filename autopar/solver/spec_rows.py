"""Rows of specs (one per strategy of a node), the keys of the solver's edge tables, built and hashed
once per costing (``Costing._tables``): every edge of every solve looks two of them up."""
from __future__ import annotations

from autopar.core import search_memo


class SpecRow(tuple):
    """A node's specs, one per strategy (a key of the edge tables), hashed once: rows of a few hundred
    specs are looked up for every edge of every solve."""

    def __hash__(self) -> int:
        h = self.__dict__.get("hash")
        if h is None:
            h = self.__dict__["hash"] = tuple.__hash__(self)
        return h


def spec_row(c, cands, name: str, side: str, k) -> SpecRow:
    """Output ``k`` (``side`` "out"; None: the only one) or input ``k`` ("in"; None past an op's inputs)
    of each of ``name``'s strategies, kept per costing (one graph on one mesh shape, one set of
    candidates): the same row object for every edge of the node, and under ``search_memo`` for every node
    holding the same list object (the entry keeps the list alive, so its id is not reused)."""
    strats = cands.strategies[name]
    # nodes sharing one list object (``build_candidates``' classes: repeated layers) share one row
    key = ("row", id(strats) if search_memo.ENABLED else name, side, k)
    kept = c._tables.get(key)
    if kept is not None and kept[0] is strats:      # built from these very strategies
        return kept[1]
    if side == "out":
        row = SpecRow(st.output if k is None else st.output[k] for st in strats)
    else:
        row = SpecRow(st.inputs[k] if k < len(st.inputs) else None for st in strats)
    c._tables[key] = (strats, row)
    return row
