"""Error classes: TraceError (trace.py, opaque_functions.py), CheckpointError (runtime/checkpoint*.py),
RankMismatchError (runtime/agreement.py), CommError (collectives/watch.py)."""


class TraceError(RuntimeError):
    """The model could not be traced; the message names the module and source line."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message says what is wrong, where, and what to do."""


class RankMismatchError(RuntimeError):
    """Ranks started differently (model, inputs, mesh, plan, versions): the message names the rank and field."""


class CommError(RuntimeError):
    """A collective or point-to-point wait failed because a peer rank died or stalled past the
    communication timeout: the message names the operation, the step, the peer where known, and what to do.
    ``how``: "lost" (a peer closed its connection), "timeout" or "failed"; ``timeout_s``: the timeout in
    force; ``peer``: the other rank of a point-to-point transfer (else None)."""

    def __init__(self, message: str, how: str | None = None, timeout_s: float | None = None,
                 peer: int | None = None):
        super().__init__(message)
        self.how, self.timeout_s, self.peer = how, timeout_s, peer
