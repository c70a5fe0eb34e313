"""Sizing a run without weights or hardware: abstract params, ahead-of-time compilation of every executable
the run compiles, memory per device, and a roofline.

`python -m tlt_jax.main --config=... --config.dry_run=True` builds the policy and drafter with
`jax.eval_shape` (no weights read; the architecture comes from <policy.path>/config.json, or from
config.model when that directory is absent) and hands them to the run's own constructors (the trainer's
actor, `rollouts.make`: the TLT group engines and drafter trainer, or the plain rollout, and the held-out
evaluation's), which lay them out on the run's meshes and compile what a step runs: each group engine's
executables (prefill per prompt bucket, every batch bucket's plain and speculative plays, compaction, the
refill's and the paged cache's, tool-turn appends), the drafter trainer's (each group's gradient step, the
update, the evaluation), the actor's (the micro-batch log-probs and gradient, the optimizer update) and,
when the run would warm a drafter up, the warm-up's feature pass and training step. No array is created
on that path.

The devices: `config.mesh.target` names hardware (`tlt_jax.targets`: NVIDIA GPUs through the CUDA plugin's
compiler, TPUs through libtpu's) and `mesh.dry_run_devices` of it over the config's processes are compiled
for, deviceless, by that hardware's own compiler; "" simulates `mesh.dry_run_devices` CPU devices (XLA:CPU
accepts what a GPU or TPU compiler may refuse, and its memory figures are a CPU's).

The report, per executable: compiled or not (the compiler's message), its memory from the compiler
(arguments, outputs, temporaries, code) and what the run keeps resident beside it on the device (the
trainer's master weights, AdamW moments and reference policy during a rollout; the drafter trainer's state
during an update, the rollouts' copies of the policy dropped then), against the device's memory: the target's, or
`mesh.device_memory_gb` if smaller (on the CPU stand-in, the resident memory alone is checked). With a
target, also a roofline (`roofline`): the target compiles the policy's forward over k new tokens per row
(k = 1: a decode step; k = each strategy's verify tokens) on a rollout group's devices at batch 1, 16 and
the largest speculative bucket, layers unrolled, over a cache of a mean row's context; its FLOPs and the
bytes it must move, at the target's peak rates, give estimated step times and the verify-k / decode ratio
speculation pays for. `run` raises `DryRunError` (the report attached) when an executable does not compile
or does not fit.

Also reported: `rollout_batches` (the rows a step gives each rollout group, the rows in flight at once,
the tails a step pays), `cache_rows` (how many rows of `rollout.mean_response_len` a paged KV cache holds
on a rollout device) and, with TLT, `drafter_buffer_checkpoint_gb` (what the drafter's online data adds to
each process's checkpoint at most).
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
from jax.experimental.compilation_cache import compilation_cache
from jax.sharding import SingleDeviceSharding

from tlt_jax import sharding, targets
from tlt_jax.drafter import train as drafter_train
from tlt_jax.drafter.buffer import BufferConfig
from tlt_jax.drafter.model import Drafter
from tlt_jax.executables import ExecutablePool
from tlt_jax.models import CausalLM, ModelConfig, hf, lora, transformer
from tlt_jax.models.transformer import KVCache
from tlt_jax.rl import actor as actor_lib
from tlt_jax.rl import bootstrap, builders, checks, rollouts
from tlt_jax.rl import trainer as trainer_lib
from tlt_jax.rollout.base import BaseRollout
from tlt_jax.rollout.state import EngineConfig

GB = 1 << 30

# The config keys that shape each kind of executable (its report name's first parts): what an error names.
_SHAPED_BY = {
    "train": ("rl.actor.micro_batch_rows", "rl.row_len", "rl.actor.remat", "rl.actor.logits_chunk",
              "rl.actor.attention_block", "mesh.data", "mesh.fsdp", "mesh.tensor", "policy.weight_dtype"),
    "rollout/plain": ("rollout.engine.batch_buckets", "rollout.engine.segment_steps", "rollout.engine.kv_block",
                      "rollout.engine.attention"),
    "rollout/speculate": ("rollout.strategies", "rollout.engine.batch_buckets", "rollout.engine.sd_max_batch",
                          "rollout.engine.kv_block", "rollout.engine.attention"),
    "rollout/prefill": ("rollout.engine.batch_buckets", "data.max_prompt_len", "rollout.engine.kv_block",
                        "rollout.engine.attention"),
    "rollout": ("rollout.engine.batch_buckets", "data.max_prompt_len", "rollout.sampling.max_new_tokens",
                "rollout.engine.page_size", "rollout.groups"),
    "eval": ("eval.size", "eval.num_samples", "data.max_prompt_len", "rollout.sampling.max_new_tokens"),
    "drafter": ("drafter.trainer.rows_per_device", "drafter.trainer.row_len", "rollout.groups"),
    "warmup": ("drafter.distill.batch_rows", "drafter.distill.row_len"),
}
# What lowers each kind's memory need.
_REMEDIES = {
    "train": "lower config.rl.actor.micro_batch_rows, set config.rl.actor.remat=True and "
             "config.rl.actor.attention_block, halve the trainer's state with config.policy.weight_dtype=bfloat16, "
             "or shard it over more devices (config.mesh.fsdp)",
    "rollout": "lower config.rollout.engine.batch_buckets (the largest), use a paged cache "
               "(config.rollout.engine.page_size), or fewer rollout groups (config.rollout.groups: more devices each)",
    "eval": "lower config.eval.size or config.eval.num_samples",
    "drafter": "lower config.drafter.trainer.rows_per_device or config.drafter.trainer.row_len",
    "warmup": "lower config.drafter.distill.batch_rows or config.drafter.distill.row_len",
}


class DryRunError(ValueError):
  """An executable does not compile or does not fit; `report` is the whole report."""

  def __init__(self, message: str, report: dict):
    super().__init__(message)
    self.report = report


def shaped_by(name: str) -> tuple[str, ...]:
  """The config keys that shape executable `name` (the longest matching prefix's)."""
  prefix = max((p for p in _SHAPED_BY if name == p or name.startswith(p + "/")), key=len)
  return _SHAPED_BY[prefix]


def model_config(config) -> tuple[ModelConfig, str, object]:
  """The policy's architecture, where it came from, and its tokenizer (None where there is none to read)."""
  path = os.path.join(config.policy.path, "config.json") if config.policy.path else ""
  if path and os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      cfg = ModelConfig.from_hf(json.load(f), source=path)
    return cfg, path, hf.load_tokenizer(config.policy.path)
  if config.policy.path:  # a real model's directory that is not here (e.g. sizing a cluster run on a laptop)
    if not config.model.vocab_size:
      raise ValueError(f"config.model.vocab_size: {path} is not there, so a dry run takes the architecture from "
                       "config.model and needs the vocabulary size")
    return builders.model_config(config), "config.model", None
  # The tiny world: its tokenizer (procedural, or the one SFT saved with the policy) gives the vocabulary.
  tok = bootstrap.load_tokenizer(config)
  return builders.model_config(config, tok), "config.model", tok


def _abstract(build, device: jax.Device):
  """The NNX module `build` makes, as shapes (`nnx.eval_shape`) on `device` (as a loaded model lands on the
  default device; the run's constructors lay it out on their meshes)."""
  graphdef, state = nnx.split(nnx.eval_shape(build))
  return nnx.merge(graphdef, sharding.place(state, SingleDeviceSharding(device)))


def _device_bytes(tree) -> int:
  """Bytes of one device's shards of the (abstract, sharded) arrays of `tree` (the most any device holds)."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _gb(nbytes: float) -> float:
  return round(nbytes / GB, 6)


def _entry(name: str, pool: ExecutablePool, key) -> dict:
  """One executable's report: the compiler's memory figures per device, or its error in one line."""
  entry = {"shaped_by": list(shaped_by(name)), "compile_s": round(pool.compile_seconds.get(key, 0.0), 2)}
  if key in pool.failures:
    e = pool.failures[key]
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return {"compiled": False, "error": f"{type(e).__name__}: {lines[0] if lines else ''}", **entry}
  m = pool[key].memory_analysis()
  return {"compiled": True, "argument_gb": _gb(m.argument_size_in_bytes), "output_gb": _gb(m.output_size_in_bytes),
          "alias_gb": _gb(m.alias_size_in_bytes), "temp_gb": _gb(m.temp_size_in_bytes),
          "code_gb": _gb(m.generated_code_size_in_bytes),
          "resident_gb": _gb(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes), **entry}


def _name(owner: str, key) -> str:
  return "/".join([owner, *map(str, key if isinstance(key, tuple) else (key,))])


def run(config) -> dict:
  """The report (module docstring); raises DryRunError, its report attached, when an executable does not
  compile or does not fit, and ValueError for a config it cannot size."""
  checks.check(config)
  if not config.mesh.target:
    return _run(config)
  # A target's executables cannot be loaded here: JAX's persistent cache would store them for nothing (and
  # warn at every read). Off for the dry run; JAX reopens it after (it decides once per process otherwise).
  cached = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  try:
    return _run(config)
  finally:
    jax.config.update("jax_enable_compilation_cache", cached)
    compilation_cache.reset_cache()


@dataclasses.dataclass
class _Built:
  """What the run's constructors built on shapes, and the pools of what they compiled, by owner."""

  policy: CausalLM
  actor: actor_lib.Actor
  rollout: BaseRollout
  held_out: BaseRollout | None  # the evaluation's own rollout (None: none, or the rollout's)
  pools: dict[str, ExecutablePool]


def _build(config, cfg: ModelConfig, tok, devices) -> _Built:
  """The run's actor, rollouts and (when it would warm one up) drafter warm-up, built as the run builds them
  but on shapes, each having compiled what a step runs (every executable, failures kept)."""
  dtype, spec = jnp.dtype(config.policy.dtype), bootstrap.lora_spec(config)

  def build_policy():  # with LoRA: the base in the compute dtype, the adapters in policy.weight_dtype
    model = CausalLM(cfg, dtype=dtype, param_dtype=config.policy.weight_dtype if spec is None else dtype,
                     rngs=nnx.Rngs(0))
    if spec is not None:
      lora.attach(model, spec, param_dtype=config.policy.weight_dtype)
    return model

  # The trainer's actor over the trainer mesh.
  policy = _abstract(build_policy, devices[0])
  actor = trainer_lib.make_actor(config, policy, devices)
  actor.pool.keep_going = True
  logging.info("dry run: compiling the trainer's step (%d rows x %d tokens)", actor.micro_batch_rows, config.rl.row_len)
  pools = {"train": actor.compile(config.rl.row_len)}
  # The rollouts: the policy's copy in its compute dtype (LoRA merged: the base's shapes) and the drafter. A
  # reduced head's ids come from the warm-up data; any N ids size the executables alike. One chosen by coverage
  # (-1) is sized as the whole vocabulary, its largest.
  copy = _abstract(lambda: CausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0)), devices[0])
  vocab = range(min(max(config.drafter.draft_vocab_size, 0), cfg.vocab_size))
  drafter = _abstract(lambda: Drafter(cfg, feature_layers=config.drafter.feature_layers, draft_vocab=vocab,
                                      dtype=dtype, rngs=nnx.Rngs(0)), devices[0]) \
      if rollouts.uses_drafter(config) else None
  rollout, held_out = rollouts.make(config, copy, drafter, tok, devices, builders.tool_turns(config, tok, workers=0))
  held_out = held_out if held_out is not rollout else None
  for pool in [*rollout.pools().values(), *(held_out.pools().values() if held_out else ())]:
    pool.keep_going = True
  r = config.rollout
  logging.info("dry run: compiling the rollout's executables")
  rollout.prepare(r.prompts_per_step, r.num_samples, first_group_only=True)
  pools.update({"rollout" if owner == "engine" else owner: pool for owner, pool in rollout.pools().items()})
  if held_out is not None:
    logging.info("dry run: compiling the held-out evaluation's executables")
    held_out.prepare(config.eval.size, config.eval.num_samples)
    pools["eval"] = held_out.pools()["engine"]
  # The run warms a drafter up where it finds none (bootstrap.load_drafter), on the policy as loaded (one device
  # holds it whole); a pretrained policy's warm-up also samples its responses first, with a plain engine like
  # the evaluation's (not compiled here).
  if drafter is not None and config.drafter.distill.steps and not os.path.exists(
      config.drafter.path or os.path.join(config.workdir, "drafter")):
    d, pools["warmup"] = config.drafter.distill, ExecutablePool()
    pools["warmup"].keep_going = True
    logging.info("dry run: compiling the drafter warm-up's feature pass and training step")
    drafter_train.compile_warmup(pools["warmup"], _abstract(build_policy, devices[0]), drafter,
                                 batch_rows=d.batch_rows, row_len=d.row_len,
                                 draft_steps=drafter_train.sampling_draft_steps(d.draft_steps,
                                                                               r.sampling.temperature),
                                 **drafter_train.sampling_loss(r.sampling.temperature))
  return _Built(policy, actor, rollout, held_out, pools)


