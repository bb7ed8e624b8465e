"""Per-parameter costs of a training step, outside the traced graph: the optimizer step over the local
parameters and the mixed-precision working copies of them (the fp32 master cast to 16 bits for each forward,
its gradient cast back).

    optimizer = numel * optimizer_bytes_per_param * scale / (memory_bandwidth * memory_efficiency)
                + tensors * optimizer_tensor_overhead              (scale: 1 for Adam/AdamW, 1/3 for SGD)
    working copy = numel * WORKING_COPY_BYTES / (memory_bandwidth * memory_efficiency) + 2 kernels
"""
from __future__ import annotations

from .devices import DeviceSpec


def optimizer_step_time(numel: float, device: DeviceSpec, tensors: int = 0, optimizer: str = "adamw") -> float:
    """Seconds of one optimizer step over ``numel`` local parameters in ``tensors`` tensors.

    Memory-bound: ``numel * optimizer_bytes_per_param / (memory_bandwidth * memory_efficiency)``
    plus ``tensors * optimizer_tensor_overhead`` (default: 12 kernel launches, AdamW's dozen
    elementwise kernels per tensor when not fused; 35 us per tensor measured on this CPU).
    SGD moves about a third of AdamW's bytes.
    """
    if numel <= 0:
        return 0.0
    scale = {"adamw": 1.0, "adam": 1.0, "sgd": 1.0 / 3.0}.get(optimizer.lower(), 1.0)
    bytes_moved = numel * device.optimizer_bytes_per_param * scale
    per_tensor = device.optimizer_tensor_overhead
    if per_tensor is None:
        per_tensor = 12 * device.kernel_overhead
    return bytes_moved / (device.memory_bandwidth * device.memory_efficiency) + tensors * per_tensor


# bytes per element of a mixed-precision working copy per forward + backward: the fp32 master cast to 16 bits
# (read 4, write 2) and the 16-bit gradient returned to fp32 (read 2, write 4)
WORKING_COPY_BYTES = 12.0


def working_copy_time(numel: float, device: DeviceSpec, precision: str) -> float:
    """Seconds per forward + backward of the working copy of ``numel`` local parameter elements under
    ``precision == "mixed"`` (autopar's ``mixed_precision``: ``runtime/program.ParamTree`` casts each
    master once per forward call, autograd casts its gradient back): ``WORKING_COPY_BYTES`` per element
    at the streaming bandwidth, two kernels. 0 otherwise (fp32, or 16-bit weights without masters)."""
    if precision != "mixed" or numel <= 0:
        return 0.0
    return numel * WORKING_COPY_BYTES / (device.memory_bandwidth * device.memory_efficiency) \
        + 2 * device.kernel_overhead
