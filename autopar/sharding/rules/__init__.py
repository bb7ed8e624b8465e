"""One file per op family; importing this package registers every rule, and answers lookups."""
from __future__ import annotations

import torch.fx as fx

from autopar.sharding.registry import rule_for
from autopar.sharding.rules import (  # noqa: F401
    attention, conv, embedding, loss, matmul, moe, norm, pointwise, reduction, routing, scatter, views,
)
from autopar.sharding.strategy import AxisStrategy


def has_rule(target) -> bool:
    return rule_for(target) is not None


def axis_options(node: fx.Node) -> list[AxisStrategy]:
    """Candidate strategies of ``node`` along one mesh axis ([] = replicate only)."""
    rule = rule_for(node.target)
    return rule(node) if rule else []
