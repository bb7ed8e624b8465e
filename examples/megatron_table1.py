"""The GPT configurations of Table 1 of Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM" (SC'21): A100-80GB, 8 per node, sequence 2048,
vocabulary 51200, mixed precision, activation recomputation, as published (the t, p used and the
measured TFLOP/s per GPU). Factories for ``autopar plan examples.megatron_table1:gpt_18_4b``
build each model on the meta device.
"""
from __future__ import annotations

from dataclasses import dataclass

from examples.factories import gpt

SEQ, VOCAB = 2048, 51200


@dataclass(frozen=True)
class Row:
    billions: float      # parameters, as the paper names the row
    heads: int
    hidden: int
    layers: int
    t: int               # tensor-parallel size
    p: int               # pipeline-parallel size
    gpus: int
    batch: int           # global batch (sequences)
    tflops: float        # measured TFLOP/s per GPU

    @property
    def d(self) -> int:
        """Data-parallel size."""
        return self.gpus // (self.t * self.p)

    @property
    def name(self) -> str:
        return "gpt_" + f"{self.billions:g}".replace(".", "_") + "b"


TABLE1 = [
    Row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    Row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    Row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    Row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    Row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    Row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    Row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    Row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    Row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    Row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def model_of(row: Row, batch: int | None = None):
    """(model, example_inputs, loss_fn, target) of a row, on the meta device."""
    return gpt(hidden=row.hidden, layers=row.layers, heads=row.heads, seq=SEQ, batch=batch or row.batch, vocab=VOCAB)


def paper_flops_per_step(row: Row) -> float:
    """The paper's count of FLOPs per iteration (its equation 3, with recomputation):
    96 B s l h^2 (1 + s / 6h + V / 16 l h)."""
    b, s, l, h, v = row.batch, SEQ, row.layers, row.hidden, VOCAB
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


for _row in TABLE1:
    globals()[_row.name] = (lambda r: lambda batch=None: model_of(r, batch))(_row)
