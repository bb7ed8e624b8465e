"""Placements per mesh axis: Shard(dim), Replicate(), Partial() — DTensor's vocabulary.

A tensor's *spec* is a tuple with one placement per mesh axis (axis 0 first).
``Shard(dim, chunks=k)`` views the dim as k equal blocks and shards each block over the
axis (rank r holds its piece of every block, in block order): this is how a fused QKV
projection is split so that ``split(..., 3)`` stays local (Megatron's fused layout).
``Shard(dim, chunks=k, zigzag=True)`` (k even; ``Z(dim)`` for k = 2) mirrors the odd blocks: rank
r of n holds piece r of the even blocks and piece n-1-r of the odd ones. ``Z(1)`` of a sequence is
the load-balanced (zig-zag) order of causal context parallelism: rank r holds chunks r and 2n-1-r
of 2n (``piece_of``; ``sharding/zigzag.py`` turns a cp axis's splits into it).

Gradient convention used by every pass and runtime collective: the gradient of a
``Shard`` tensor is sharded like it; the gradient of a ``Replicate`` or ``Partial``
tensor is held in full on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class Shard:
    dim: int
    chunks: int = 1
    zigzag: bool = False

    def __post_init__(self):
        if self.zigzag and (self.chunks < 2 or self.chunks % 2):
            raise ValueError(f"Shard({self.dim}, chunks={self.chunks}, zigzag=True): the zig-zag order mirrors every "
                             "second block, so it needs an even number of chunks (2 for a sequence)")

    def __str__(self) -> str:
        if self.zigzag:
            return f"Z({self.dim})" if self.chunks == 2 else f"Z({self.dim},{self.chunks})"
        return f"S({self.dim})" if self.chunks == 1 else f"S({self.dim},{self.chunks})"


def piece_of(rank: int, n: int, block: int, zigzag: bool) -> int:
    """Which of the ``n`` pieces of ``block`` rank ``rank`` holds (and, an involution, which rank
    holds piece ``rank`` of it): its own index, mirrored in the odd blocks of a zig-zag shard."""
    return n - 1 - rank if zigzag and block % 2 else rank


def zigzag_of(p):
    """The zig-zag form of a placement: ``Shard(d, k)`` becomes ``Shard(d, 2k, zigzag=True)`` (each
    block halved, the second half mirrored); others unchanged."""
    if isinstance(p, Shard) and not p.zigzag:
        return Shard(p.dim, 2 * p.chunks, True)
    return p


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    """Pending sum over the axis: the full value is the sum of the ranks' values."""

    def __str__(self) -> str:
        return "P"


Placement = Union[Shard, Replicate, Partial]


class Spec(tuple):
    """One placement per mesh axis (axis 0 first); a tuple that prints as ``[S(0),R]``.

    Plans hold Specs in memory; the string form is only for JSON and reports."""

    __slots__ = ()

    def __str__(self) -> str:
        return "[" + ",".join(str(p) for p in self) + "]"

    def __repr__(self) -> str:
        return f"Spec({str(self)!r})"

R = Replicate()
P = Partial()


def parse_placement(text: str) -> Placement:
    """Inverse of ``str(placement)``: "R", "P", "S(1)", "S(0,3)", "Z(1)", "Z(0,4)"."""
    t = text.strip()
    if t == "R":
        return R
    if t == "P":
        return P
    if t[:2] in ("S(", "Z(") and t.endswith(")"):
        parts = [int(v) for v in t[2:-1].split(",")]
        if t[0] == "Z":
            return Shard(parts[0], parts[1] if len(parts) > 1 else 2, True)
        return Shard(*parts)
    raise ValueError(f"cannot parse placement {text!r}; expected R, P, S(dim), S(dim,chunks), Z(dim) or Z(dim,chunks)")


def spec_str(spec) -> str:
    return "[" + ",".join(str(p) for p in spec) + "]"


def as_spec(value) -> Spec:
    """A Spec from a Spec, a tuple/list of placements, or its string form ("[S(0),R]")."""
    if isinstance(value, Spec):
        return value
    if isinstance(value, str):
        return parse_spec(value)
    if isinstance(value, (tuple, list)) and all(isinstance(p, (Shard, Replicate, Partial)) for p in value):
        return Spec(value)
    raise TypeError(f"{value!r} is not a placement spec; expected e.g. \"[S(0),R]\" or (Shard(0), Replicate())")


def replicated(ndim: int) -> Spec:
    """``[R,...,R]`` over a mesh of ``ndim`` axes."""
    return Spec((R,) * ndim)


def parse_spec(text: str) -> Spec:
    t = text.strip()
    if not (t.startswith("[") and t.endswith("]")):
        raise ValueError(f"cannot parse placement spec {text!r}; expected e.g. \"[S(0),R]\" (one placement per mesh axis)")
    inner = t[1:-1]
    out, depth, cur = [], 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            out.append(parse_placement(cur))
            cur = ""
            continue
        depth += ch == "("
        depth -= ch == ")"
        cur += ch
    if cur:
        out.append(parse_placement(cur))
    return Spec(out)


def normalize_dim(spec: Spec, ndim: int) -> Spec:
    """Make every Shard dim non-negative for a tensor of rank ``ndim``."""
    return type(spec)(Shard(p.dim % ndim, p.chunks, p.zigzag) if isinstance(p, Shard) and ndim else p for p in spec)


def from_torch(placement) -> Placement:
    """Accept torch.distributed.tensor placements as well as ours."""
    if isinstance(placement, (Shard, Replicate, Partial)):
        return placement
    name = type(placement).__name__
    if name in ("Shard", "_StridedShard"):
        return Shard(placement.dim)
    if name == "Replicate":
        return R
    if name == "Partial":
        return P
    raise TypeError(f"unknown placement {placement!r}; use autopar.Shard(dim), Replicate() or Partial()")


def local_shape(shape, spec: Spec, mesh_shape) -> tuple:
    """Shape of one rank's piece of a tensor of global ``shape`` under ``spec``."""
    out = list(shape)
    for axis, p in enumerate(spec):
        if isinstance(p, Shard):
            out[p.dim] //= mesh_shape[axis]
    return tuple(out)


def shard_factor(spec: Spec, mesh_shape) -> int:
    """How many pieces the tensor is cut into (Partial/Replicate axes count 1)."""
    f = 1
    for axis, p in enumerate(spec):
        if isinstance(p, Shard):
            f *= mesh_shape[axis]
    return f
