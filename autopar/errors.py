"""Error classes: TraceError (trace.py, opaque_functions.py), CheckpointError (runtime/checkpoint*.py),
RankMismatchError (runtime/agreement.py)."""


class TraceError(RuntimeError):
    """The model could not be traced; the message names the module and source line."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message says what is wrong, where, and what to do."""


class RankMismatchError(RuntimeError):
    """Ranks started differently (model, inputs, mesh, plan, versions): the message names the rank and field."""
