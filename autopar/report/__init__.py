"""autopar.report: the Plan's renderers (text report, explain, pictures), registered as its views."""
from autopar.report import pictures, text  # noqa: F401  (registers plan.report(), explain(), pictures)
