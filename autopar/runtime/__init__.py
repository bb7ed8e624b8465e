"""What per-rank programs call: autograd collectives, launch, grad sync, pipeline execution."""
