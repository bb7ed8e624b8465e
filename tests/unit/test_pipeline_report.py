"""The pipeline report's stage table names each stage's ranks compactly (``report/pipeline.rank_list``): a
stage of Llama 3 405B's 128K layout holds 1,024 ranks."""
from __future__ import annotations

import pytest

from autopar.report.pipeline import rank_list


@pytest.mark.parametrize("ranks,text", [
    ([0], "0"),
    ([1, 0], "0-1"),
    (list(range(1024, 2048)), "1024-2047"),
    ([0, 2], "0,2"),
    (list(range(0, 1024, 16)), "0,16,..,1008 (64 ranks)"),
    ([0, 1, 4, 5, 8, 9], "0-1,4-5,8-9"),
    ([0, 1, 4, 5, 8, 9, 12, 13, 20], "0-1,4-5,8-9,..,20 (9 ranks)"),
])
def test_rank_list(ranks, text):
    assert rank_list(ranks) == text
