"""Cost of one ``autopar::moe_experts`` node (``frontend/moe_experts.py``): work, saved bytes, the
per-rank cost under a sharding strategy, and the load-imbalance factor of expert parallelism.

The op runs ``T`` token rows (``hidden [T, H]``) through ``k`` of ``E`` experts each (``top_k_index
[T, k]``); every parameter has the expert dimension first, so one expert holds ``n_e = sum(numel /
E)`` parameters and each routed row costs ``2 n_e`` FLOPs forward (one multiply-add per weight: the
expert's matmuls; biases add ``n_e``'s small rest)::

    flops_fwd  = 2 T k n_e                        (the weighted combine's T k H is left out: < 1 %)
    flops_bwd  = flops_fwd x (hidden needs a gradient + the parameters need one)   (dgrad, wgrad)
    matmuls    the expert GEMMs by their smallest dimension min(rows per expert, H, n_e / H), with
               rows per expert = T k / E: a grouped GEMM of few rows per expert runs far below peak
               (``DeviceSpec.matmul_eff``), which is why splitting tokens over data-parallel ranks
               while keeping every expert (``moe:batch``) costs more per FLOP than ``moe:ep``
    bytes      the parameters once, the gathered, intermediate and output rows (T k (2 H + 2 n_e / H))
    kernels    6 + 4 E forward, twice that backward (routing, permutation, one GEMM group per expert);
               a rank holding E_local of the experts (split on "ep"/"experts" axes) launches 6 + 4 E_local,
               plus each ep hop's dispatch (``dispatch_kernels``: 18 forward, 9 backward)

Per rank under a strategy (``moe_split_cost``): the work divided by the strategy's ``work_split``
(tokens split on "batch"/"ep" axes, experts split on "ep"/"experts" axes, each expert's intermediate
dim on "etp" axes), its GEMMs at the local rows per expert ``T k / E / prod(axes that split tokens
but not experts)`` ("ep" moves each expert's rows to its rank: the rows per expert stay those of the
whole axis) and at the intermediate dim over the "etp" degree. An "etp" output is Partial: its sum
(all-reduce, or reduce-scatter where the consumer is split) and the all-reduce of the hidden rows'
and routing weights' gradients are the edges' collectives, costed like any tensor-parallel MLP's.

**Load imbalance.** Where the experts are split (local roles "ep" or "experts", ``sharding/rules/
moe.py``), the busiest rank sets the pace: its expert compute and its all-to-all bytes are the mean
times ``imbalance`` (``set_auto_parallel_context(moe_imbalance=...)``, default ``DEFAULT_IMBALANCE``).
Switch Transformer (Fedus et al., 2021, section 2.2) trains at expert capacity factors 1.0 to 1.25,
the cap on this ratio when overflowing tokens are dropped; Megatron-Core's capacity is
``tokens x topk x capacity_factor / experts`` with 1.0 recommended early in training and dropless
(no cap) after. 1.1 sits inside that range for a trained router; 1.0 models perfect balance.

**Saved for backward** (``moe_saved``): the three inputs, the parameters (a gathered copy when taken
in another placement) and, per routed row, the gathered input, the expert's intermediate and its
output (``T k (2 H + n_e / H)`` elements) plus the dispatch and combine buffers of the tokens
(``2 T k H``); divided per rank like the node's other internals (``strategy_prices.local_saved``).
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from autopar.graph.grads import grad_nodes, is_parameter

MOE_OP = "autopar::moe_experts"
DEFAULT_IMBALANCE = 1.1
EXPERT_SPLIT_ROLES = ("ep", "experts")      # local roles that keep the experts split on an axis


def is_moe(node: fx.Node) -> bool:
    """Whether ``node`` calls ``autopar::moe_experts``."""
    target = getattr(node, "target", None)
    name = getattr(target, "name", None)
    return node.op == "call_function" and callable(name) and isinstance(target, torch._ops.OpOverload) \
        and target.name() == MOE_OP


def check_imbalance(value) -> None:
    """``moe_imbalance`` is a number >= 1 (the busiest expert rank's load over the mean)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 1:
        raise ValueError(f"moe_imbalance must be a number >= 1 (the busiest expert-parallel rank's routed tokens "
                         f"over the mean; 1.0 = perfect balance), got {value!r}")


class MoeShape:
    """The sizes of one moe_experts node: T, H, k, E, n_e (parameters per expert), the parameter nodes."""

    def __init__(self, node: fx.Node):
        hidden, index = node.args[1], node.args[2]
        self.params = [p for p in node.args[4] if isinstance(p, fx.Node)]
        h, idx = hidden.meta["val"], index.meta["val"]
        self.hidden, self.dtype = hidden, h.dtype
        self.tokens, self.width = int(h.shape[0]), int(h.shape[-1])
        self.top_k = int(idx.shape[-1])
        vals = [p.meta["val"] for p in self.params]
        self.experts = int(vals[0].shape[0]) if vals else 1
        self.per_expert = sum(v.numel() for v in vals) / max(1, self.experts)
        self.param_bytes = sum(v.numel() * v.element_size() for v in vals)
        self.itemsize = h.element_size()

    @property
    def rows(self) -> int:
        """Routed rows: T k."""
        return self.tokens * self.top_k

    @property
    def inner(self) -> float:
        """Intermediate elements per routed row (the expert's parameters over H: 3F for a gated FFN)."""
        return self.per_expert / max(1, self.width)

    def gemm_dim(self, rows_per_expert: float, inner_split: int = 1) -> int:
        """The smallest GEMM dimension: rows per expert, H, or the narrowest expert matrix (its
        intermediate dim over ``inner_split``, the expert tensor parallel degree)."""
        return max(1, int(min(rows_per_expert, self.width, max(1.0, self.inner / 3 / inner_split))))


def moe_work_numbers(node: fx.Node) -> dict:
    """Work of a moe_experts node (module docstring) as ``compute.OpWork``'s fields."""
    s = MoeShape(node)
    need = grad_nodes(node.graph)
    mm = 2.0 * s.rows * s.per_expert
    grads = int(s.hidden in need) + int(any(p in need and is_parameter(p) for p in s.params))
    dim = s.gemm_dim(s.rows / s.experts)
    moved = float(s.param_bytes + s.rows * (2 * s.width + 2 * s.inner) * s.itemsize)
    kernels = moe_kernels(s.experts)
    return dict(flops_fwd=mm, flops_bwd=mm * grads,
                bytes_fwd=moved, bytes_bwd=2 * moved if grads else 0.0,
                kernels_fwd=kernels, kernels_bwd=2 * kernels if grads else 0,
                matmuls_fwd=((dim, mm),), matmuls_bwd=((dim, mm * grads),) if grads else ())


def moe_kernels(experts: int) -> int:
    """Kernels of one forward over ``experts`` experts (routing and permutation, one GEMM group per expert);
    a rank holding ``E_local`` of them launches ``moe_kernels(E_local)`` (``solver/moe_costs.py``)."""
    return 6 + 4 * experts


# Counted with a dispatch mode on the runtime (2 gloo ranks; views, allocations and the all-to-alls left out, the
# experts module's own kernels apart): forward 11 for the "experts" role and 11 + 18 for one ep hop; backward the
# pre-de-duplication charge (3 + 3 experts, 3 + 8 ep) moved by the measured change (0 and +4)
DISPATCH_BWD_KERNELS = 9     # one ep hop's backward: the combine's gather, the bundle gathers' scatters, the casts
SPLIT_KERNELS = (11, 6)      # a rank with split experts, forward / backward: the bundles' [hidden, weights] cat, the
                             # mask of its own (bundle, k) pairs (ge, lt, and, nonzero), their gathers (3), local ids,
                             # the per-bundle k-sum (zeros, index_add) (moe_dispatch.moe_experts); backward their scatters
KEEP_KERNELS = (0, 0)        # the "experts" role: the same mask of the rank's own pairs, nothing more


def dispatch_kernels(ranks: int) -> int:
    """Kernels of one ep hop's dispatch and combine forward over an axis of ``ranks`` (``collectives/
    moe_dispatch.py``; its all_to_alls are costed as collectives): the bundles' destinations (ones, the
    digits, where, zeros, scatter, nonzero, sort, gathers), the counts' bincount, the bundles' and their ids'
    gathers and casts, the combine's zeros and index_add: 18, whatever ``ranks`` (a later hop adds the
    digits already reached, left out)."""
    return 18


def expert_split_axes(local: tuple, mesh_shape) -> list[int]:
    """Axes (size > 1) on which a moe strategy keeps the experts split (roles "ep", "experts")."""
    return [a for a, loc in enumerate(local) if loc and loc.split(":")[0] == "moe"
            and loc.split(":")[-1] in EXPERT_SPLIT_ROLES and mesh_shape[a] > 1]


def etp_split(local: tuple, mesh_shape) -> int:
    """The expert tensor parallel degree of a moe strategy: the product of the axes where it is "etp"."""
    out = 1
    for a, loc in enumerate(local):
        if loc and loc.split(":")[0] == "moe" and loc.split(":")[-1] == "etp":
            out *= mesh_shape[a]
    return out


def local_rows_per_expert(node: fx.Node, inputs: tuple, mesh_shape) -> float:
    """Rows each expert's GEMM gets on one rank: T k / E over the axes that split the tokens
    (hidden not Replicate) but not the experts (the first parameter not Shard(0))."""
    from autopar.sharding.placements import Replicate, Shard

    s = MoeShape(node)
    hidden, first = inputs[0], (inputs[3] if len(inputs) > 3 else None)
    cut = 1
    for a, n in enumerate(mesh_shape):
        tokens = not isinstance(hidden[a], Replicate)
        experts = first is not None and isinstance(first[a], Shard) and first[a].dim == 0
        if tokens and not experts:
            cut *= n
    return s.rows / s.experts / cut


def moe_saved_internal(node: fx.Node) -> int:
    """Bytes the op keeps per step besides its inputs (module docstring)."""
    s = MoeShape(node)
    return int(s.rows * (2 * s.width + s.inner + 2 * s.width) * s.itemsize)


def moe_save_rule(node: fx.Node) -> list:
    """What the op keeps for backward (``save_rules`` form): its inputs, its parameters and one
    ``Internal`` of ``moe_saved_internal`` bytes."""
    from autopar.cost_models.save_rules import Internal

    ins = [a for a in node.args[1:4] if isinstance(a, fx.Node)]
    return ins + MoeShape(node).params + [Internal(f"{node.name}.routed", moe_saved_internal(node))]
