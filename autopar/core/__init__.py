"""autopar.core."""
