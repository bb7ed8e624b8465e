"""Tiny Hugging Face language models built from configs (no download), returning logits only.

The builders live in examples/hf_zoo.py (the model zoo, docs/zoo.md); these names are kept for the
tests that import them from here."""
from examples.hf_zoo import LogitsOnly, bert, gpt2, llama, lm_loss

__all__ = ["LogitsOnly", "bert", "gpt2", "llama", "lm_loss"]
