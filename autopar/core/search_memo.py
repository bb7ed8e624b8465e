"""The switch for the planning search's exact shortcuts (memos keyed by what a value depends on, sums
done at their factors' own sizes): ``ENABLED`` (on; ``AUTOPAR_SEARCH_MEMO=0`` in the environment turns
it off at import). Every shortcut gives the same values as the plain code, so AUTO returns the same
plan either way (``tests/unit/test_search_memo.py`` checks it); off exists for that test and for
bisecting a suspected difference."""
from __future__ import annotations

import os

ENABLED: bool = os.environ.get("AUTOPAR_SEARCH_MEMO", "1") != "0"
