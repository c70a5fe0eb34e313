"""Sizing a run without weights: abstract params, AOT compilation for the configured mesh, memory.

`python -m tlt_jax.main --config=... --config.dry_run=True` builds the policy and drafter with
`jax.eval_shape` (no weights read; the architecture comes from <policy.path>/config.json, or from
config.model when that directory is absent), places them on the run's meshes (on a CPU-only machine
`mesh.dry_run_devices` simulated devices stand in for the accelerators), compiles the rollout
executables (largest batch bucket, and the speculative tail's bucket with every strategy) for one
rollout group and the trainer's micro-batch gradient and optimizer update, and reports per-device
memory (XLA's memory analysis of each executable) and FLOPs. The trainer holds the policy's master
weights and AdamW moments in `policy.weight_dtype` (float32: 12 bytes a parameter, 16 with the
gradient during an update, sharded over the trainer mesh; with LoRA, the adapters' alone beside the base
in `policy.dtype`) and each rollout group a copy in
`policy.dtype` (2 bytes a parameter in bfloat16, split over the group): both stay resident on a device
while the other side runs, so each executable's need counts what the other side keeps
(`coresident_gb`). `rollout_batches` states the rows a
step gives each rollout group, the rows in flight at once (its largest bucket) and the tails a step
pays: one per wave in waves, one with refill (`rollout.engine.refill`). It fails, naming the executable and
the config keys to change, when one needs more than `mesh.device_memory_gb`. With TLT it also
bounds what the drafter's online data buffer adds to each process's checkpoint
(`drafter_buffer_checkpoint_gb`: captured features and tokens, at most `drafter.buffer.max_pairs` pairs).
`cache_rows` sizes a paged KV cache: the rows of `rollout.mean_response_len` tokens one rollout
device holds in flight, in the contiguous cache's bytes and in the memory the rollout leaves free,
against the contiguous cache's one row per slot of the largest bucket.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import jax
import jax.numpy as jnp
from absl import logging
from flax import nnx

from tlt_jax import sharding
from tlt_jax.drafter.buffer import BufferConfig
from tlt_jax.drafter.model import Drafter
from tlt_jax.models import CausalLM, ModelConfig, lora
from tlt_jax.rl import actor as actor_lib
from tlt_jax.rl import bootstrap
from tlt_jax.rl import builders, checks
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.state import EngineConfig

GB = 1 << 30


def model_config(config) -> tuple[ModelConfig, str]:
  """The policy's architecture and where it came from."""
  path = os.path.join(config.policy.path, "config.json") if config.policy.path else ""
  if path and os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      return ModelConfig.from_hf(json.load(f), source=path), path
  if config.policy.path:  # a real model's directory that is not here (e.g. sizing a cluster run on a laptop)
    if not config.model.vocab_size:
      raise ValueError(f"config.model.vocab_size: {path} is not there, so a dry run takes the architecture from "
                       "config.model and needs the vocabulary size")
    return builders.model_config(config), "config.model"
  # The tiny world: its tokenizer (procedural, or the one SFT saved with the policy) gives the vocabulary.
  return builders.model_config(config, bootstrap.load_tokenizer(config)), "config.model"


def _abstract(build, mesh):
  """An NNX module built with eval_shape whose variables carry their shardings over `mesh`."""
  model = nnx.eval_shape(build)
  graphdef, state = nnx.split(model)
  shardings = sharding.param_shardings(state, mesh)
  state = jax.tree.map(lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)), state, shardings,
                       is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.merge(graphdef, state)


def _bytes(state) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


