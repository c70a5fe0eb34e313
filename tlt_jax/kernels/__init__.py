"""Kernels behind one signature each: `tree_attention.attention` dispatches to the pure-jnp
reference or to the Pallas TPU / GPU kernels."""
