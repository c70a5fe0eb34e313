"""Device mesh from config and declarative logical-axis rules -> PartitionSpecs.

Modules name the axes of their parameters and activations logically (`("embed", "mlp")`);
`RULES` maps each logical name to mesh axes. A mesh axis is dropped from a dimension it does
not divide (a 2-head KV cache on a 4-way tensor axis stays replicated) or that an earlier
dimension already uses (the drafter's H x H `fc`), so every model fits every mesh, just with
less sharding.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # the axes rows split over (RULES' "batch")

# logical axis -> mesh axes. Batch is split over data and fsdp; parameters are split over fsdp
# (FSDP) on their model dimension and over tensor (Megatron-style) on heads / MLP / vocab.
RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", BATCH_AXES),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("lora_rank", "fsdp"),  # a LoRA adapter's rank axis: sharded where its other axis is not over fsdp
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("cache_heads", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("seq", None),
    ("cache_len", None),
    ("act_embed", None),
    ("layers", None),  # a scanned decoder's stacked layer axis: each device holds every layer's share
)

ACTIVATION_AXES = ("batch", "seq", "act_embed")
CACHE_AXES = ("batch", "cache_len", "cache_heads", "head_dim")


def make_mesh(axes: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
  """A mesh over `devices` (default: all) with axis sizes from config; one size may be -1 (the rest)."""
  devices = list(jax.devices() if devices is None else devices)
  unknown = set(axes) - set(MESH_AXES)
  if unknown:
    raise ValueError(f"unknown mesh axes {sorted(unknown)}; known: {MESH_AXES}")
  sizes = {name: int(axes.get(name, 1)) for name in MESH_AXES}
  fill = [n for n, s in sizes.items() if s == -1]
  if len(fill) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got {fill}")
  known = math.prod(s for s in sizes.values() if s != -1)
  if fill:
    if len(devices) % known:
      raise ValueError(f"{len(devices)} devices do not split into mesh axes {dict(axes)}")
    sizes[fill[0]] = len(devices) // known
  if math.prod(sizes.values()) != len(devices):
    raise ValueError(f"mesh {sizes} needs {math.prod(sizes.values())} devices, have {len(devices)}")
  return jax.make_mesh(tuple(sizes.values()), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                       devices=devices)


def logical_spec(shape: Sequence[int], names: Sequence[str | None], mesh_shape: Mapping[str, int],
                 rules=RULES) -> P:
  """PartitionSpec for an array of `shape` whose axes have logical `names`."""
  table = dict(rules)
  spec, used = [], set()
  for dim, name in zip(shape, names):
    target = table.get(name) if name is not None else None
    axes = (target,) if isinstance(target, str) else tuple(target or ())
    kept, size = [], 1
    for a in axes:
      if a in mesh_shape and a not in used and dim % (size * mesh_shape[a]) == 0:
        kept.append(a)
        used.add(a)
        size *= mesh_shape[a]
    spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return P(*spec)


def variable_sharding(var: nnx.Variable, mesh: jax.sharding.Mesh, rules=RULES) -> NamedSharding:
  """NamedSharding of a (possibly abstract) variable, from its logical-axis metadata."""
  names = var.get_metadata().get("out_sharding") or (None,) * len(var.shape)
  return NamedSharding(mesh, logical_spec(var.shape, names, mesh.shape, rules))


def param_shardings(state: nnx.State, mesh: jax.sharding.Mesh, rules=RULES) -> nnx.State:
  """NamedShardings for every variable of a (possibly abstract) state."""
  return jax.tree.map(lambda v: variable_sharding(v, mesh, rules), state,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: jax.sharding.Mesh, rules=RULES) -> nnx.Module:
  """Moves every parameter of `model` onto its sharding over `mesh` (in place) and returns it."""
  state = nnx.state(model)
  nnx.update(model, jax.device_put(state, param_shardings(state, mesh, rules)))
  return model


def array_sharding(shape: Sequence[int], names: Sequence[str | None], mesh: jax.sharding.Mesh,
                   rules=RULES) -> NamedSharding:
  return NamedSharding(mesh, logical_spec(shape, names, mesh.shape, rules))


def cache_shardings(cache, mesh: jax.sharding.Mesh, rules=RULES):
  """Shardings for a KVCache: k/v [L, B, S, Hkv, D] (paged: [L, N, P, Hkv, D], pages split like
  rows), lengths [B] and page tables [B, M]."""
  kv = array_sharding(cache.k.shape, (None, *CACHE_AXES), mesh, rules)
  pages = None if cache.pages is None else array_sharding(cache.pages.shape, ("batch", None), mesh, rules)
  lengths = array_sharding(cache.lengths.shape, ("batch",), mesh, rules)
  return type(cache)(k=kv, v=None if cache.v is None else kv, lengths=lengths, pages=pages)


def constrain(x: jax.Array, names: Sequence[str | None], rules=RULES) -> jax.Array:
  """Sharding constraint on an activation inside jit when a mesh is set (`jax.set_mesh`); else x."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
    return x
  return jax.lax.with_sharding_constraint(x, logical_spec(x.shape, names, dict(mesh.shape), rules))




def abstract(tree) -> bool:
  """Whether `tree` holds shapes (`jax.ShapeDtypeStruct`: a dry run's) rather than arrays."""
  return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def place(tree, shardings, alias: bool = False):
  """`tree` laid out by `shardings` (a tree of them, or one): a copy of its arrays (with `alias`, their own
  buffers where they are laid out so already), or, for shapes (a dry run's), the shapes with those shardings:
  nothing is created."""
  if not abstract(tree):
    return jax.device_put(tree, shardings, may_alias=alias)
  shaped = lambda s, subtree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), subtree)
  return jax.tree.map(shaped, shardings, tree)  # `shardings` is a prefix of `tree`, as device_put takes it


def optimizer_shardings(optimizer: optax.GradientTransformation, params):
  """The shardings of `optimizer`'s state for `params` (sharded arrays, or abstract ones with shardings):
  each copy of the params (AdamW's moments) sharded like them, the rest (step counts) replicated. XLA
  left to choose would replicate the moments (zeros depend on no sharded input): 8x their memory
  under FSDP over 8 devices."""
  shardings = jax.tree.map(lambda x: x.sharding, params)
  first = jax.tree.leaves(shardings)[0]  # on one device (a dry run's policy there): that device
  replicated = NamedSharding(first.mesh, P()) if isinstance(first, NamedSharding) else first
  return optax.tree_map_params(optimizer, lambda _, s: s, jax.eval_shape(optimizer.init, params), shardings,
                               transform_non_params=lambda _: replicated)
