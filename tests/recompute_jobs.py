"""Helpers shared by tests/ranks/test_recompute.py and tests/unit/test_recompute_costs.py."""
from __future__ import annotations

import dataclasses
import functools

from autopar.plan.plan import MemoryOptions
from examples.models import GPT
from oracle import make_batch


DEVICE = "a100-80gb"
VOCAB, SEQ = 64, 8
gpt = functools.partial(GPT, vocab=VOCAB, hidden=16, heads=2, layers=2, seq=SEQ, qkv_bias=False)


def _tokens(batch=8, seq=SEQ):
    return make_batch("tokens", batch, vocab=VOCAB, seq=seq)


def _with(plan, recompute):
    return dataclasses.replace(plan, memory_options=MemoryOptions(recompute=recompute))
