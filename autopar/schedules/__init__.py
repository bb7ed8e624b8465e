"""autopar.schedules."""
