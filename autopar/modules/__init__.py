"""autopar.modules."""