def _resident(built: _Built) -> dict[str, int]:
  """Bytes each part of the run keeps on one device (the fullest) between its steps."""
  actor, engine = built.actor, built.rollout.engines[0]
  trainer = getattr(built.rollout, "drafter_trainer", None)
  return {"trainer": _device_bytes((actor.params, actor.frozen, actor.opt_state)),
          "reference": _device_bytes(actor.params) if actor.uses_ref else 0,
          "rollout": _device_bytes(engine.params), "rollout_drafter": _device_bytes(engine.drafter_params),
          "drafter": _device_bytes((trainer.params, trainer.opt_state)) if trainer is not None else 0,
          "eval": _device_bytes(built.held_out.engines[0].params) if built.held_out is not None else 0}


def _beside(state: dict[str, int], moments: int) -> dict[str, int]:
  """What the run keeps on a device while each kind of executable runs, beyond the executable's own arguments
  (an update takes the params and moments; a gradient or log-prob pass the params alone; the clip the gradient
  alone). The trainer's passes run after the rollouts dropped their copies of the policy
  (`release_policy_params`)."""
  rest = lambda *parts: sum(v for k, v in state.items() if k not in parts)
  return {"train/update": rest("trainer", "rollout", "eval"), "train": rest("trainer", "rollout", "eval") + moments,
          "train/clip": rest("rollout", "eval"),
          "rollout": rest("rollout", "rollout_drafter"), "eval": rest("eval"),
          "drafter": rest("drafter", "rollout", "rollout_drafter"), "warmup": 0}


