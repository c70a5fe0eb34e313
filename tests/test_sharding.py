"""Mesh construction, logical-axis rules, and a sharded forward equal to the single-device one."""

import contextlib

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from tests.conftest import VOCAB, jit_decode, jit_prefill, jit_verify
from tlt_jax import sharding
from tlt_jax.models import KVCache, hf


def test_make_mesh_fills_one_axis():
  mesh = sharding.make_mesh({"data": -1, "tensor": 4})
  assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 4}
  with pytest.raises(ValueError, match="needs 16 devices, have 8"):
    sharding.make_mesh({"fsdp": 4, "tensor": 4})
  with pytest.raises(ValueError, match="unknown mesh axes"):
    sharding.make_mesh({"model": 8})


def test_logical_spec_drops_axes_that_do_not_divide():
  shape = {"data": 2, "fsdp": 2, "tensor": 4}
  assert sharding.logical_spec((8, 32), ("batch", "act_embed"), shape) == P(("data", "fsdp"), None)
  assert sharding.logical_spec((2, 32), ("batch", "mlp"), shape) == P("data", "tensor")
  assert sharding.logical_spec((3, 2), ("batch", "kv_heads"), shape) == P(None, None)


def test_sharded_forward_equals_single_device(hf_dirs):
  path, _ = hf_dirs["qwen2_untied"]
  mesh = sharding.make_mesh({"fsdp": 2, "tensor": 4})
  single = hf.from_pretrained(path)
  sharded = hf.from_pretrained(path, mesh=mesh)
  kernel = sharded.model.layers.self_attn.q_proj.kernel  # the 2 layers' stacked: the layer axis unsharded
  assert kernel.sharding.spec == P(None, "fsdp", "tensor") and len(kernel.addressable_shards) == 8
  assert kernel.addressable_shards[0].data.shape == (2, 16, 8)

  rng = np.random.RandomState(0)
  tokens, lengths = rng.randint(2, VOCAB, (4, 6)), np.asarray([6, 2, 5, 3], np.int32)
  tree = rng.randint(2, VOCAB, (4, 3))
  mask = np.broadcast_to(np.tril(np.ones((3, 3), bool)), (4, 3, 3))

  def run(model, mesh):
    graphdef, state = nnx.split(model)
    cache = KVCache.zeros(model.config, 4, 16)
    if mesh is not None:
      cache = jax.device_put(cache, sharding.cache_shardings(cache, mesh))
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
      pre = jit_prefill(graphdef, state, tokens, lengths, cache, all_logits=True)
      dec = jit_decode(graphdef, state, tokens[:, 0], pre.cache)
      ver = jit_verify(graphdef, state, tree, dec.cache.lengths[:, None] + np.arange(3), mask, dec.cache)
    return pre, dec, ver

  ref = run(single, None)
  got = run(sharded, mesh)
  expected = jax.sharding.NamedSharding(mesh, P(None, ("data", "fsdp"), None, "tensor", None))
  assert got[1].cache.k.sharding.is_equivalent_to(expected, 5)  # the cache stays sharded in the loop
  # Sharded matmuls sum their partial products in another order: float32 rounding, measured <= 6e-7
  # of the largest value. The bound, 1e-4 of it, is 150 times that and 40 times below bfloat16's
  # rounding (4e-3); a wrong shard or a lost all-reduce moves values by their own size.
  for r, g in zip(ref, got):
    for want, have in ((r.logits, g.logits), (r.hidden, g.hidden)):
      np.testing.assert_allclose(have, want, atol=1e-4 * np.abs(want).max(), rtol=0)
