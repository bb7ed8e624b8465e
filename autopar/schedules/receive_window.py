"""Which pipeline receives a rank keeps posted: a window over each sender's send order.

A receive must be posted before its message can leave the sender's connection (gloo sends one pair's
messages in order, so an unposted large message blocks the ones behind it). Posting every receive of
the step up front is always safe but holds 2 m activation-sized buffers per rank (docs/pipeline.md
gives a measured case). ``ReceiveWindow`` posts, per sender, in that sender's own send order:

    need(k):  post every not-yet-posted message of k's sender up to k in its send order, and the
              next ``lookahead`` after it (their transfer overlaps the work before they are used).

Deadlock-free: when the rank waits for k, every message its sender sends before k has a posted
receive, so k is not stuck behind an unposted one; the sender sends k without waiting for anything
this rank does later (sends do not block), and the schedule itself is deadlock-free (``simulate``).
A message is posted once and consumed once; ``most_posted`` replays a consumption order and returns
the largest number posted and not yet consumed: the buffers a rank holds at its peak.

``schedule_receive_buffers`` is that peak for a schedule whose stages form a chain (each stage sends
one message per microbatch to the next, its gradient one back), the planner's model of the runtime
(``runtime/pipeline.py`` applies the same window to its exact transfers).
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable
from functools import lru_cache

from autopar.schedules.schedule import build_schedule

LOOKAHEAD = 2       # messages posted ahead of the one a rank waits for, per sender


class ReceiveWindow:
    """``sent``: per sender, the keys it sends to this rank in its send order."""

    def __init__(self, sent: dict[Hashable, list[Hashable]], lookahead: int = LOOKAHEAD):
        self._sent = sent
        self._lookahead = lookahead
        self._sender = {k: s for s, keys in sent.items() for k in keys}
        self._at = {k: i for keys in sent.values() for i, k in enumerate(keys)}
        self._next = dict.fromkeys(sent, 0)     # per sender: its first key not yet posted

    def start(self) -> list[Hashable]:
        """Keys to post before the first action: the first ``lookahead`` of each sender."""
        out = []
        for s, keys in self._sent.items():
            out += self._advance(s, min(self._lookahead, len(keys)))
        return out

    def need(self, key: Hashable) -> list[Hashable]:
        """Keys to post now (in send order) so that ``key`` can arrive; empty when it is posted."""
        s = self._sender[key]
        return self._advance(s, min(self._at[key] + 1 + self._lookahead, len(self._sent[s])))

    def _advance(self, sender: Hashable, upto: int) -> list[Hashable]:
        first = self._next[sender]
        if upto <= first:
            return []
        self._next[sender] = upto
        return self._sent[sender][first:upto]


def most_posted(window: ReceiveWindow, consumed: Iterable[Hashable]) -> int:
    """The most messages posted and not yet consumed while ``consumed`` are used in that order."""
    live = len(window.start())
    peak = live
    for key in consumed:
        live += len(window.need(key))
        peak = max(peak, live)
        live -= 1
    return peak


def chain_messages(kind: str, pp: int, m: int, v: int, train: bool = True) -> list[tuple[dict, list]]:
    """Per pipeline rank, (sent per sender rank, consumed in order) when stage s sends one
    activation per microbatch to stage s + 1 and, training, stage s + 1 one gradient back to s."""
    sched = build_schedule(kind, pp, m, v)
    last = sched.num_stages - 1
    out: list[tuple[dict, list]] = [({}, []) for _ in range(pp)]
    for r, actions in enumerate(sched.actions):
        for a in actions:
            if a.kind == "F":
                if a.stage < last and (to := sched.rank_of(a.stage + 1)) != r:
                    out[to][0].setdefault(r, []).append(("F", a.stage + 1, a.microbatch))
                if a.stage > 0 and sched.rank_of(a.stage - 1) != r:
                    out[r][1].append(("F", a.stage, a.microbatch))
            elif train:
                if a.stage > 0 and (to := sched.rank_of(a.stage - 1)) != r:
                    out[to][0].setdefault(r, []).append(("B", a.stage - 1, a.microbatch))
                if a.stage < last and sched.rank_of(a.stage + 1) != r:
                    out[r][1].append(("B", a.stage, a.microbatch))
    return out


@lru_cache(maxsize=4096)
def schedule_receive_buffers(kind: str, pp: int, m: int, v: int = 1, lookahead: int = LOOKAHEAD) -> int:
    """The most receive buffers any rank of the chain holds posted at once (``most_posted``)."""
    return max((most_posted(ReceiveWindow(sent, lookahead), consumed)
                for sent, consumed in chain_messages(kind, pp, m, v)), default=0)
