"""Run a pipeline schedule on this rank: stage forwards/backwards with p2p between stages.

The executor follows ``autopar.schedules.schedule.build_schedule(...)``'s action list for this
rank (the same data the planner simulated):

    F(s, i):  receive stage s's inputs of microbatch i (from the producing stage's peer rank),
              run the stage graph, ``isend`` every value a later stage needs.
              Received floating tensors become leaves that require grad.
    B(s, i):  receive the gradients of the values s sent (from the consuming stages), run
              ``autograd.backward`` on (scaled loss if s is the last stage, sent values) with
              (1/m, received gradients), ``isend`` each received leaf's gradient back
              (zeros when autograd produced none, so both sides always exchange the message).

Receives (``irecv``, shapes and tags are static) are posted through a window over each sender's
own send order (``receive_window.ReceiveWindow``): before an action waits for a message, every
message its sender sends before it has a posted receive, and ``LOOKAHEAD`` more are posted so
that they arrive while this rank works. Gloo sends one pair's messages over one connection in
order, so a large message whose receive is not yet posted would block the ones behind it (with
interleaved schedules a rank sends activations and gradients to its neighbour in another order
than the neighbour consumes them); posting in the sender's order removes that head-of-line
blocking; sends never block; the schedule is deadlock-free (``simulate`` checks it), so the run
completes. A rank holds a handful of receive buffers (``schedule_receive_buffers``: 5 for the
schedules checked), not the 2 m it held when every receive of the step was posted up front.
Values between stages on the same rank (interleaved schedules) go through a local mailbox.
After the last action every pending send is waited on. Collectives inside a stage (tensor
parallel) run in the same order on every rank of the stage's (dp, tp) group, so they match.
Every wait is bounded by the communication timeout (``autopar.core.comm_timeout``) and noted
(``watch.note``: the transfer, microbatch and peer rank), so the ``CommError`` that
``pmodel.step`` raises when a peer stage died or stalled names them.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autopar.collectives.comm import COUNTER
from autopar.collectives.groups import bound_axes
from autopar.collectives.watch import note
from autopar.core.comm_timeout import comm_timeout_s
from autopar.passes.split_stages import StageGraph, Transfer
from autopar.schedules.receive_window import ReceiveWindow
from autopar.runtime.compiled import runner
from autopar.runtime.program import fill_slots
from autopar.schedules.schedule import Action, Schedule


@dataclass
class StageCall:
    """What one stage needs to run: its graph, forward-only graph and argument sources;
    ``compiled``: both graphs run through torch.compile (``runtime/compiled.py``)."""

    graph: StageGraph
    forward_gm: object
    slots: list[tuple[str, object]]      # per original placeholder: (kind, ref) as in RankProgram
    compiled: bool = False

    def __post_init__(self):
        self.runs = {True: runner(self.graph.gm, self.compiled), False: runner(self.forward_gm, self.compiled)}


@dataclass
class _Pending:
    leaves: list[torch.Tensor]
    outs: tuple


@dataclass
class PipelineExecutor:
    stages: dict[int, StageCall]          # this rank's stages
    schedule: Schedule
    transfers: list[Transfer]
    peer: object                          # stage index -> global rank of that stage's peer of this rank
    my_rank: int
    axes: dict
    loss_result: int | None               # original output index of the loss
    output_result: int | None
    timeout_s: float = field(default_factory=comm_timeout_s)     # each wait's bound: the timeout when built
    _mailbox: dict = field(default_factory=dict)
    _posted: dict = field(default_factory=dict)     # key -> (work, buffer) of each receive posted, not yet used
    _receives: ReceiveWindow | None = None
    _by_index: dict = field(default_factory=dict)
    _sent: dict = field(default_factory=dict)       # (pipeline rank, train) -> ``_sent_to``'s answer

    def _arg_values(self, call: StageCall, tensor_of, inputs, target) -> list:
        return fill_slots(call.slots, tensor_of, inputs, target)

    def _sent_to(self, pp_rank: int, train: bool) -> dict[int, list]:
        """The keys (transfer index, microbatch, backward) every other pipeline rank sends pipeline
        rank ``pp_rank``, in the order its actions send them (``_forward``: a stage's sends;
        ``_backward``: the gradients of its floating receives). Fixed by the schedule: kept."""
        if (pp_rank, train) in self._sent:
            return self._sent[(pp_rank, train)]
        rank_of = self.schedule.rank_of
        fwd = {s: [t.index for t in self.transfers if t.src == s and rank_of(t.dst) == pp_rank]
               for s in range(self.schedule.num_stages)}
        bwd = {s: [t.index for t in self.transfers if t.dst == s and t.floating and rank_of(t.src) == pp_rank]
               for s in range(self.schedule.num_stages)}
        sent: dict[int, list] = {}
        for r, actions in enumerate(self.schedule.actions):
            if r == pp_rank:
                continue
            keys = sent.setdefault(r, [])
            for a in actions:
                if a.kind == "F":
                    keys += [(i, a.microbatch, False) for i in fwd[a.stage]]
                elif train:
                    keys += [(i, a.microbatch, True) for i in bwd[a.stage]]
        self._sent[(pp_rank, train)] = sent
        return sent

    def _post(self, keys: list) -> None:
        for index, mb, backward in keys:
            t = self._by_index[index]
            src = self.peer(t.dst if backward else t.src)
            buf = torch.empty(t.shape, dtype=t.dtype)
            self._posted[(index, mb, backward)] = (
                dist.irecv(buf, src=src, tag=t.tag(mb, backward, len(self.transfers))), buf)

    def _recv(self, t: Transfer, mb: int, backward: bool) -> torch.Tensor:
        key = (t.index, mb, backward)
        if key in self._mailbox:
            return self._mailbox.pop(key)
        self._post(self._receives.need(key))
        work, buf = self._posted.pop(key)
        stage = t.dst if backward else t.src
        src = self.peer(stage)
        note("p2p receive", peer=src, detail=f"{_what(t, mb, backward)} from rank {src} (pipeline stage {stage})")
        work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        COUNTER.record("recv", buf, "pp", "bwd" if backward else "fwd")
        return buf

    def _send(self, t: Transfer, mb: int, backward: bool, value: torch.Tensor, works: list) -> None:
        dst = self.peer(t.src if backward else t.dst)
        value = value.detach().contiguous()
        if tuple(value.shape) != tuple(t.shape) or value.dtype != t.dtype:
            raise RuntimeError(
                f"pipeline rank {self.my_rank}: the {'gradient' if backward else 'activation'} of transfer {t.index} "
                f"({t.value}), microbatch {mb}, is {tuple(value.shape)} {value.dtype} but its peer expects "
                f"{tuple(t.shape)} {t.dtype}; the stage split disagrees with the plan (make a new plan)")
        if dst == self.my_rank:
            self._mailbox[(t.index, mb, backward)] = value
            return
        COUNTER.record("send", value, "pp", "bwd" if backward else "fwd")
        stage = t.src if backward else t.dst
        works.append((dist.isend(value, dst=dst, tag=t.tag(mb, backward, len(self.transfers))), value,
                      dict(peer=dst, detail=f"{_what(t, mb, backward)} to rank {dst} (pipeline stage {stage})")))

    def run(self, tensor_of, microbatches: list[tuple[list, object]], scale: float, train: bool = True) -> list:
        """Run every action of this rank; returns the last stage's per-microbatch results."""
        pp_rank = self.schedule.rank_of(next(iter(self.stages)))
        rank_actions = self.schedule.actions[pp_rank]
        self._by_index = {t.index: t for t in self.transfers}
        self._receives = ReceiveWindow(self._sent_to(pp_rank, train))
        self._posted = {}
        self._post(self._receives.start())
        pending: dict[tuple[int, int], _Pending] = {}
        results: dict[int, object] = {}
        works: list = []
        last = self.schedule.num_stages - 1
        for a in rank_actions:
            if a.kind == "B" and not train:
                continue
            call = self.stages[a.stage]
            if a.kind == "F":
                self._forward(a, call, tensor_of, microbatches, pending, results, works, train, a.stage == last)
            else:
                self._backward(a, call, pending, scale, works, a.stage == last)
        for w, _, op in works:
            note("p2p send", **op)
            w.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        self._mailbox.clear()
        return [results[i] for i in sorted(results)]

    def _forward(self, a: Action, call: StageCall, tensor_of, microbatches, pending, results, works, train, is_last):
        inputs, target = microbatches[a.microbatch]
        leaves = []
        for t in call.graph.recvs:
            x = self._recv(t, a.microbatch, False)
            if train and t.floating:
                x = x.detach().requires_grad_(True)
            leaves.append(x)
        args = self._arg_values(call, tensor_of, inputs, target) + leaves
        with bound_axes(self.axes), torch.set_grad_enabled(train):
            outs = call.runs[train](*args)
        for t in call.graph.sends:
            self._send(t, a.microbatch, False, outs[call.graph.send_index[t.value]], works)
        if is_last:
            n = len(call.graph.send_index)
            if train:
                results[a.microbatch] = outs[call.graph.results[self.loss_result]].detach()
            else:
                results[a.microbatch] = outs[n:]
        if train:
            pending[(a.stage, a.microbatch)] = _Pending(leaves, outs)

    def _backward(self, a: Action, call: StageCall, pending, scale: float, works, is_last: bool):
        p = pending.pop((a.stage, a.microbatch))
        roots, grads = [], []
        if is_last:
            loss = p.outs[call.graph.results[self.loss_result]]
            roots.append(loss)
            grads.append(torch.full_like(loss, scale))
        for t in call.graph.sends:
            if not t.floating:
                continue
            g = self._recv(t, a.microbatch, True)
            out = p.outs[call.graph.send_index[t.value]]
            if out.requires_grad:
                roots.append(out)
                grads.append(g)
        if roots:
            with bound_axes(self.axes):
                torch.autograd.backward(roots, grads)
        for t, leaf in zip(call.graph.recvs, p.leaves):
            if t.floating:
                g = leaf.grad if leaf.grad is not None else torch.zeros(t.shape, dtype=t.dtype)
                self._send(t, a.microbatch, True, g, works)


def _what(t: Transfer, mb: int, backward: bool) -> str:
    return f"of the {'gradient' if backward else 'activation'} of transfer {t.index} ({t.value}), microbatch {mb},"
