"""Imported once by the ranks' fork server (``rank_start``): what every rank would import on its first job
(autopar, torch.export's tracing machinery, transformers' mask helpers that ``trace`` patches). Each module
is optional: one that fails to import is left to the ranks. Named as strings: this is no dependency of core."""
from __future__ import annotations

import importlib

MODULES = ("autopar", "torch._dynamo", "torch._functorch.aot_autograd", "torch.distributed.tensor",
           "transformers.masking_utils")

for _name in MODULES:
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001 - the rank imports it itself (and reports any error there)
        pass
