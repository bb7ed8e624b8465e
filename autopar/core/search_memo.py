"""The switch for the planning search's exact shortcuts (memos keyed by what a value depends on, sums
done at their factors' own sizes): ``ENABLED`` (on; ``AUTOPAR_SEARCH_MEMO=0`` in the environment turns
it off at import). Every shortcut gives the same values as the plain code, so AUTO returns the same
plan either way (``tests/unit/test_search_memo.py`` checks it); off exists for that test and for
bisecting a suspected difference."""
from __future__ import annotations

import os

ENABLED: bool = os.environ.get("AUTOPAR_SEARCH_MEMO", "1") != "0"


def graph_cache(gm, name: str, **fields) -> dict:
    """The dict ``gm.meta[name]`` for facts of one traced graph, emptied (and given ``fields``, each
    a fresh copy of its value) when the graph changes: another graph object or another node count."""
    cache = gm.meta.setdefault(name, {})
    key = (id(gm.graph), len(gm.graph.nodes))
    if cache.get("key") != key:
        cache.clear()
        cache["key"] = key
        cache.update({k: type(v)(v) for k, v in fields.items()})
    return cache
