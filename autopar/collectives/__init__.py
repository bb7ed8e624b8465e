"""What per-rank graphs call: collectives as autograd Functions, local op implementations, and
the process groups of the mesh axes. Below passes (which insert these calls) and runtime."""
