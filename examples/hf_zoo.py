"""Tiny Hugging Face ``transformers`` models built from configs (nothing downloaded), ready for autopar.

``hf_model(name, **overrides)`` returns a :class:`ZooModel`: the module wrapped to return one tensor
(the logits), its example inputs (positional and keyword), the loss and an example target. It picks
the settings a traced training step needs: ``use_cache=False`` (no key/value cache among the
outputs), every dropout at 0 (a random mask would differ between one device and the ranks), and
``attn_implementation="eager"`` (plain matmul + softmax, which every strategy rule knows).
``overrides`` go to the model's config (``hf_model("llama", num_hidden_layers=1)``).

autopar itself does not depend on ``transformers``; this module does (``pip install transformers``).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

NAMES = ("gpt2", "bert", "llama", "mistral", "t5", "vit", "cnn")
VOCAB, SEQ, HIDDEN, CLASSES = 128, 16, 64, 4


class Logits(torch.nn.Module):
    """A Hugging Face model returning only ``.logits`` (autopar's programs return tensors)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs).logits


class LogitsOnly(Logits):
    """A causal or masked language model called on token ids alone (``model(idx)``)."""

    def forward(self, idx):
        return self.inner(input_ids=idx).logits


class ZooModel(NamedTuple):
    module: torch.nn.Module
    inputs: tuple[tuple, dict]      # (positional args, keyword args) of module.forward
    loss_fn: Callable
    target: torch.Tensor


def lm_loss(logits, y):
    """Token-level cross entropy: logits (batch, seq, vocab), targets (batch, seq)."""
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


_COMMON = dict(use_cache=False, attn_implementation="eager", bos_token_id=0, eos_token_id=0, pad_token_id=0)


def gpt2_config(layers: int = 2, **overrides):
    from transformers import GPT2Config

    kw = dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=layers, n_head=4, n_positions=32, resid_pdrop=0.0,
              embd_pdrop=0.0, attn_pdrop=0.0, **_COMMON)
    return GPT2Config(**{**kw, **overrides})


def llama_config(layers: int = 2, **overrides):
    from transformers import LlamaConfig

    kw = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=4,
              num_key_value_heads=4, intermediate_size=128, max_position_embeddings=32, **_COMMON)
    return LlamaConfig(**{**kw, **overrides})


def mistral_config(layers: int = 2, **overrides):
    from transformers import MistralConfig

    kw = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=128, max_position_embeddings=32, sliding_window=8,
              **_COMMON)
    return MistralConfig(**{**kw, **overrides})


def bert_config(layers: int = 2, **overrides):
    from transformers import BertConfig

    kw = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=4,
              intermediate_size=128, max_position_embeddings=32, hidden_dropout_prob=0.0,
              attention_probs_dropout_prob=0.0, classifier_dropout=0.0, num_labels=CLASSES, **_COMMON)
    return BertConfig(**{**kw, **overrides})


def t5_config(layers: int = 1, **overrides):
    from transformers import T5Config

    kw = dict(vocab_size=VOCAB, d_model=HIDDEN, d_kv=16, d_ff=128, num_layers=layers, num_decoder_layers=layers,
              num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0,
              **_COMMON)
    return T5Config(**{**kw, **overrides})


def vit_config(layers: int = 1, **overrides):
    from transformers import ViTConfig

    kw = dict(image_size=8, patch_size=4, num_channels=3, hidden_size=HIDDEN, num_hidden_layers=layers,
              num_attention_heads=4, intermediate_size=128, hidden_dropout_prob=0.0,
              attention_probs_dropout_prob=0.0, num_labels=CLASSES, attn_implementation="eager")
    return ViTConfig(**{**kw, **overrides})


def gpt2(layers: int = 2, **overrides) -> LogitsOnly:
    from transformers import GPT2LMHeadModel

    return LogitsOnly(GPT2LMHeadModel(gpt2_config(layers, **overrides)))


def llama(layers: int = 2, **overrides) -> LogitsOnly:
    from transformers import LlamaForCausalLM

    return LogitsOnly(LlamaForCausalLM(llama_config(layers, **overrides)))


def mistral(layers: int = 2, **overrides) -> LogitsOnly:
    from transformers import MistralForCausalLM

    return LogitsOnly(MistralForCausalLM(mistral_config(layers, **overrides)))


def bert(layers: int = 2, **overrides) -> LogitsOnly:
    """BERT masked language model (token ids in, per-token logits out)."""
    from transformers import BertForMaskedLM

    return LogitsOnly(BertForMaskedLM(bert_config(layers, **overrides)))


def bert_classifier(layers: int = 2, **overrides) -> Logits:
    from transformers import BertForSequenceClassification

    return Logits(BertForSequenceClassification(bert_config(layers, **overrides)))


def t5(layers: int = 1, **overrides) -> Logits:
    from transformers import T5ForConditionalGeneration

    return Logits(T5ForConditionalGeneration(t5_config(layers, **overrides)))


