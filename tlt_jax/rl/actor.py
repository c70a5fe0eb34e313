"""The policy update: log-probs recomputed by the trainer, GRPO/DAPO loss, micro-batched gradients.

Precision follows the policy's weights (`policy.weight_dtype`): float32 masters (mixed precision) take
float32 gradients, summed over micro-batches in float32, and an exact update; bfloat16 weights (pure
bfloat16) take their update stochastically rounded, so that an update far below a weight's spacing
still moves it by that amount on average. Log-probs are at the rollout's sampling temperature (logits
/ T, as verl and TRL compute them): the ratio's behaviour policy is the one that sampled.

Rows are packed (prompt, response) sequences (`packing.pack(..., index=True)`); each micro-batch
is a fixed [micro_batch_rows, row_len] shape, so one executable serves every step. Gradients of
the micro-batches of a mini-batch are summed (the token weights already sum to 1 over the
mini-batch, so the sum is the mini-batch's loss gradient) and applied in one optimizer update.
An update whose loss or gradient is not finite is skipped: params and optimizer state stay
as they were, and the returned stats say `skipped=1`.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from tlt_jax import packing, sharding
from tlt_jax.executables import ExecutablePool
from tlt_jax.models import lora
from tlt_jax.models.transformer import CausalLM
from tlt_jax.rl import grpo

# Planes of a training batch beyond the packed rows' tokens / positions / segments.
FLOAT_PLANES = ("weights", "advantages", "old_logp", "ref_logp", "is_weights", "rollout_logp")


def token_logprobs(model: CausalLM, tokens_BxT, positions_BxT, segments_BxT, *, temperature: float = 1.0,
                   remat: bool = False, chunk: int = 1024, query_block: int | None = None):
  """(log p(token t | its sample's tokens before t), entropy of that distribution), [B, T] each, of the
  distribution softmax(logits / temperature), in float32.

  Slot 0 (and every sample's first slot, a prompt token) has no prediction of its own sample:
  its values are meaningless and always weigh 0. Rows longer than `chunk` run the LM head over `chunk`
  positions at a time, recomputed in the backward pass, so [B, T, vocab] logits never exist at once (a
  32k-token row of a 152k vocabulary would be 20 GB); a row of one chunk keeps its log-softmax for the
  backward pass instead (recomputing it would save no memory: the backward pass starts with the head).
  """
  b, t = tokens_BxT.shape
  hidden, _, _ = model(tokens_BxT, positions_BxT, None, packing.segment_mask(segments_BxT), remat=remat,
                       query_block=query_block)
  c = min(chunk, t)
  n = -(-t // c)
  targets = jnp.pad(tokens_BxT[:, 1:], ((0, 0), (0, n * c - t + 1)))  # slot s predicts token s + 1
  hidden = jnp.pad(hidden, ((0, 0), (0, n * c - t), (0, 0)))

  def head(h_BxCxH, y_BxC):
    logp_all = jax.nn.log_softmax(model.logits(h_BxCxH) / temperature, axis=-1)
    return (jnp.take_along_axis(logp_all, y_BxC[..., None], axis=-1)[..., 0],
            -(jnp.exp(logp_all) * logp_all).sum(-1))

  split = lambda x: jnp.moveaxis(x.reshape(b, n, c, *x.shape[2:]), 1, 0)
  head = jax.checkpoint(head) if n > 1 else head
  logp, entropy = jax.lax.map(lambda args: head(*args), (split(hidden), split(targets)))
  merge = lambda x: jnp.pad(jnp.moveaxis(x, 0, 1).reshape(b, n * c)[:, :t - 1], ((0, 0), (1, 0)))
  return merge(logp), merge(entropy)


def make_optimizer(learning_rate: float, warmup_steps: int, weight_decay: float) -> optax.GradientTransformation:
  """AdamW (`rl.optimizer`; its `max_grad_norm` is the actor's, which clips the gradient in place first)."""
  schedule = optax.linear_schedule(0.0, learning_rate, warmup_steps) if warmup_steps else learning_rate
  return optax.adamw(schedule, b1=0.9, b2=0.999, weight_decay=weight_decay)


class RoundingState(NamedTuple):
  count: jax.Array  # updates so far: the stochastic rounding's noise is keyed by it


def _counted() -> optax.GradientTransformation:
  """Counts updates (leaves them unchanged): the key of a bfloat16 policy's stochastic rounding, kept in
  the optimizer state so that a resumed run rounds as an uninterrupted one."""
  return optax.GradientTransformation(lambda _: RoundingState(jnp.zeros([], jnp.int32)),
                                      lambda u, s, p=None: (u, RoundingState(s.count + 1)))


def stochastic_round(x, key) -> jax.Array:
  """float32 -> bfloat16 rounding up with probability (x - down) / (up - down): unbiased, E[round(x)] = x.
  Noise below bfloat16's last bit is added to the float32 bits, then those bits are dropped."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  noise = jax.random.bits(key, x.shape, jnp.uint32) >> 16
  rounded = (bits + noise) & jnp.uint32(0xFFFF0000)
  return jax.lax.bitcast_convert_type(rounded, jnp.float32).astype(jnp.bfloat16)


def rollout_copy(params, dtype):
  """The policy's params cast to the rollout's compute dtype (each array keeps its sharding)."""
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


class Actor:
  """Holds the policy's params and optimizer state; updates them from packed, weighted rows.

  A policy with LoRA adapters (`tlt_jax.models.lora`) trains its adapters alone: `params` and the
  optimizer state are the adapters', the base weights (`frozen`) take no gradient."""

  def __init__(self, model: CausalLM, optimizer: optax.GradientTransformation, *, micro_batch_rows: int,
               loss: grpo.Objective = grpo.Objective(), remat: bool = False, logits_chunk: int = 1024,
               attention_block: int = 0, max_grad_norm: float = 0.0, temperature: float = 1.0, seed: int = 0,
               mesh: jax.sharding.Mesh | None = None):
    """`mesh`: micro-batches are split over its batch axes (model already placed on it); None: as given.
    `attention_block` > 0: attention over this many queries at a time; `max_grad_norm` > 0: the gradient
    is scaled to at most this global norm before `optimizer` sees it (in its own buffer: a clip inside the
    optimizer's step made XLA hold a clipped copy of the whole gradient); `temperature`: the rollout's
    (log-probs of logits / T); `seed`: a bfloat16 policy's stochastic rounding; `loss`: the objective
    (`rl.loss`). Config: `rl.actor` gives the keyword arguments but `loss`, `max_grad_norm`, `temperature`,
    `seed` and `mesh`; `rl.optimizer` those of `make_optimizer` and `max_grad_norm`."""
    self.lora = lora.spec_of(model)
    self.graphdef, self.params, self.frozen = nnx.split(model, nnx.Param if self.lora is None else nnx.LoRAParam, ...)
    self.rounding = any(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(self.params))
    self.optimizer = optax.chain(optimizer, _counted()) if self.rounding else optimizer
    self.seed = seed
    optimizer = self.optimizer
    abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(self.params))  # a dry run's
    on_mesh = all(isinstance(getattr(x, "sharding", None), NamedSharding) for x in jax.tree.leaves(self.params))
    # The moments sharded like their params (FSDP), the counts replicated: also what the update returns, so
    # that its second call finds the first's executable.
    if abstract or on_mesh:
      shardings = sharding.optimizer_shardings(optimizer, self.params)
      if abstract:
        self.opt_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                      jax.eval_shape(optimizer.init, self.params), shardings)
      else:
        self.opt_state = jax.jit(optimizer.init, out_shardings=shardings)(self.params)
    else:
      self.opt_state = optimizer.init(self.params)
    self.micro_batch_rows = micro_batch_rows
    self.max_grad_norm = max_grad_norm
    self.loss = loss
    self.uses_ref = loss.kl_coef > 0
    self._forward = dict(temperature=temperature or 1.0, remat=remat, chunk=logits_chunk,
                         query_block=attention_block or None)
    self.mesh = mesh
    self.pool = ExecutablePool()  # `compile`'s
    # Log-probs come back to the host: replicated, so that every process can read them.
    self._logprobs = jax.jit(self._logprobs_fn, out_shardings=None if mesh is None else NamedSharding(mesh, P()))
    # Gradients come out sharded like the params they belong to (FSDP), not gathered.
    param_shardings = jax.tree.map(lambda x: x.sharding, self.params)
    self._grads = jax.jit(self._grads_fn, out_shardings=(param_shardings, None), donate_argnums=(3,))
    self._zeros = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p), out_shardings=param_shardings)
    self._clip = jax.jit(self._clip_fn, donate_argnums=(0,))
    self._apply = jax.jit(self._apply_fn, donate_argnums=(0, 1))
    self._rollout_params = jax.jit(self._rollout_params_fn, static_argnums=(2,))

  # ---- pure functions ----

  def _logprobs_fn(self, params, frozen, tokens, positions, segments):
    return token_logprobs(nnx.merge(self.graphdef, params, frozen), tokens, positions, segments,
                          **{**self._forward, "remat": False})[0]

  def _grads_fn(self, params, frozen, batch, sum_so_far):
    """The micro-batch's loss gradient added to `sum_so_far` (donated: the sum is updated in place)."""
    def loss(p):
      logp, entropy = token_logprobs(nnx.merge(self.graphdef, p, frozen), batch["tokens"], batch["positions"],
                                     batch["segments"], **self._forward)
      value, stats = grpo.policy_loss(logp, batch["old_logp"], batch["advantages"], batch["weights"], self.loss,
                                      segments_BxT=batch["segments"],
                                      ref_logp_BxT=batch["ref_logp"] if self.uses_ref else None,
                                      is_weights_BxT=batch["is_weights"], rollout_logp_BxT=batch["rollout_logp"],
                                      entropy_BxT=entropy)
      stats["entropy"] = (entropy * batch["weights"]).sum()
      return value, stats
    (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return jax.tree.map(jnp.add, sum_so_far, grads), {"loss": value, **stats}

  def _clip_fn(self, grads):
    """The gradient's global norm, and the gradient scaled to at most `max_grad_norm` (donated: in place)."""
    norm = optax.tree.norm(grads)
    if self.max_grad_norm > 0:
      scale = jnp.minimum(1.0, self.max_grad_norm / norm)
      grads = jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)
    return grads, norm

  def _apply_fn(self, params, opt_state, grads):
    """The optimizer update. Without a test of the gradient's norm inside (the host reads it first): each
    new moment and weight is then written over its old one in place, with no copies in scratch."""
    updates, new_state = self.optimizer.update(grads, opt_state, params)
    if self.rounding:  # bfloat16 weights: p + u in float32, stochastically rounded, a key per leaf
      leaves, tree = jax.tree.flatten(params)
      key = jax.random.fold_in(jax.random.key(self.seed), new_state[-1].count)
      new = [stochastic_round(p.astype(jnp.float32) + u.astype(jnp.float32), jax.random.fold_in(key, i))
             if p.dtype == jnp.bfloat16 else (p + u).astype(p.dtype)
             for i, (p, u) in enumerate(zip(leaves, tree.flatten_up_to(updates)))]
      return jax.tree.unflatten(tree, new), new_state
    return optax.apply_updates(params, updates), new_state

  def _rollout_params_fn(self, params, frozen, dtype):
    return rollout_copy(nnx.state(lora.merged(nnx.merge(self.graphdef, params, frozen))), dtype)

  # ---- host side ----

  def _on_mesh(self):
    """The actor's mesh set while its steps trace: the model's activation constraints hold the micro-batch's
    rows split over the batch axes (FSDP: the weights gathered, the rows not; left to XLA, a sharded embedding
    axis made it keep every row on every device and all-reduce partial sums: 8x the activations)."""
    return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

  def _micro_batches(self, planes: dict[str, np.ndarray]):
    """Splits [R, T] planes into [micro_batch_rows, T] pieces, padding rows weighing 0."""
    rows = planes["tokens"].shape[0]
    m = self.micro_batch_rows
    padded = -(-rows // m) * m
    planes = {k: np.pad(v, ((0, padded - rows), (0, 0))) for k, v in planes.items()}
    out = [{k: v[i:i + m] for k, v in planes.items()} for i in range(0, padded, m)]
    if self.mesh is None:
      return out
    place = lambda x: jax.device_put(x, sharding.array_sharding(x.shape, ("batch", None), self.mesh))
    return [{k: place(v) for k, v in mb.items()} for mb in out]

  def logprobs(self, params, rows_5xRxT: np.ndarray) -> np.ndarray:
    """[R, T] log-probs of packed rows under `params` (the current policy's, or a reference's)."""
    planes = dict(zip(("tokens", "positions", "segments"), rows_5xRxT[:3]))
    with self._on_mesh():
      out = [np.asarray(self._logprobs(params, self.frozen, mb["tokens"], mb["positions"], mb["segments"]))
             for mb in self._micro_batches(planes)]
    return np.concatenate(out)[:rows_5xRxT.shape[1]]

  def update(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
    """One optimizer update from a mini-batch of [R, T] planes; returns its loss statistics and
    `skipped` (1.0 when the loss or the gradient was not finite and nothing changed)."""
    grads, sums = self._zeros(self.params), {}
    for mb in self._micro_batches(batch):
      with self._on_mesh():
        grads, stats = self._grads(self.params, self.frozen, mb, grads)
      for k, v in stats.items():
        sums[k] = sums.get(k, 0.0) + float(v)
    if not all(map(math.isfinite, sums.values())):
      return {**sums, "grad_norm": math.nan, "skipped": 1.0}
    grads, grad_norm = self._clip(grads)
    grad_norm = float(grad_norm)
    if not math.isfinite(grad_norm):
      return {**sums, "grad_norm": grad_norm, "skipped": 1.0}
    self.params, self.opt_state = self._apply(self.params, self.opt_state, grads)
    return {**sums, "grad_norm": grad_norm, "skipped": 0.0}

  def model(self) -> CausalLM:
    return nnx.merge(self.graphdef, self.params, self.frozen)

  def rollout_params(self, dtype) -> nnx.State:
    """The policy's params as the rollouts' plain model takes them: adapters folded into the kernels, cast
    to the compute `dtype`."""
    if self.lora is None:
      return rollout_copy(self.params, dtype)
    return self._rollout_params(self.params, self.frozen, jnp.dtype(dtype))

  def compile(self, row_len: int) -> ExecutablePool:
    """Compiles, ahead of time for the actor's (possibly abstract) params, what a step runs on micro-batches of
    rows of `row_len` tokens into `pool`: their log-probs, the gradient, its clip and the optimizer update (with LoRA,
    also the rollouts' merged copy). A dry run's sizes; the run itself compiles the same at their first call."""
    shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    params, opt_state, frozen = (jax.tree.map(shape, t) for t in (self.params, self.opt_state, self.frozen))
    rows = (self.micro_batch_rows, row_len)
    where = None if self.mesh is None else sharding.array_sharding(rows, ("batch", None), self.mesh)
    batch = {k: jax.ShapeDtypeStruct(rows, jnp.int32, sharding=where) for k in ("tokens", "positions", "segments")}
    batch.update({k: jax.ShapeDtypeStruct(rows, jnp.float32, sharding=where) for k in FLOAT_PLANES})
    def compile_(name, fn, *args):
      with self._on_mesh():
        self.pool.get_or_compile(name, lambda: fn.lower(*args).compile())
    compile_("logprobs", self._logprobs, params, frozen, batch["tokens"], batch["positions"], batch["segments"])
    compile_("gradient", self._grads, params, frozen, batch, params)
    compile_("clip", self._clip, params)
    compile_("update", self._apply, params, opt_state, params)
    if self.lora is not None:
      compile_("rollout_params", self._rollout_params, params, frozen, jnp.dtype(self.model().dtype))
    return self.pool


def training_batch(rows_5xRxT: np.ndarray, advantages: np.ndarray, keep: np.ndarray, aggregation: str,
                   old_logp: np.ndarray, ref_logp: np.ndarray | None, is_weights: np.ndarray | None = None,
                   max_len: int = 0, rollout_logp: np.ndarray | None = None) -> dict[str, np.ndarray]:
  """The planes `Actor.update` takes, for packed rows whose index plane numbers the samples (and whose loss
  mask says which tokens train: a rollout correction's rejections already out); `is_weights` [R, T]: each
  token's policy-loss weight (the rollout correction's; None: 1); `max_len`: the response budget (the "constant"
  aggregation's normaliser); `rollout_logp`: the rollout's log-probs (None: `old_logp`)."""
  tokens, positions, segments, loss_mask, index = rows_5xRxT
  adv = np.where(index > 0, np.asarray(advantages, np.float32)[np.maximum(index - 1, 0)], 0.0)
  return {"tokens": tokens, "positions": positions, "segments": segments,
          "weights": grpo.token_weights(index, loss_mask, keep, aggregation, max_len),
          "advantages": adv.astype(np.float32),
          "old_logp": old_logp, "ref_logp": old_logp if ref_logp is None else ref_logp,
          "is_weights": np.ones(tokens.shape, np.float32) if is_weights is None else is_weights.astype(np.float32),
          "rollout_logp": old_logp if rollout_logp is None else rollout_logp}


def response_plane(rows_5xRxT: np.ndarray, values: Sequence[np.ndarray]) -> np.ndarray:
  """[R, T] float32: each packed sample's per-trained-token `values` (e.g. the rollout's log-probs of its
  tokens, a tool turn's left out) at its trained slots, in order (a sample truncated by packing: its first
  ones); 0 elsewhere."""
  _, _, _, loss_mask, index = rows_5xRxT
  out = np.zeros(index.shape, np.float32)
  for number, v in enumerate(values, 1):
    slots = np.nonzero((index == number) & (loss_mask > 0))  # one row, in order
    out[slots] = np.asarray(v, np.float32)[:len(slots[0])]
  return out
