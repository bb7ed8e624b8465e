"""autopar.report."""
