"""Graph analysis: repeated layers, chunk hints for fused projections, op groups."""
