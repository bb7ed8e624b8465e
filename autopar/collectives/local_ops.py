"""Local implementations of ops whose sharded form needs more than the op on local pieces.

Each takes the aten op's own arguments plus ``_axes`` ({role: [mesh axis names]}):
vocab-parallel embedding and cross entropy (Megatron), batch-split losses that divide by
the global count, batch norm with statistics synced over the batch axes, and sequence-split
attention (``attention_cp.py``: all-gather K/V or ring). The collectives
each runs are described in ``autopar/sharding/local_impls.py`` (the plan's list and its cost):
change both together (``tests/ranks/test_local_impls.py`` counts them).
"""
from __future__ import annotations

import torch
from torch.ops import aten

from autopar.collectives import comm, moe_dispatch
from autopar.collectives.attention_cp import attention_gather, attention_ring
from autopar.collectives.groups import axis as _axis


def piece_index(axes: list[str]) -> int:
    """Index of this rank's piece of a dim split over ``axes`` (first axis outermost)."""
    idx = 0
    for name in axes:
        ax = _axis(name)
        idx = idx * ax.size + ax.rank
    return idx


def scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


# ---- embedding ---------------------------------------------------------------------------

def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False, *, _op, _axes):
    """Vocab-parallel lookup: ids outside this rank's rows give zeros (output is Partial)."""
    rows = weight.shape[0]
    start = piece_index(_axes["vocab"]) * rows
    mask = (indices >= start) & (indices < start + rows)
    local = torch.where(mask, indices - start, torch.zeros_like(indices))
    pad = padding_idx - start if 0 <= padding_idx - start < rows else -1
    out = aten.embedding.default(weight, local, pad, scale_grad_by_freq, sparse)
    return out * mask.unsqueeze(-1).to(out.dtype)


# ---- losses --------------------------------------------------------------------------------

class _VocabParallelCE(torch.autograd.Function):
    """Per-row cross entropy of logits split over the class dim (Megatron; no backward collectives).

    Global log-sum-exp from the local ones: ``M = max_r lse_r``, ``lse = M + log sum_r exp(lse_r - M)``;
    the target's logit comes from the rank holding it. Two all-reduces of per-row values (max,
    then the sums stacked). The saved softmax becomes the gradient in place, as in Megatron.
    """

    @staticmethod
    def forward(ctx, logits, target, ignore_index, axes):
        x = logits.detach()
        n_local = x.shape[-1]
        lse_local = torch.logsumexp(x, dim=-1)
        m = lse_local
        for a in axes:
            m = comm.all_reduce_value(m, a, "max")
        start = piece_index(axes) * n_local
        valid = target != ignore_index
        mine = (target >= start) & (target < start + n_local) & valid
        local_t = torch.where(mine, target - start, torch.zeros_like(target))
        picked = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * mine.to(x.dtype)
        sums = torch.stack([(lse_local - m).exp(), picked])
        for a in axes:
            sums = comm.all_reduce_value(sums, a)
        lse = m + sums[0].log()
        loss = (lse - sums[1]) * valid.to(x.dtype)
        softmax = torch.sub(x, lse.unsqueeze(-1)).exp_()
        ctx.save_for_backward(softmax, local_t, mine, valid)
        return loss

    @staticmethod
    def backward(ctx, g):
        grad, local_t, mine, valid = ctx.saved_tensors
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        grad.mul_((g * valid.to(g.dtype)).unsqueeze(-1))
        return grad, None, None, None


def _global_sum(x: torch.Tensor, axes: list[str]) -> torch.Tensor:
    for a in axes:
        x = comm.all_reduce_value(x, a)
    return x


def cross_entropy_loss(input, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0, *,
                       _op, _axes):
    """Batch split: local sum over the GLOBAL count (Partial). Vocab split: Megatron's loss."""
    batch, vocab = _axes.get("batch", []), _axes.get("vocab", [])
    if vocab:
        per_row = _VocabParallelCE.apply(input, target, ignore_index, tuple(vocab))
        if reduction == 0:
            return per_row
        total = per_row.sum()
        if reduction == 2:
            return total
        count = _global_sum((target != ignore_index).sum().to(per_row.dtype), batch)
        return total / count
    if _op == "cross_entropy_loss":
        per_row = aten.cross_entropy_loss.default(input, target, weight, 0, ignore_index, label_smoothing)
    else:
        per_row = aten.nll_loss.default(input, target, weight, 0, ignore_index)
    if reduction == 0:
        return per_row
    total = per_row.sum()
    if reduction == 2:
        return total
    valid = target != ignore_index
    if weight is not None:
        safe = torch.where(valid, target, torch.zeros_like(target))
        denom = (weight[safe] * valid.to(weight.dtype)).sum()
    else:
        denom = valid.sum().to(per_row.dtype)
    return total / _global_sum(denom.detach(), batch)


nll_loss = cross_entropy_loss


# ---- batch norm ----------------------------------------------------------------------------

def _synced_sum(x: torch.Tensor, axes: list[str]) -> torch.Tensor:
    """Sum over the axes, used split afterwards: all-reduce forward, all-reduce of the grad."""
    for a in axes:
        x = comm.grad_all_reduce(comm.all_reduce(x, a), a)
    return x


def batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled=False, *,
               _op, _axes):
    """Batch norm whose batch statistics are those of the GLOBAL batch (SyncBatchNorm)."""
    axes = _axes.get("sync", [])
    if not training or not axes:
        return aten.batch_norm.default(input, weight, bias, running_mean, running_var, training, momentum, eps,
                                       cudnn_enabled)
    dims = [0] + list(range(2, input.dim()))
    shape = [1, -1] + [1] * (input.dim() - 2)
    count = float(input.numel() // input.shape[1])
    for a in axes:
        count *= _axis(a).size
    mean = _synced_sum(input.sum(dims), axes) / count
    centered = input - mean.view(shape)
    var = _synced_sum((centered * centered).sum(dims), axes) / count
    out = centered * torch.rsqrt(var + eps).view(shape)
    if weight is not None:
        out = out * weight.view(shape)
    if bias is not None:
        out = out + bias.view(shape)
    if running_mean is not None:
        with torch.no_grad():
            m = 0.1 if momentum is None else momentum
            running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
            running_var.mul_(1 - m).add_(var.detach() * (count / max(count - 1, 1)), alpha=m)
    return out


# family -> the function that replaces the op (``passes/insert_collectives._apply_local``)
IMPLS = {"embedding": embedding, "loss": cross_entropy_loss, "batch_norm": batch_norm, "moe": moe_dispatch.moe_experts,
         "attn_gather": attention_gather, "attn_ring": attention_ring}
# ops that never run as themselves in a per-rank program (no autograd of their own): op -> family.
# ``passes/insert_collectives.py`` swaps every node of these for ``IMPLS[family]``, with or without roles.
ALWAYS_LOCAL = {torch.ops.autopar.moe_experts.default: "moe"}
# family -> the local rescale that follows the op itself (a mean over a split dim)
RESCALES = {"mean": scale}