def _run(config) -> dict:
  start = time.perf_counter()
  target = targets.load(config.mesh.target) if config.mesh.target else None
  devices = (targets.devices(target, config.mesh.dry_run_devices, max(config.distributed.num_processes, 1))
             if target else jax.devices())
  cfg, source, tok = model_config(config)
  cfg = dataclasses.replace(cfg, scan_layers=config.policy.scan_layers)
  if config.rollout.tools and tok is None:
    raise ValueError(f"config.rollout.tools: the dry run renders tool turns with the policy's chat template, and "
                     f"{config.policy.path} is not there")
  built = _build(config, cfg, tok, devices)
  report = {"model": source, "devices": f"{len(devices)} x {devices[0].device_kind}", "target": target and {
      "name": config.mesh.target, "device": target.name, "memory_gb": round(target.memory_gb, 3),
      "peak_bf16_tflops": target.peak_bf16_tflops, "memory_bandwidth_gbps": target.memory_bandwidth_gbps}}
  count = lambda *filters: sum(x.size for x in jax.tree.leaves(nnx.state(built.policy, *filters)))
  report["parameters_b"] = round(count(nnx.Not(nnx.LoRAParam)) / 1e9, 3)
  if built.actor.lora is not None:
    report["lora"] = {"rank": built.actor.lora.rank, "parameters_m": round(count(nnx.LoRAParam) / 1e6, 3)}
  actor, engine = built.actor, built.rollout.engines[0]
  report["trainer_mesh"] = dict(actor.mesh.shape) if actor.mesh is not None else {}
  report["rollout_group_mesh"] = dict(engine.mesh.shape)
  report["rollout_batches"] = batches(config, engine.config.batch_buckets[-1])
  # Everything built is shapes: a concrete array would be memory on this machine (or a failure on a target).
  trainer = getattr(built.rollout, "drafter_trainer", None)
  made = (actor.params, actor.frozen, actor.opt_state, [(e.params, e.drafter_params) for e in built.rollout.engines],
          (trainer.params, trainer.opt_state) if trainer is not None else (),
          built.held_out.engines[0].params if built.held_out is not None else ())
  report["arrays_gb"] = _gb(sum(x.nbytes for x in jax.tree.leaves(made) if isinstance(x, jax.Array)))
  executables = {_name(owner, key): _entry(_name(owner, key), pool, key)
                 for owner, pool in built.pools.items() for key in [*pool.keys(), *pool.failures]}
  state = _resident(built)
  beside = _beside(state, _device_bytes(actor.opt_state))
  for name, entry in executables.items():
    if entry["compiled"]:
      entry["beside_gb"] = _gb(beside[max((p for p in beside if name == p or name.startswith(p + "/")), key=len)])
  for name, entry in executables.items():  # compaction gathers a contiguous cache's values apart (Engine._halve)
    if "/take_rows/" in name and entry["compiled"]:
      halve = executables[name.replace("/take_rows/", "/halve/")]
      halve["beside_gb"] = round(halve["beside_gb"] + entry["argument_gb"], 6)  # the values wait
      entry["beside_gb"] = round(entry["beside_gb"] + entry["output_gb"], 6)  # beside the halved keys
  report.update(executables=executables, resident_gb={k: _gb(v) for k, v in state.items()},
                policy_gb=_gb(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(built.policy)))))
  dtype, r = jnp.dtype(config.policy.dtype), config.rollout
  if trainer is not None:  # the rollout's captured features: this many bytes per process in each checkpoint at most
    report["drafter_buffer_checkpoint_gb"] = _gb(BufferConfig(**config.drafter.buffer).state_bytes(
        r.prompts_per_step * r.num_samples, config.data.max_prompt_len + r.sampling.max_new_tokens, cfg.hidden_size,
        dtype.itemsize))
  limit, report["device_memory"] = (targets.usable_gb(target), target.name) if target else (0.0, None)
  if config.mesh.device_memory_gb and (not limit or config.mesh.device_memory_gb < limit):
    limit, report["device_memory"] = config.mesh.device_memory_gb, "config.mesh.device_memory_gb"
  report["device_memory_gb"] = round(limit, 6)
  report["cache_rows"] = cache_rows(config, cfg, engine.config, dtype.itemsize, trainer is not None,
                                    engine.mesh.size,
                                    (state["rollout"] + state["rollout_drafter"] + beside["rollout"]) / GB, limit)
  if target is not None:
    report["roofline"] = roofline(config, cfg, engine.config, target, engine.mesh, dtype)
  report.update(check(executables, limit, on_cpu=devices[0].platform == "cpu"))
  report["seconds"] = round(time.perf_counter() - start, 1)
  error = failure(report)
  if error:
    raise DryRunError(error, report)
  return report


