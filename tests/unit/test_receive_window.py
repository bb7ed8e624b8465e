"""The pipeline runtime's window of posted receives (``autopar/schedules/receive_window.py``)."""
import itertools

import pytest

from autopar.schedules.receive_window import ReceiveWindow, chain_messages, most_posted, schedule_receive_buffers

SCHEDULES = [("gpipe", p, m, 1) for p, m in itertools.product((2, 3, 4), (1, 4, 7))] + \
    [("1f1b", p, m, 1) for p, m in itertools.product((2, 3, 4, 8), (1, 4, 8, 32))] + \
    [("interleaved_1f1b", p, m, v) for p, m, v in ((2, 4, 2), (4, 8, 2), (4, 16, 3), (8, 32, 2))]


@pytest.mark.parametrize("kind,p,m,v", SCHEDULES)
def test_a_wait_never_sits_behind_an_unposted_message_and_each_is_posted_once(kind, p, m, v):
    """Replaying each rank's consumption: when it needs a message, that message and every message
    its sender sends before it have posted receives (no head-of-line block on an in-order link);
    every message is posted exactly once; the peak is what ``most_posted`` reports and stays a few
    buffers, not the 2 m that posting the whole step up front holds."""
    for rank, (sent, consumed) in enumerate(chain_messages(kind, p, m, v)):
        window = ReceiveWindow(sent)
        posted = list(window.start())
        live = len(posted)
        peak = live
        for key in consumed:
            new = window.need(key)
            posted += new
            live += len(new)
            peak = max(peak, live)
            sender = next(s for s, keys in sent.items() if key in keys)
            before = sent[sender][:sent[sender].index(key) + 1]
            assert set(before) <= set(posted), f"rank {rank} waits for {key} behind an unposted message"
            live -= 1
        assert sorted(posted) == sorted(k for keys in sent.values() for k in keys)
        assert sorted(consumed) == sorted(posted)
        assert peak == most_posted(ReceiveWindow(sent), consumed)
    assert schedule_receive_buffers(kind, p, m, v) <= min(2 * m * v, 2 * (2 + 1) + 1)


def test_the_window_posts_in_each_senders_order_with_the_lookahead():
    """Two senders; waiting for b2 posts b0..b2 and the lookahead after it (b3), in b's send order;
    a message already posted posts nothing more but keeps the lookahead ahead of it."""
    w = ReceiveWindow({"a": ["a0", "a1"], "b": ["b0", "b1", "b2", "b3", "b4"]}, lookahead=1)
    assert w.start() == ["a0", "b0"]
    assert w.need("b2") == ["b1", "b2", "b3"]
    assert w.need("b1") == []
    assert w.need("b3") == ["b4"]
    assert w.need("a0") == ["a1"]
    assert most_posted(ReceiveWindow({"a": [1, 2, 3]}, lookahead=0), [1, 2, 3]) == 1
    assert most_posted(ReceiveWindow({"a": [1, 2, 3]}, lookahead=0), [3, 2, 1]) == 3
