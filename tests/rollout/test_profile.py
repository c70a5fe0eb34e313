"""Counting compilations (the phase timings are tests/test_bench.py's, through `bench --phases`)."""

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.rollout import profile


def test_count_compilations_counts_each_new_executable_once():
  double = jax.jit(lambda x: 2 * x)
  with profile.count_compilations() as compiled:
    double(np.arange(3.0))
    double(np.arange(3.0) + 1)  # the same shapes: the executable is cached
    jnp.sin(np.arange(4.0))  # an eager op compiles too
  assert len(compiled) == 2 and any("lambda" in name for name in compiled), compiled
  with profile.count_compilations() as again:
    double(np.arange(3.0))
    double(np.arange(5.0))  # a new shape
  assert len(again) == 1
  double(np.arange(7.0))  # outside the block: not counted
  assert len(again) == 1
