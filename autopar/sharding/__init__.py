"""Sharding vocabulary (placements), op rules and redistribution."""
