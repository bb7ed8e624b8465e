"""autopar.frontend."""
