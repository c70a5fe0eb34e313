"""Kernels behind one signature each. Today only the pure-jnp references exist (Pallas / Triton
versions are issue 9)."""
