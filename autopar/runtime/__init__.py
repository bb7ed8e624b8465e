"""Running per-rank programs: launch, gradient sync, pipeline execution, checkpoints."""