def vit(layers: int = 1, **overrides) -> Logits:
    from transformers import ViTForImageClassification

    return Logits(ViTForImageClassification(vit_config(layers, **overrides)))


def cnn(**overrides) -> torch.nn.Module:
    """Our torchvision-free CNN (conv, batch norm, pooling, linear; examples/models.py)."""
    from examples.models import CNN

    return CNN(**overrides)


def _tokens(g, batch, vocab=VOCAB, seq=SEQ):
    return torch.randint(1, vocab, (batch, seq), generator=g)


def example_batch(name: str, batch: int = 4, seed: int = 1) -> tuple[tuple, dict, torch.Tensor]:
    """(args, kwargs, target) of one global batch for ``name``, the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    if name in ("gpt2", "llama", "mistral"):
        return (_tokens(g, batch),), {}, _tokens(g, batch)
    if name == "bert":
        ids = _tokens(g, batch)
        mask = torch.ones(batch, SEQ, dtype=torch.long)
        mask[:, -3:] = 0                                   # the last three tokens are padding
        ids[:, -3:] = 0
        return (ids,), {"attention_mask": mask}, torch.randint(0, CLASSES, (batch,), generator=g)
    if name == "t5":
        ids, dec = _tokens(g, batch), _tokens(g, batch, seq=SEQ // 2)
        mask = torch.ones(batch, SEQ, dtype=torch.long)
        mask[:, -2:] = 0
        kwargs = {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec}
        return (), kwargs, _tokens(g, batch, seq=SEQ // 2)
    if name == "vit":
        return (torch.randn(batch, 3, 8, 8, generator=g),), {}, torch.randint(0, CLASSES, (batch,), generator=g)
    if name == "cnn":
        return (torch.randn(batch, 3, 8, 8, generator=g),), {}, torch.randint(0, 10, (batch,), generator=g)
    raise ValueError(f"unknown zoo model {name!r}: choose one of {', '.join(NAMES)}")


_BUILDERS = {"gpt2": (gpt2, lm_loss), "bert": (bert_classifier, F.cross_entropy), "llama": (llama, lm_loss),
             "mistral": (mistral, lm_loss), "t5": (t5, lm_loss), "vit": (vit, F.cross_entropy),
             "cnn": (cnn, F.cross_entropy)}


def hf_model(name: str, batch: int = 4, seed: int = 1, **overrides) -> ZooModel:
    """The zoo model ``name`` (one of NAMES) with its example batch, loss and target.

    ``overrides`` go to the config (``num_hidden_layers=1``); for ``cnn`` to ``CNN(...)``. The
    parameters come from the current torch seed (call ``torch.manual_seed`` first for a repeatable model).
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown zoo model {name!r}: choose one of {', '.join(NAMES)}")
    build, loss_fn = _BUILDERS[name]
    args, kwargs, target = example_batch(name, batch, seed)
    return ZooModel(build(**overrides), (args, kwargs), loss_fn, target)


# Megatron-style MLP split for SEMI_AUTO: the first linear of every MLP column-parallel (output
# features split), the second row-parallel (input features split). GPT-2's Conv1D stores its weight
# as (in, out), so its column split is dim 1. For the CNN: channel-parallel first convolution.
_MLP_SPLITS = {
    "gpt2": (("inner.transformer.h.*.mlp.c_fc", 1, True), ("inner.transformer.h.*.mlp.c_proj", 0, False)),
    "bert": (("inner.bert.encoder.layer.*.intermediate.dense", 0, True),
             ("inner.bert.encoder.layer.*.output.dense", 1, False)),
    "llama": (("inner.model.layers.*.mlp.gate_proj", 0, False), ("inner.model.layers.*.mlp.up_proj", 0, False),
              ("inner.model.layers.*.mlp.down_proj", 1, False)),
    "t5": (("inner.*.block.*.layer.*.DenseReluDense.wi", 0, False),
           ("inner.*.block.*.layer.*.DenseReluDense.wo", 1, False)),
    "vit": (("inner.vit.layers.*.mlp.fc1", 0, True), ("inner.vit.layers.*.mlp.fc2", 1, False)),
    "cnn": (("conv1", 0, False),),
}
_MLP_SPLITS["mistral"] = _MLP_SPLITS["llama"]


def annotate_tensor_parallel(name: str, axis: str = "tp") -> None:
    """SEMI_AUTO's annotations for zoo model ``name``: Megatron's column/row split of every MLP
    on mesh axis ``axis`` (``autopar.shard`` over module globs); the solver decides the rest."""
    import autopar

    if name not in _MLP_SPLITS:
        raise ValueError(f"unknown zoo model {name!r}: choose one of {', '.join(NAMES)}")
    for glob, dim, has_bias in _MLP_SPLITS[name]:
        placements = {"weight": {axis: autopar.Shard(dim)}}
        if has_bias:
            placements["bias"] = {axis: autopar.Shard(0)}
        autopar.shard(glob, axis=axis, **placements)
