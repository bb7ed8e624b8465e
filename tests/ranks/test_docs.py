"""The doc blocks marked ``<!-- doc-test: ranks N ... -->`` run on N ranks (slow suite); the rest of the doc tests
run in one process: tests/unit/test_docs_blocks.py, the blocks and markers: tests/doc_blocks.py."""
from __future__ import annotations

import os
import sys

import pytest

from conftest import run_ranks
from doc_blocks import BLOCKS, DocBlock, ROOT, in_tmp, run_block


def _run_on_rank(rank: int, block: DocBlock, folder: str) -> None:
    os.chdir(folder)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    run_block(block)


_RANKED = [b for b in BLOCKS if b.skip is None and b.ranks > 0]


@pytest.mark.slow
@pytest.mark.parametrize("block", _RANKED, ids=[b.where for b in _RANKED])
def test_doc_block_runs_on_ranks(block, in_tmp):
    run_ranks(block.ranks, _run_on_rank, block, str(in_tmp))
