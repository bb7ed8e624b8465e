"""The search reports its progress and stops at a time budget with the best plan so far."""
from __future__ import annotations

import subprocess
import sys

import pytest

from search_progress_jobs import _plan


def test_a_bad_time_budget_is_refused():
    with pytest.raises(ValueError, match="time_budget must be a positive number of seconds, got -1"):
        _plan(time_budget=-1)
    out = subprocess.run([sys.executable, "-m", "autopar.cli", "plan", "examples.factories:gpt2_small", "--time-budget",
                          "0"], capture_output=True, text=True)
    assert out.returncode != 0 and "--time-budget must be a positive number of seconds, got 0" in out.stderr