def _device_bytes(tree) -> int:
  """Bytes of one device's shards of the (abstract, sharded) arrays of `tree` (the most any device holds)."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _sizes(compiled) -> dict[str, float]:
  """Per-device memory of one executable: `resident` (its inputs and outputs, donated ones counted
  once: params, caches, optimizer state; exact on every backend) and `temp` (XLA's scratch on
  this backend), and its FLOPs."""
  m = compiled.memory_analysis()
  cost = compiled.cost_analysis() or {}
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  resident = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
  return {"resident_gb": round(resident / GB, 6), "temp_gb": round(m.temp_size_in_bytes / GB, 6),
          "tflops": round(float(cost.get("flops", 0.0)) / 1e12, 6)}


def run(config) -> dict:
  start = time.perf_counter()
  checks.check(config)
  cfg, source = model_config(config)
  cfg = dataclasses.replace(cfg, scan_layers=config.policy.scan_layers)
  dtype = jnp.dtype(config.policy.dtype)
  devices = jax.devices()
  report = {"model": source, "parameters_b": None, "devices": f"{len(devices)} x {devices[0].device_kind}"}
  spec = bootstrap.lora_spec(config)

  def build_policy():  # with LoRA: the base in the compute dtype, the adapters in policy.weight_dtype
    model = CausalLM(cfg, dtype=dtype, param_dtype=config.policy.weight_dtype if spec is None else dtype,
                     rngs=nnx.Rngs(0))
    if spec is not None:
      lora.attach(model, spec, param_dtype=config.policy.weight_dtype)
    return model
  build_copy = lambda: CausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0))  # a rollout group's
  executables = {}

  # Trainer: FSDP / tensor / data mesh over every device.
  mesh = sharding.make_mesh({k: config.mesh[k] for k in sharding.MESH_AXES})
  policy = _abstract(build_policy, mesh)
  count = lambda *filters: sum(x.size for x in jax.tree.leaves(nnx.state(policy, *filters)))
  report["parameters_b"] = round(count(nnx.Not(nnx.LoRAParam)) / 1e9, 3)
  if spec is not None:
    report["lora"] = {"rank": spec.rank, "parameters_m": round(count(nnx.LoRAParam) / 1e6, 3)}
  report["trainer_mesh"] = dict(mesh.shape)
  r = config.rl
  with jax.set_mesh(mesh):
    actor = actor_lib.Actor(policy, actor_lib.make_optimizer(**r.optimizer), **r.actor,
                            temperature=config.rollout.sampling.temperature, seed=config.seed)
    rows = r.actor.micro_batch_rows
    batch_sharding = sharding.array_sharding((rows, r.row_len), ("batch", None), mesh)
    logging.info("dry run: compiling the train step (%d rows x %d tokens)", rows, r.row_len)
    for name, exe in actor.compile_update(r.row_len, batch_sharding).items():
      executables[f"train/{name}"] = _sizes(exe)

  # Rollout: one group's engine on its share of the devices (tensor-parallel inside the group).
  groups = config.rollout.groups
  if len(devices) % groups:
    raise ValueError(f"config.rollout.groups={groups} does not divide {len(devices)} devices")
  group_mesh = sharding.make_mesh({"tensor": len(devices) // groups}, devices=devices[:len(devices) // groups])
  report["rollout_group_mesh"] = dict(group_mesh.shape)
  group_policy = _abstract(build_copy, group_mesh)
  strategies = builders.strategies(config) if config.rollout.speculative else ()
  eagle = any(not s.suffix for s in strategies)  # an EAGLE drafter (else suffix arms alone, or none)
  # A reduced head's ids come from the warm-up data; any N ids size the executables alike. One chosen
  # by coverage (-1) is sized as the whole vocabulary, its largest.
  vocab = range(min(max(config.drafter.draft_vocab_size, 0), cfg.vocab_size))
  build_drafter = lambda: Drafter(cfg, feature_layers=config.drafter.feature_layers, draft_vocab=vocab, dtype=dtype,
                                  rngs=nnx.Rngs(0))
  drafter = _abstract(build_drafter, group_mesh) if eagle else None
  sampling = builders.sampling_params(config)
  base = builders.engine_config(config, strategies)
  report["rollout_batches"] = batches(config, base.batch_buckets[-1])
  rows = report["rollout_batches"]["rows_per_group"]
  sd_bucket = base.bucket(min(base.sd_max_batch, base.batch_buckets[-1]))
  for label, largest in (("rollout", base.batch_buckets[-1]), ("rollout_tail", sd_bucket)):
    engine_cfg = builders.engine_config(config, strategies, largest_bucket=largest, compact=False)
    bandit = builders.bandit(config, strategies) if strategies else None
    engine = Engine(group_policy, engine_cfg, sampling, mesh=group_mesh, drafter=drafter, bandit=bandit)
    logging.info("dry run: compiling %s executables (bucket %d)", label, largest)
    with jax.set_mesh(group_mesh):
      engine.prepare(rows if label == "rollout" else largest, [config.data.max_prompt_len])  # refill's reset too
    for key in engine.pool.keys():
      executables[f"{label}/{'/'.join(map(str, key))}"] = _sizes(engine.pool[key])
    if largest == sd_bucket:
      break

  report["executables"] = executables
  report["policy_gb"] = round(_bytes(nnx.state(policy)) / GB, 6)
  report["trainer_state_gb"] = round(_device_bytes((actor.params, actor.frozen, actor.opt_state)) / GB, 6)
  report["cache_rows"] = cache_rows(config, cfg, base, dtype.itemsize, eagle, len(group_mesh.devices.flat),
                                    executables[f"rollout/plain/{base.batch_buckets[-1]}"]["resident_gb"]
                                    + report["trainer_state_gb"])
  report["rollout_copy_gb"] = round(_device_bytes((nnx.state(group_policy), nnx.state(drafter) if eagle else ())) / GB,
                                    6)
  if eagle:  # the rollout's captured features: this many bytes per process in each checkpoint at most
    r = config.rollout
    buffer = BufferConfig(**config.drafter.buffer).state_bytes(
        r.prompts_per_step * r.num_samples, config.data.max_prompt_len + r.sampling.max_new_tokens, cfg.hidden_size,
        dtype.itemsize)
    report["drafter_buffer_checkpoint_gb"] = round(buffer / GB, 6)
  report["coresident_gb"] = coresident = {"train/gradient": report["trainer_state_gb"] + report["rollout_copy_gb"],
                                          "train/update": report["rollout_copy_gb"],
                                          "rollout": report["trainer_state_gb"]}
  beside = {name: coresident.get(name, coresident["rollout"]) for name in executables}
  report.update(check_fit(executables, config.mesh.device_memory_gb, on_cpu=devices[0].platform == "cpu",
                          beside=beside))
  report["seconds"] = round(time.perf_counter() - start, 1)
  return report


def batches(config, largest: int) -> dict:
  """Rows a step gives the busiest rollout group, rows in flight at once, and the batches it runs:
  in waves, one per `largest` rows, each waiting for its longest row (a tail each); with refill,
  one batch kept full while rows wait (one tail)."""
  r = config.rollout
  rows = -(-r.prompts_per_step // r.groups) * r.num_samples
  return {"rows_per_group": rows, "rows_in_flight": min(rows, largest), "refill": bool(r.engine.refill),
          "tails_with_waves": -(-rows // largest), "tails_with_refill": 1}


def cache_rows(config, cfg: ModelConfig, engine: EngineConfig, itemsize: int, drafter: bool, group_devices: int,
               rollout_resident_gb: float) -> dict:
  """Rows of a mean response length one rollout device holds in flight: contiguous (each row its
  capacity: the largest bucket) and paged (`engine.page_size`, else kv_block-sized pages; the
  prompt's full pages shared by its samples, each row's last page half empty on average plus one
  play's reservation), in the contiguous cache's bytes and in the device memory the rollout's
  resident state and the trainer's beside it leave free (`rollout_resident_gb`; `mesh.device_memory_gb`;
  scratch memory not counted)."""
  r = config.rollout
  shards = min(group_devices, cfg.num_kv_heads)  # the cache splits over KV heads inside a group
  token_bytes = 2 * (cfg.num_layers + drafter) * cfg.num_kv_heads * cfg.head_dim * itemsize / shards
  page = engine.page_size or engine.kv_block
  prompt, mean = config.data.max_prompt_len, r.mean_response_len or r.sampling.max_new_tokens // 4
  shared = (prompt - 1) // page
  own = -(-(prompt + mean + engine.play_slots(None)) // page) - shared
  row_pages = own + shared / r.num_samples
  contiguous = engine.batch_buckets[-1]
  cache_bytes = contiguous * engine.capacity * token_bytes
  free_bytes = config.mesh.device_memory_gb * GB - (rollout_resident_gb * GB - cache_bytes)
  rows = lambda nbytes: int(nbytes / (page * token_bytes) / row_pages)
  return {"mean_response_len": mean, "prompt_len": prompt, "page_size": page, "kv_bytes_per_token": int(token_bytes),
          "contiguous_rows": contiguous, "contiguous_cache_gb": round(cache_bytes / GB, 3),
          "paged_rows_same_bytes": rows(cache_bytes),
          "paged_rows_device_memory": rows(free_bytes) if config.mesh.device_memory_gb else None,
          "free_gb_for_cache": round(free_bytes / GB, 3) if config.mesh.device_memory_gb else None}


def check_fit(executables: dict[str, dict[str, float]], limit_gb: float, on_cpu: bool,
              beside: dict[str, float] | None = None) -> dict:
  """The largest per-device need: an executable's resident memory, what stays resident `beside` it
  (GB by executable: the trainer's state during a rollout, the rollout's copy during training), and
  its scratch; raises ValueError naming the executable when that exceeds `limit_gb`.

  XLA:CPU runs bfloat16 matmuls in float32 through converted copies of their operands (weights,
  cache blocks), so on a CPU stand-in the scratch figure overstates an accelerator's many times;
  there only the resident memory is checked. On GPU/TPU both are.
  """
  beside = beside or {}
  need = lambda name: (executables[name]["resident_gb"] + beside.get(name, 0.0)
                       + (0.0 if on_cpu else executables[name]["temp_gb"]))
  worst = max(executables, key=need)
  out = {"checked": "resident memory (temp not checked: XLA:CPU stand-in)" if on_cpu else "resident + temp memory",
         "max_per_device_gb": round(need(worst), 6), "max_per_device_executable": worst}
  if limit_gb and out["max_per_device_gb"] > limit_gb:
    raise ValueError(
        f"{worst} needs {out['max_per_device_gb']} GB per device > config.mesh.device_memory_gb={limit_gb}: "
        "lower config.rollout.engine.batch_buckets or config.rl.actor.micro_batch_rows, set "
        "config.rl.actor.remat=True and config.rl.actor.attention_block, halve the trainer's state with "
        "config.policy.weight_dtype=bfloat16, or use more devices (config.mesh.*, config.rollout.groups)")
  return {**out, "fits": True}
