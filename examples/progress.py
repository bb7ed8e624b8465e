"""Progress of a long loop: a tqdm bar when tqdm is installed (the ``progress`` extra), else a plain
line every ``every`` steps (and at the last), so logs stay readable without it."""
from __future__ import annotations

import sys
import time


class Progress:
    """``update(**info)`` after each step (info such as ``loss=`` is shown beside the count); ``close()`` at the end."""

    def __init__(self, total: int, desc: str, every: int | None = None, stream=None, use_tqdm: bool = True):
        self.total, self.desc, self.done = total, desc, 0
        self.every = every or max(1, total // 10)
        self.stream = stream or sys.stdout
        self.start = time.perf_counter()
        self._bar = None
        if use_tqdm:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, desc=desc, file=self.stream, leave=True, dynamic_ncols=True)

    def update(self, **info) -> None:
        self.done += 1
        shown = {k: f"{v:.6f}" if isinstance(v, float) else str(v) for k, v in info.items()}
        if self._bar is not None:
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(1)
            return
        if self.done % self.every == 0 or self.done == self.total:
            extra = "".join(f", {k} {v}" for k, v in shown.items())
            elapsed = time.perf_counter() - self.start
            print(f"{self.desc}: {self.done}/{self.total} ({elapsed:.1f} s{extra})", file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
