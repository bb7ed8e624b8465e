"""autopar.plan."""
