"""The report's sequence-parallel line for norms written from ops (Hugging Face's ``LlamaRMSNorm``
and ``examples.models.RMSNorm``: pow, mean, rsqrt, mul), not only for ``layer_norm`` / ``rms_norm`` ops."""
from __future__ import annotations

import torch

import autopar
from autopar import Shard
from autopar.report.sequence_parallel import sequence_parallel
from examples.models import Llama, lm_loss


def _plan(sp: bool):
    autopar.clear_annotations()
    autopar.reset_auto_parallel_context()
    autopar.set_auto_parallel_context(recompute="none", accumulation=1, zero=0)
    for w in ("wq", "wk", "wv", "w1", "w3"):
        autopar.shard(f"layers.*.{w}", weight={"tp": Shard(0)})
    for w in ("wo", "w2"):
        autopar.shard(f"layers.*.{w}", weight={"tp": Shard(1)})
    if sp:
        autopar.op_strategy("layers.*.*_norm", tp="S1")
    x = torch.randint(0, 128, (2, 16))
    try:
        return autopar.plan(Llama(), autopar.Mesh(2, axis_names=("tp",), device="h100"), example_inputs=(x,),
                            loss_fn=lm_loss, example_target=x, mode="semi_auto")
    finally:
        autopar.clear_annotations()
        autopar.reset_auto_parallel_context()


def test_decomposed_rms_norms_split_along_the_sequence_are_reported():
    plan = _plan(sp=True)
    norms = [d for d in plan.nodes.values() if d.module.endswith("_norm") and "mean" in d.op]
    assert norms and all(str(d.output) == "[S(1)]" for d in norms), [str(d.output) for d in norms]
    assert sequence_parallel(plan)["tp"][:2] == ["layers.*.attn_norm", "layers.*.ffn_norm"]
    assert "sequence parallel (sp) on tp" in plan.report()
    assert sequence_parallel(_plan(sp=False)) == {}
