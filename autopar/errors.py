"""TraceError: the model could not be traced (raised by trace.py and opaque_functions.py)."""


class TraceError(RuntimeError):
    """The model could not be traced; the message names the module and source line."""
