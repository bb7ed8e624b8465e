"""Keep torch's own error logs of ops autopar probes (and handles) from reaching the user.

torch's ``FakeTensorMode`` logs, at ERROR level and with a traceback, every op whose meta kernel
raises (``failed while attempting to run meta for aten.histc.default``: a CPU ``histc`` of int32
counts, as Hugging Face's grouped-mm experts record on a meta-device model) and then re-raises.
autopar runs ops on fake tensors to cost them (``cost_models/compute.py``) and to re-derive shapes
(``graph/rescale.py``); it catches those failures and costs the op from its traced metadata instead,
so the log records are noise: ``quiet_fake_tensor_logs()`` drops them while it is active (the
exception itself still propagates to autopar's handler)."""
from __future__ import annotations

import contextlib
import logging
import threading

_LOGGERS = ("torch._subclasses.fake_tensor",)
_lock = threading.Lock()
_depth = 0


class _DropAll(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


_FILTER = _DropAll()


@contextlib.contextmanager
def quiet_fake_tensor_logs():
    """Drop the records of torch's fake-tensor logger while active (re-entrant, thread-safe)."""
    global _depth
    with _lock:
        _depth += 1
        if _depth == 1:
            for name in _LOGGERS:
                logging.getLogger(name).addFilter(_FILTER)
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for name in _LOGGERS:
                    logging.getLogger(name).removeFilter(_FILTER)
