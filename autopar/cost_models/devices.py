"""Devices and clusters as data: peak rates, memory, links, and the presets.

A :class:`DeviceSpec` describes one accelerator (or one CPU rank) and the two links it
talks over: ``intra_node_link`` between devices of one node, ``inter_node_link`` between
nodes. Bandwidths are bytes/s *per direction, per device*; latencies are the alpha of the
alpha-beta model, in seconds.

Roofline time of an op (see ``compute.py``)::

    t = max(flops / (peak[dtype] * compute_efficiency),
            bytes / (memory_bandwidth * memory_efficiency)) + kernels * kernel_overhead

where a matmul's FLOPs use ``matmul_efficiency`` at its smallest dimension and fused
attention's use ``attention_efficiency`` (or ``attention_curve`` at the keys a query sees) when the
device has them (CPU calibration and the measured H100 family do).
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

import torch

from .profile import load_profile

GiB = 2**30
TERA = 1e12
GIGA = 1e9
# eager / compiled time of calibrate.measure_compiled_speedup's block on this 2-core machine
# (0.79-0.88 measured, 2026-11-24): at these sizes inductor's runtime wrappers cost more than fusion saves
CPU_COMPILED_SPEEDUP = 0.85


@dataclass(frozen=True)
class Link:
    """An alpha-beta link: ``t(n) = latency + n / bandwidth``."""

    bandwidth: float  # bytes/s per direction
    latency: float  # seconds (alpha)

    def time(self, nbytes: float) -> float:
        """Point-to-point time of one message: ``alpha + n / B``."""
        return self.latency + nbytes / self.bandwidth


_DTYPE_KEYS = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
}


@dataclass(frozen=True)
class DeviceSpec:
    """One device of a cluster (all devices of a mesh are alike)."""

    name: str
    peak_flops: dict[str, float]  # "fp32", "tf32", "bf16", "fp16" -> dense FLOP/s
    memory_bytes: int
    memory_bandwidth: float  # bytes/s
    intra_node_link: Link
    inter_node_link: Link
    devices_per_node: int
    compute_efficiency: float = 0.6  # fraction of peak reached by big matmuls
    kernel_overhead: float = 5e-6  # seconds per op launch
    memory_efficiency: float = 0.8  # fraction of memory_bandwidth reached by streaming ops
    allow_tf32: bool = False  # fp32 matmuls run at the "tf32" rate when True
    # bytes moved per parameter by one AdamW step (fp32 fused: read p, g, m, v; write p, m, v)
    optimizer_bytes_per_param: float = 28.0
    # seconds per parameter tensor of one optimizer step, besides its bytes (None: 12 kernel launches)
    optimizer_tensor_overhead: float | None = None
    cores: int | None = None  # CPU only: ranks beyond this many per node share the cores
    # (smallest matmul dimension, fraction of peak) points, ascending; () = compute_efficiency
    matmul_efficiency: tuple[tuple[int, float], ...] = ()
    attention_efficiency: float | None = None  # fraction of peak for fused attention FLOPs
    # (keys a query sees on average, fraction of peak) points, ascending; () = attention_efficiency
    attention_curve: tuple[tuple[int, float], ...] = ()
    # CPU only, measured: (ranks per node, compute, memory, per-kernel slowdown) vs one rank
    sharing: tuple[tuple[int, float, float, float], ...] = ()
    # CPU only, measured: (ranks per node, latency s, bandwidth B/s) of the loopback link when that many
    # ranks share the node (4 gloo processes on 2 cores wait for the scheduler: ~1 ms per ring hop)
    shared_links: tuple[tuple[int, float, float], ...] = ()
    # eager / compiled time of a training block through torch.compile (inductor); measured by
    # `autopar calibrate` (calibrate.measure_compiled_speedup) or on the card (the H100 family), 1.0 where unmeasured
    compiled_speedup: float = 1.0
    compute_scale: float = 1.0  # multiplies every op's compute time (1 / compiled_speedup when compiled)
    notes: str = field(default="", compare=False)

    def flops_per_s(self, dtype: torch.dtype) -> float:
        """Dense peak FLOP/s for ``dtype`` (not scaled by ``compute_efficiency``).

        fp32 uses the "tf32" rate when ``allow_tf32``; float64 is taken as half the fp32
        rate; dtypes without an entry (ints, fp8) use the fp32 rate.
        """
        fp32 = self.peak_flops["fp32"]
        if dtype == torch.float32 and self.allow_tf32 and "tf32" in self.peak_flops:
            return self.peak_flops["tf32"]
        if dtype == torch.float64:
            return self.peak_flops.get("fp64", fp32 / 2)
        return self.peak_flops.get(_DTYPE_KEYS.get(dtype, "fp32"), fp32)

    def matmul_eff(self, min_dim: int) -> float:
        """Fraction of peak a matmul whose smallest dimension is ``min_dim`` reaches:
        ``matmul_efficiency`` interpolated linearly in ``log(min_dim)``, clamped at its ends;
        ``compute_efficiency`` when there is no curve."""
        return _log_interpolate(self.matmul_efficiency, min_dim, self.compute_efficiency)

    def attention_eff(self, keys_per_query: float) -> float | None:
        """Fraction of peak fused attention reaches when a query sees ``keys_per_query`` keys on average
        (``Sk`` without a mask, about ``Sk / 2`` causal): ``attention_curve`` interpolated in the log,
        clamped at its ends; ``attention_efficiency`` (None: ``compute_efficiency``) without a curve or
        a length."""
        if not self.attention_curve or keys_per_query <= 0:
            return self.attention_efficiency
        return _log_interpolate(self.attention_curve, keys_per_query, self.attention_efficiency)

    def slowdown(self, ranks_per_node: int) -> tuple[float, float, float]:
        """(compute, memory, per-kernel) slowdown of one rank when ``ranks_per_node`` ranks share
        a CPU node: the measured ``sharing`` row for that count (interpolated linearly between
        measured counts, scaled by ``k / k_max`` beyond the last); without measurements,
        ``k / cores`` for each once ranks outnumber cores. ``(1, 1, 1)`` for accelerators."""
        if not self.cores or ranks_per_node <= 1:
            return 1.0, 1.0, 1.0
        rows = [(1, 1.0, 1.0, 1.0), *sorted(self.sharing)]
        if len(rows) == 1:
            f = max(1.0, ranks_per_node / self.cores)
            return f, f, f
        k = ranks_per_node
        for lo, hi in zip(rows, rows[1:]):
            if k <= hi[0]:
                w = (k - lo[0]) / (hi[0] - lo[0])
                return tuple(a + w * (b - a) for a, b in zip(lo[1:], hi[1:]))
        last = rows[-1]
        return tuple(v * k / last[0] for v in last[1:])

    def link_for(self, group_span_nodes: bool) -> Link:
        """The link a group uses: inter-node if it spans nodes, else intra-node."""
        return self.inter_node_link if group_span_nodes else self.intra_node_link

    def with_memory(self, nbytes: int | float) -> "DeviceSpec":
        """A copy with ``memory_bytes = nbytes``."""
        return dataclasses.replace(self, memory_bytes=int(nbytes))

    def shared_by(self, ranks_per_node: int) -> "DeviceSpec":
        """The share of one rank when ``ranks_per_node`` ranks run on one CPU node
        (accelerators are never shared): peak FLOP/s, memory bandwidth and the per-kernel
        and per-tensor overheads scaled by :meth:`slowdown`. On this 2-core VM 4 ranks run
        small ops 3-4x and matmuls about 2x slower than one rank alone."""
        fc, fm, fo = self.slowdown(ranks_per_node)
        link = self.shared_link(ranks_per_node)
        if fc == fm == fo == 1.0 and link is None:
            return self
        links = {} if link is None else {"intra_node_link": link, "inter_node_link": link}
        return dataclasses.replace(self, peak_flops={k: v / fc for k, v in self.peak_flops.items()},
                                   memory_bandwidth=self.memory_bandwidth / fm, kernel_overhead=self.kernel_overhead * fo,
                                   optimizer_tensor_overhead=None if self.optimizer_tensor_overhead is None
                                   else self.optimizer_tensor_overhead * fo, **links)

    def shared_link(self, ranks_per_node: int) -> "Link | None":
        """The loopback link measured with ``ranks_per_node`` ranks on the node (``shared_links``;
        interpolated linearly between measured counts, latency times ``k / k_max`` beyond the last,
        the first below it); None when nothing was measured or ranks do not share (one rank)."""
        rows = sorted(self.shared_links)
        k = ranks_per_node
        if not rows or not self.cores or k <= 1:
            return None
        if k <= rows[0][0]:
            return Link(bandwidth=rows[0][2], latency=rows[0][1])
        for lo, hi in zip(rows, rows[1:]):
            if k <= hi[0]:
                w = (k - lo[0]) / (hi[0] - lo[0])
                return Link(bandwidth=lo[2] + w * (hi[2] - lo[2]), latency=lo[1] + w * (hi[1] - lo[1]))
        return Link(bandwidth=rows[-1][2], latency=rows[-1][1] * k / rows[-1][0])

    def with_compile(self, compiled: bool) -> "DeviceSpec":
        """The device as a compiled program sees it: op times divided by ``compiled_speedup`` (itself
        when ``compiled`` is False). Optimizer steps and communication are not compiled, so not scaled."""
        if not compiled:
            return self
        return dataclasses.replace(self, compute_scale=1.0 / self.compiled_speedup)

    def with_devices_per_node(self, n: int) -> "DeviceSpec":
        """A copy with ``devices_per_node = n``."""
        if n < 1:
            raise ValueError(f"devices_per_node must be >= 1, got {n}")
        return dataclasses.replace(self, devices_per_node=int(n))


def _log_interpolate(pts, x: float, default):
    """``pts`` ((x, y) ascending) interpolated linearly in ``log(x)``, clamped at its ends; ``default``
    when empty."""
    if not pts:
        return default
    if x <= pts[0][0]:
        return pts[0][1]
    for (d0, e0), (d1, e1) in zip(pts, pts[1:]):
        if x <= d1:
            w = math.log(x / d0) / math.log(d1 / d0)
            return e0 + w * (e1 - e0)
    return pts[-1][1]


def _gbps(gbit_per_s: float) -> float:
    """Gigabit/s -> bytes/s."""
    return gbit_per_s * GIGA / 8


def _v100_16gb() -> DeviceSpec:
    """NVIDIA V100 SXM2 16 GB as in AWS p3.16xlarge.

    Datasheet (NVIDIA Tesla V100 datasheet, SXM2): 15.7 TFLOP/s fp32, 125 TFLOP/s fp16
    tensor core, no bf16/tf32 (they run at the fp32 rate here), HBM2 900 GB/s. NVLink 2.0:
    300 GB/s aggregate per GPU = 150 GB/s per direction (hybrid cube-mesh, 8 GPUs/node).
    p3.16xlarge network: 25 Gbit/s per instance, shared by its 8 GPUs.
    """
    return DeviceSpec(
        name="v100-16gb",
        peak_flops={"fp32": 15.7 * TERA, "tf32": 15.7 * TERA, "bf16": 15.7 * TERA, "fp16": 125 * TERA},
        memory_bytes=16 * GiB,
        memory_bandwidth=900 * GIGA,
        intra_node_link=Link(bandwidth=150 * GIGA, latency=5e-6),
        inter_node_link=Link(bandwidth=_gbps(25) / 8, latency=3e-5),
        devices_per_node=8,
    )


# measured on one H100 (docstring of _h100): (smallest matmul dimension, fraction of bf16 peak)
H100_MATMUL_CURVE = ((8, 0.01), (128, 0.24), (256, 0.42), (512, 0.59), (1024, 0.69), (2048, 0.70), (4096, 0.71))
# (keys a query sees on average, fraction of peak of fused attention's counted FLOPs), head dim 128
H100_ATTENTION_CURVE = ((512, 0.21), (1024, 0.32), (2048, 0.40), (4096, 0.45), (8192, 0.47))


def _a100(memory_gb: int, hbm_bw: float) -> DeviceSpec:
    """NVIDIA A100 SXM4 (DGX A100 / p4d).

    Datasheet (NVIDIA A100 Tensor Core GPU datasheet): 19.5 TFLOP/s fp32, 156 tf32,
    312 bf16/fp16 dense; HBM2 1555 GB/s (40 GB) or HBM2e 2039 GB/s (80 GB).
    NVLink 3: 600 GB/s aggregate = 300 GB/s per direction, 8 GPUs per node via NVSwitch.
    Inter-node: 8 x 200 Gbit/s HDR InfiniBand per node = 25 GB/s per GPU per direction.
    """
    return DeviceSpec(
        name=f"a100-{memory_gb}gb",
        peak_flops={"fp32": 19.5 * TERA, "tf32": 156 * TERA, "bf16": 312 * TERA, "fp16": 312 * TERA},
        memory_bytes=memory_gb * GiB,
        memory_bandwidth=hbm_bw,
        intra_node_link=Link(bandwidth=300 * GIGA, latency=5e-6),
        inter_node_link=Link(bandwidth=_gbps(200), latency=1e-5),
        devices_per_node=8,
    )


def _h100() -> DeviceSpec:
    """NVIDIA H100 SXM5 80 GB (DGX H100).

    Datasheet (NVIDIA H100 Tensor Core GPU datasheet, SXM, dense = half the sparse
    numbers): 67 TFLOP/s fp32, 494.7 tf32, 989.4 bf16/fp16; HBM3 3.35 TB/s. NVLink 4:
    900 GB/s aggregate = 450 GB/s per direction, 8 GPUs per node. Inter-node:
    8 x 400 Gbit/s NDR InfiniBand (ConnectX-7) = 50 GB/s per GPU per direction.

    Rates measured on one H100 80GB HBM3 (``bench/gpu_fit.py``, torch 2.11 + CUDA 13, bf16; the
    numbers in ``bench/gpu_fit_h100.jsonl``, bench/RESULTS.md §GPU4): a linear layer's training
    matmuls reach the median fraction of peak of nine weight shapes at each smallest dimension
    (``H100_MATMUL_CURVE``); fused attention forward + backward the fraction of its counted FLOPs
    (the causal share of ``S x S``) at the keys a query sees, head dim 128 (``H100_ATTENTION_CURVE``;
    head dim 64 reaches ~0.8x of it, DeepSeek's 192 / 128 ~0.9x); AdamW as ``torch.optim.AdamW``
    runs by default on CUDA (foreach) 3.1e-11 s per fp32 parameter (83 bytes at 0.8 of the bandwidth)
    and ~4 us per tensor (``fused=True``: 1.13e-11 s, 30 bytes). Streaming ops measured
    0.77-0.89 of the bandwidth (the default 0.8 kept). ``torch.compile`` ran one layer's forward +
    backward 1.00x (Llama-3-8B-shaped: matmul- and loss-bound) and 1.21x (a tp-8 rank of a 405B layer)
    as fast as eager: ``compiled_speedup`` 1.1.
    """
    return DeviceSpec(
        name="h100",
        peak_flops={"fp32": 67 * TERA, "tf32": 494.7 * TERA, "bf16": 989.4 * TERA, "fp16": 989.4 * TERA},
        memory_bytes=80 * GiB,
        memory_bandwidth=3.35e12,
        intra_node_link=Link(bandwidth=450 * GIGA, latency=5e-6),
        inter_node_link=Link(bandwidth=_gbps(400), latency=1e-5),
        devices_per_node=8,
        matmul_efficiency=H100_MATMUL_CURVE,
        attention_curve=H100_ATTENTION_CURVE,
        optimizer_bytes_per_param=83.0,
        optimizer_tensor_overhead=4e-6,
        compiled_speedup=1.1,
    )


def _h200() -> DeviceSpec:
    """NVIDIA H200 SXM 141 GB.

    Datasheet (NVIDIA H200 Tensor Core GPU datasheet): compute as H100 SXM (67 fp32,
    494.7 tf32, 989.4 bf16/fp16 dense TFLOP/s), HBM3e 141 GB at 4.8 TB/s, NVLink 900 GB/s
    aggregate, 400 Gbit/s NDR InfiniBand per GPU.
    """
    return dataclasses.replace(_h100(), name="h200", memory_bytes=141 * GiB, memory_bandwidth=4.8e12)


def _h800() -> DeviceSpec:
    """NVIDIA H800 SXM5 80 GB: the H100 SXM5 with NVLink cut to 400 GB/s aggregate = 200 GB/s per
    direction (compute, HBM3 and 8 GPUs per node as H100). Inter-node as in DeepSeek-V3's cluster
    (DeepSeek-V3 technical report, section 3.1): one 400 Gbit/s InfiniBand NIC per GPU = 50 GB/s.
    """
    return dataclasses.replace(_h100(), name="h800", intra_node_link=Link(bandwidth=200 * GIGA, latency=5e-6))


def _cpu() -> DeviceSpec:
    """This machine, one rank = one process with one thread.

    From the calibration profile (``autopar calibrate``) when present; otherwise
    defaults measured on 2-core machines like this one (120 GFLOP/s fp32 per core for matmuls
    that fit the caches; a linear layer's training matmuls reach 0.22 of that on 8 tokens, 0.6 on
    64 and 0.8 from 256; causal attention 0.34; 5 GB/s memory, gloo loopback 0.5 GB/s with 250 us
    latency — quick calibrations here gave 200-670 us and 0.3-1.2 GB/s — and 20 us per kernel of a
    training step, measured by ``calibrate.measure_kernel_overhead`` at 18-19 us). Two ranks on
    the two cores run 1.05x (matmul), 1.15x (memory-bound) and 1.25x (small ops) slower than one,
    four ranks 2.4x, 2.5x and 3x (``calibrate.measure_sharing`` gave 2.2-2.8, 2.3-2.8, 2.4-3.6);
    and gloo's ring waits for the scheduler: all_reduce fits 180 us per hop with 2 ranks, 920 us with 4
    (a 4 KiB all_reduce: 0.47 ms on 2 ranks, 5.9 ms on 4).
    Memory: physical RAM / cores.
    """
    profile = load_profile()
    if profile is not None:
        return device_from_profile(profile)
    nproc = os.cpu_count() or 1
    loopback = Link(bandwidth=0.5 * GIGA, latency=2.5e-4)
    return DeviceSpec(
        name="cpu",
        peak_flops={"fp32": 120 * GIGA, "tf32": 120 * GIGA, "bf16": 20 * GIGA, "fp16": 5 * GIGA},
        memory_bytes=physical_memory_bytes() // nproc,
        memory_bandwidth=5 * GIGA,
        intra_node_link=loopback,
        inter_node_link=loopback,
        devices_per_node=nproc,
        compute_efficiency=0.6,
        memory_efficiency=1.0,
        kernel_overhead=2e-5,
        optimizer_bytes_per_param=32.0,      # AdamW (torch default on CPU): 3-6 ns/param measured here
        optimizer_tensor_overhead=3.5e-5,    # and 35 us per parameter tensor
        cores=nproc,
        matmul_efficiency=((8, 0.22), (16, 0.36), (32, 0.55), (64, 0.6), (128, 0.71), (256, 0.79), (1024, 0.8)),
        attention_efficiency=0.34,
        sharing=((2, 1.05, 1.15, 1.25), (4, 2.4, 2.5, 3.0)) if nproc == 2 else (),
        shared_links=((2, 2.0e-4, 1.0e9), (4, 9.0e-4, 1.0e9)) if nproc == 2 else (),
        compiled_speedup=CPU_COMPILED_SPEEDUP,
        notes="defaults: no calibration profile (run `autopar calibrate`)",
    )


def device_from_profile(profile: dict) -> DeviceSpec:
    """The "cpu" :class:`DeviceSpec` of a profile: peak = the best square matmul,
    ``compute_efficiency`` = what a linear layer's matmuls reach of it, memory efficiency 1
    (the bandwidth is measured on a real op)."""
    peak = dict(profile["peak_flops"])
    fp32 = peak["fp32"]
    peak.setdefault("tf32", fp32)
    peak.setdefault("bf16", fp32)
    peak.setdefault("fp16", peak["bf16"])
    link = Link(bandwidth=float(profile["link"]["bandwidth"]), latency=float(profile["link"]["latency"]))
    nproc = int(profile["machine"]["nproc"])
    return DeviceSpec(
        name="cpu",
        peak_flops=peak,
        memory_bytes=physical_memory_bytes() // nproc,
        memory_bandwidth=float(profile["memory_bandwidth"]),
        intra_node_link=link,
        inter_node_link=link,
        devices_per_node=nproc,
        compute_efficiency=float(profile.get("compute_efficiency", 1.0)),
        memory_efficiency=1.0,
        kernel_overhead=float(profile["kernel_overhead"]),
        optimizer_bytes_per_param=float(profile.get("optimizer_bytes_per_param", 32.0)),
        optimizer_tensor_overhead=float(profile.get("optimizer_tensor_overhead", 3.5e-5)),
        cores=nproc,
        matmul_efficiency=tuple((int(d), float(e)) for d, e in profile.get("matmul_efficiency", ())),
        attention_efficiency=profile.get("attention_efficiency"),
        sharing=tuple((int(k), float(c), float(m), float(o)) for k, c, m, o in profile.get("sharing", ())),
        shared_links=tuple((int(k), float(a), float(b)) for k, a, b in profile.get("shared_links", ())),
        compiled_speedup=float(profile.get("compiled_speedup", CPU_COMPILED_SPEEDUP)),
        notes=f"calibrated {profile.get('date', '?')}",
    )


def physical_memory_bytes() -> int:
    """Total RAM of this machine (8 GiB when it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * GiB


_PRESETS = {
    "v100-16gb": _v100_16gb,
    "a100-40gb": lambda: _a100(40, 1555 * GIGA),
    "a100-80gb": lambda: _a100(80, 2039 * GIGA),
    "h100": _h100,
    "h100-sxm": _h100,
    "h200": _h200,
    "h800": _h800,
    "cpu": _cpu,
}


def register_device(spec: DeviceSpec, name: str | None = None) -> str:
    """Make ``spec`` a preset under ``name`` (default ``spec.name``), so that ``Mesh(..., device=name)``
    plans with it, e.g. a V100 whose bf16 runs at its fp16 tensor-core rate:
    ``register_device(dataclasses.replace(get_device("v100-16gb"), name="v100-fp16", peak_flops=...))``.
    A preset of that name is replaced. Returns the name."""
    if not isinstance(spec, DeviceSpec):
        raise TypeError(f"register_device takes a DeviceSpec (e.g. dataclasses.replace(get_device('v100-16gb'), "
                        f"...)), got {type(spec).__name__}")
    key = (name or spec.name).strip().lower()
    if not key:
        raise ValueError("register_device needs a non-empty name (the spec's name or name=...)")
    _PRESETS[key] = lambda: spec
    return key


def preset_names() -> list[str]:
    """All names :func:`get_device` accepts (aliases included)."""
    return list(_PRESETS)


def get_device(name: str, memory_gb: float | None = None, gpus_per_node: int | None = None) -> DeviceSpec:
    """A preset by name, optionally with its memory capped (GiB) or node size changed.

    Unknown names raise ``ValueError`` listing every preset.
    """
    key = name.strip().lower()
    if key not in _PRESETS:
        raise ValueError(f"unknown device {name!r}; presets: {', '.join(preset_names())}")
    spec = _PRESETS[key]()
    if memory_gb is not None:
        if memory_gb <= 0:
            raise ValueError(f"memory_gb must be > 0, got {memory_gb}")
        spec = spec.with_memory(int(memory_gb * GiB))
    if gpus_per_node is not None:
        spec = spec.with_devices_per_node(gpus_per_node)
    return spec


def axis_nodes(device: DeviceSpec, axis_size: int, inner_size: int = 1) -> int:
    """How many nodes one group of a mesh axis spans.

    Ranks are laid out row-major over the mesh, nodes hold ``devices_per_node``
    consecutive ranks; the group of the axis containing rank 0 is
    ``{k * inner_size : k < axis_size}`` with ``inner_size`` = product of the sizes of the
    faster-varying axes. Returns ``|{k * inner_size // devices_per_node}|``.
    """
    dpn = device.devices_per_node
    return len({(k * inner_size) // dpn for k in range(axis_size)})


def axis_link(device: DeviceSpec, axis_size: int, inner_size: int = 1) -> Link:
    """The link a mesh axis's collectives run over: inter-node if one group spans nodes."""
    return device.link_for(axis_nodes(device, axis_size, inner_size) > 1)


def mesh_device(mesh) -> DeviceSpec:
    """The device spec (peak FLOP/s, memory, links) a ``Mesh`` is planned for."""
    return get_device(mesh.device, memory_gb=mesh.memory_gb, gpus_per_node=mesh.gpus_per_node)
