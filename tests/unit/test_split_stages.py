"""split_stages on its own: stage graphs chained by hand compute what the whole graph computes."""
from __future__ import annotations

import torch
import torch.nn as nn

import autopar
from autopar.passes.split_stages import split_stages
from autopar.frontend.trace import trace


class CosTable(nn.Module):
    """A no-grad table from a buffer and an ``arange`` (like rotary embeddings): torch.export
    keeps it as ``wrap_with_set_grad_enabled`` calling a submodule of the graph module."""

    def __init__(self, d: int):
        super().__init__()
        self.register_buffer("freq", torch.arange(d) / d, persistent=False)

    @torch.no_grad()
    def forward(self, h):
        return (torch.arange(h.shape[1], dtype=torch.float32)[:, None] * self.freq).cos()


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.linear = nn.Linear(d, d)

    def forward(self, h, c):
        return h + torch.tanh(self.linear(h * c))


class TableNet(nn.Module):
    """Every block uses the table made before the first: a value of stage 0 used by all stages."""

    def __init__(self, layers: int = 3, d: int = 16, vocab: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.table = CosTable(d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        h = self.emb(idx)
        c = self.table(h)
        for block in self.blocks:
            h = block(h, c)
        return self.head(h)


def _loss(logits, y):
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _graph_inputs(traced, model, x, y) -> dict:
    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    vals = {ph: named[n] for ph, n in {**traced.params, **traced.buffers}.items()}
    vals.update(traced.constants)
    vals.update({ph: x for ph in traced.inputs})
    vals[traced.target] = y
    return vals


def test_stage_graphs_keep_the_submodules_their_nodes_call():
    """The graph's ``get_attr`` of the no-grad submodule was left out of the stage graph
    (KeyError: 'submod_3' for every pipelined plan of a Hugging Face Llama)."""
    torch.manual_seed(0)
    model = TableNet()
    x, y = torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))
    autopar.set_auto_parallel_context(microbatches=1, schedule="gpipe")
    plan = autopar.plan(model, autopar.Mesh((3,), axis_names=("pp",)), example_inputs=(x,), loss_fn=_loss,
                        example_target=y, mode="auto")
    traced = trace(model, (x,), _loss, y)
    assert any(n.op == "get_attr" for n in traced.gm.graph.nodes)
    vals = _graph_inputs(traced, model, x, y)
    placeholders = [n.name for n in traced.gm.graph.nodes if n.op == "placeholder"]
    want = traced.gm(*[vals[p] for p in placeholders])[traced.loss_index]
    stage_of = {n: st.index for st in plan.stages for n in st.nodes}
    graphs, transfers = split_stages(traced.gm, stage_of, 3, plan, plan.mesh.shape)
    assert {(t.src, t.dst) for t in transfers} >= {(0, 1), (0, 2)}
    for g in graphs:
        outs = g.gm(*[vals[p] for p in g.placeholders], *[vals[t.value] for t in g.recvs])
        vals.update({t.value: outs[g.send_index[t.value]] for t in g.sends})
    got = outs[graphs[-1].results[traced.loss_index]]
    assert torch.equal(got, want)
