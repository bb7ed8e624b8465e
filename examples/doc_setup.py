"""The names the docs' code blocks take as given, built small enough to run on one CPU.

A block preceded by ``<!-- doc-test: setup NAME -->`` runs (tests/ranks/test_docs.py) in a fresh
namespace holding what ``NAME()`` here returns: a 2-layer GPT, its global batch, a loss and a
one-device mesh, and with ``trained`` a parallelized module and its optimizer as well.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import autopar
from examples.models import GPT, lm_loss


def gpt() -> dict:
    """``model``, ``x``, ``y``, ``loss``/``lm_loss``, ``mesh`` (``Mesh(1)``: no process group)."""
    torch.manual_seed(0)
    x = torch.randint(1, 128, (8, 16))
    y = torch.randint(0, 128, (8, 16))
    return {"torch": torch, "F": F, "autopar": autopar, "model": GPT(), "x": x, "y": y,
            "loss": lm_loss, "lm_loss": lm_loss, "mesh": autopar.Mesh(1)}


def trained() -> dict:
    """``gpt()`` plus ``pmodel`` (AUTO on the one-device mesh), ``opt`` (AdamW on its parameters) and
    ``micro_batches`` (3 global batches)."""
    ns = gpt()
    ns["pmodel"] = autopar.parallelize(ns["model"], ns["mesh"], example_inputs=(ns["x"],), loss_fn=lm_loss,
                                       example_target=ns["y"], mode="auto")
    ns["opt"] = torch.optim.AdamW(ns["pmodel"].parameters(), lr=1e-3)
    ns["micro_batches"] = [(ns["x"], ns["y"])] * 3
    return ns


SETUPS = {"gpt": gpt, "trained": trained}
