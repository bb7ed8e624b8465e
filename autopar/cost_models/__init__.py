"""Cost models: devices, compute, memory and communication (see docs/cost_models.md)."""
