"""Kernels behind one signature each: a pure-jnp reference that always runs, and accelerator versions."""
