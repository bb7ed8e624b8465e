"""AUTO's search time with and without its context-parallel candidates (issue 35 part 4).

``python bench/cp_search_time.py``: each job planned by AUTO with ``solver/cp_candidates.py``'s
meshes and with them switched off (``search.cp_meshes`` replaced by a function returning none),
alternately, after one warm-up plan; wall and process CPU seconds of each ``autopar.plan`` call,
the chosen mesh, degrees and predicted step."""
from __future__ import annotations

import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
import autopar.solver.search as search
from autopar.solver.cp_candidates import cp_meshes


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(c, -1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


JOBS = {   # name: (vocab, hidden, heads, layers, seq, batch, mesh)
    "cpu-row": (64, 32, 1, 1, 2048, 1, lambda: autopar.Mesh(4)),
    "h100-long": (32000, 512, 8, 2, 8192, 2, lambda: autopar.Mesh(8, device="h100")),
}


def run(name: str) -> None:
    vocab, d, heads, layers, seq, batch, mesh = JOBS[name]
    with torch.device("meta"):
        model = GPT(vocab, d, heads, layers, seq)
    x, y = torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))
    for label in ("warm-up", "without cp", "with cp", "without cp", "with cp"):
        search.cp_meshes = (lambda traced, m: []) if label == "without cp" else cp_meshes
        w, c = time.perf_counter(), time.process_time()
        plan = autopar.plan(model, mesh(), example_inputs=(x,), loss_fn=loss, example_target=y)
        w, c = time.perf_counter() - w, time.process_time() - c
        print(f"{name:<10} {label:<11} wall {w:6.1f} s  cpu {c:6.1f} s  {plan.mesh}  "
              f"{plan.degrees}  "
              f"step {plan.step_time * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    for job in sys.argv[1:] or list(JOBS):
        run(job)