def failure(report: dict) -> str | None:
  """What a report's first executable that does not compile, else its largest that does not fit, needs changed:
  one line naming it and the config keys; None when every executable compiled and fits."""
  if report["failed"]:
    target = report["target"]
    name = report["failed"][0]
    e = report["executables"][name]
    more = f" (and {len(report['failed']) - 1} more: see the report)" if len(report["failed"]) > 1 else ""
    return (f"{name} does not compile for {target['name'] if target else 'the CPU stand-in'} (shaped by "
            f"{', '.join('config.' + k for k in e['shaped_by'])}): {e['error']}{more}")
  if not report["fits"]:
    name = report["max_per_device_executable"]
    return (f"{name} needs {report['max_per_device_gb']:.4g} GB per device > {report['device_memory_gb']:.4g} GB "
            f"({report['device_memory']}): {_REMEDIES[name.split('/')[0]]}")
  return None


def batches(config, largest: int) -> dict:
  """Rows a step gives the busiest rollout group, rows in flight at once, and the batches it runs:
  in waves, one per `largest` rows, each waiting for its longest row (a tail each); with refill,
  one batch kept full while rows wait (one tail)."""
  r = config.rollout
  rows = -(-r.prompts_per_step // r.groups) * r.num_samples
  return {"rows_per_group": rows, "rows_in_flight": min(rows, largest), "refill": bool(r.engine.refill),
          "tails_with_waves": -(-rows // largest), "tails_with_refill": 1}


def cache_rows(config, cfg: ModelConfig, engine: EngineConfig, itemsize: int, drafter: bool, group_devices: int,
               rollout_resident_gb: float, device_memory_gb: float) -> dict:
  """Rows of a mean response length one rollout device holds in flight: contiguous (each row its
  capacity: the largest bucket) and paged (`engine.page_size`, else kv_block-sized pages; the
  prompt's full pages shared by its samples, each row's last page half empty on average plus one
  play's reservation), in the contiguous cache's bytes and in the device memory the rollout's and the
  rest of the run's resident state leave free (`rollout_resident_gb`; scratch memory not counted)."""
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
  free_bytes = device_memory_gb * GB - rollout_resident_gb * GB
  rows = lambda nbytes: int(nbytes / (page * token_bytes) / row_pages)
  return {"mean_response_len": mean, "prompt_len": prompt, "page_size": page, "kv_bytes_per_token": int(token_bytes),
          "contiguous_rows": contiguous, "contiguous_cache_gb": round(cache_bytes / GB, 3),
          "paged_rows_same_bytes": rows(cache_bytes),
          "paged_rows_device_memory": rows(free_bytes) if device_memory_gb else None,
          "free_gb_for_cache": round(free_bytes / GB, 3) if device_memory_gb else None}


def check(executables: dict[str, dict], limit_gb: float, on_cpu: bool) -> dict:
  """The executables that did not compile, and the largest per-device need among those that did: an
  executable's resident memory (its arguments and outputs), what stays resident beside it, its scratch and
  its code; `fits` whether that is within `limit_gb` (0: no limit).

  XLA:CPU runs bfloat16 matmuls in float32 through converted copies of their operands (weights,
  cache blocks), so on a CPU stand-in the scratch figure overstates an accelerator's many times;
  there only the resident memory is checked. On GPU/TPU all of it is.
  """
  failed = [name for name, e in executables.items() if not e["compiled"]]
  compiled = {name: e for name, e in executables.items() if e["compiled"]}
  for e in compiled.values():
    e["need_gb"] = round(e["resident_gb"] + e.get("beside_gb", 0.0)
                         + (0.0 if on_cpu else e["temp_gb"] + e["code_gb"]), 6)
  out = {"checked": "resident memory (temp not checked: XLA:CPU stand-in)" if on_cpu else "resident + temp memory",
         "failed": failed}
  if compiled:
    worst = max(compiled, key=lambda name: compiled[name]["need_gb"])
    out.update(max_per_device_gb=compiled[worst]["need_gb"], max_per_device_executable=worst)
  out["fits"] = not limit_gb or not compiled or out["max_per_device_gb"] <= limit_gb
  return out


def roofline(config, cfg: ModelConfig, engine: EngineConfig, target: targets.Target, mesh: jax.sharding.Mesh,
             dtype) -> dict:
  """Estimated step times on `target` (module docstring): the policy's forward over k tokens per row of a
  batch on one rollout group's devices (`mesh`, laid out as its engine is: a tensor-parallel group's devices
  each move their share of the weights and the cache), compiled for the target with its layers unrolled and
  a dense attention over a cache of a mean row's context (so the compiler's cost analysis, which counts a
  loop's body once, counts the whole step), at the target's peak FLOP/s and memory bandwidth: the slower of
  the two, per device."""
  r = config.rollout
  context = config.data.max_prompt_len + (r.mean_response_len or r.sampling.max_new_tokens // 4)
  graphdef, params = nnx.split(nnx.eval_shape(lambda: CausalLM(dataclasses.replace(cfg, scan_layers=False),
                                                               dtype=dtype, rngs=nnx.Rngs(0))))
  params = sharding.place(params, sharding.param_shardings(params, mesh))
  rows = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding.array_sharding(
      shape, ("batch",) + (None,) * (len(shape) - 1), mesh))

  def forward(params, cache, tokens, positions, mask):
    out = transformer.verify(nnx.merge(graphdef, params), tokens, positions, mask, cache, kv_block=None,
                             attention="xla")
    return out.logits, out.cache

  sd = engine.bucket(min(engine.sd_max_batch, engine.batch_buckets[-1]))
  batches_ = sorted({1, engine.bucket(min(16, engine.batch_buckets[-1])), sd})
  ks = sorted({1, *(s.verify_tokens for s in engine.strategies)})
  steps, seconds, pool = {}, {}, ExecutablePool()
  pool.keep_going = True
  for b in batches_:
    shape = (cfg.num_layers, b, context, cfg.num_kv_heads, cfg.head_dim)
    cache = KVCache(k=jax.ShapeDtypeStruct(shape, dtype), v=jax.ShapeDtypeStruct(shape, dtype),
                    lengths=jax.ShapeDtypeStruct((b,), jnp.int32), pages=None)
    cache = sharding.place(cache, sharding.cache_shardings(cache, mesh))
    for k in ks:
      args = (rows((b, k), jnp.int32), rows((b, k), jnp.int32), rows((b, k, k), jnp.bool_))
      def build(cache=cache, args=args):
        with jax.set_mesh(mesh):
          return jax.jit(forward, donate_argnums=(1,)).lower(params, cache, *args).compile()
      exe = pool.get_or_compile((b, k), build)
      if exe is None:
        steps[f"{b}/{k}"] = {"error": str(pool.failures[(b, k)]).splitlines()[0]}
        continue
      flops, nbytes = cost(exe)
      seconds[b, k] = target.roofline_s(flops, nbytes)
      steps[f"{b}/{k}"] = {"tflops": float(f"{flops / 1e12:.4g}"), "gbytes": float(f"{nbytes / 1e9:.4g}"),
                           "ms": float(f"{1e3 * seconds[b, k]:.4g}")}
  ratios = {str(b): {str(k): round(seconds[b, k] / seconds[b, 1], 3) for k in ks if k > 1}
            for b in batches_ if all((b, k) in seconds for k in ks)}
  return {"estimate": f"forward over k tokens per row at {context} tokens of context on {mesh.size} device(s), at "
                      f"{target.peak_bf16_tflops} bf16 TFLOP/s and {target.memory_bandwidth_gbps} GB/s each",
          "context_tokens": context, "steps": steps, "verify_over_decode": ratios}


def cost(compiled) -> tuple[float, float]:
  """(FLOPs, bytes) of one device's step: the FLOPs the target compiler's cost analysis counts (a GPU
  executable compiled without its device reports none: XLA's HLO cost analysis of its optimized module
  counts them), and the bytes the step must move at least, its arguments read once and its outputs written
  once (`memory_analysis`; the cost analysis's bytes count every fusion's operands, 3-12x these on a decode
  step)."""
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else None
  if not analysis:
    from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
    from jax._src.lib import _jax  # pylint: disable=import-outside-toplevel
    module = compiled.runtime_executable().hlo_modules()[0]
    analysis = _jax.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), module)
  m = compiled.memory_analysis()
  return float(analysis.get("flops", 0.0)), float(m.argument_size_in_bytes + m.output_size_in_bytes
                                                  - m.alias_size_in_bytes)
