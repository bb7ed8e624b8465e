"""Solvers: intra-op strategy selection (CP-SAT), inter-op stage partition (DP), pipeline schedules."""
