"""EAGLE distillation of the drafter: packing, target features, loss, optimizer, train step.

A sequence x_0..x_{L-1} (prompt + response) and the target's features f_0..f_{L-1} give the
drafter pairs (f_t, x_{t+1}) at position t, each predicting f_{t+1}. The loss at pair t is
  SmoothL1(predicted, f_{t+1})  +  w * CE(softmax(lm_head(f_{t+1}) / T), log_softmax(lm_head(predicted) / T))
over pairs whose x_{t+1} is a response token: EAGLE's (w = 0.1, T = 1) for greedy rollouts; at a
sampling temperature T > 0 the soft cross-entropy (the forward KL to the target's sampling
distribution, what membership verification accepts by) at that T, weighted as much as the features
(w = 1: `sampling_loss`). A drafter with a reduced-vocabulary head
(`draft_vocab`) takes the cross-entropy over its N tokens (the target's distribution restricted
to them, renormalised, as EAGLE-3 trains its `draft_vocab_size` head); `frequent_tokens` picks
the N from the training data. EAGLE-3 drafters (`feature_layers` set) read a
learned fusion of three target layers, which lives in a different space from f_{t+1}, so their
feature term has weight 0 (only the logit term trains them).

A drafter trained on true features alone degrades from its second draft step on, where it reads its
own predictions. `draft_steps` > 1 trains those steps too (EAGLE-3's "training-time test"): step k
runs the drafter again over every position with its own step-(k-1) features as input and a mask
that lets each position see what a k-th draft step sees (`step_mask`), in one forward per step.

The target is frozen: gradients are taken with respect to the drafter's parameters only, and the
embedding and lm_head are read from the target passed in, never copied. `Pairs` is the unit of
training data, so the online trainer can build it from features captured by the rollout and
reuse `make_train_step` as is.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from typing import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx

from tlt_jax.drafter.model import Drafter, check_feature_layers
from tlt_jax.executables import ExecutablePool
from tlt_jax.models.transformer import CausalLM
from tlt_jax.packing import Sequences, pack, segment_mask

LOGIT_WEIGHT = 0.1  # EAGLE's weight of the soft cross-entropy beside the feature regression
SAMPLING_LOGIT_WEIGHT = 1.0  # its weight for a sampling rollout (T > 0): the distribution is what is verified


def sampling_loss(temperature: float) -> dict:
  """`loss_fn`'s temperature and logit weight for a rollout sampling at `temperature` (0: greedy)."""
  if temperature > 0:
    return {"temperature": temperature, "logit_weight": SAMPLING_LOGIT_WEIGHT}
  return {"temperature": 1.0, "logit_weight": LOGIT_WEIGHT}


def sampling_draft_steps(draft_steps: int, temperature: float) -> int:
  """The training-time test's draft steps: `draft_steps`, or for 0 two for a sampling rollout and one for a
  greedy one (train_drafter's rule, shared by the warm-up and the online trainer)."""
  return draft_steps or (2 if temperature > 0 else 1)

@flax.struct.dataclass
class Pairs:
  """Packed drafter training pairs; slot t holds pair (f_t, x_{t+1}) -> f_{t+1}."""

  tokens: jax.Array  # [B, T] int32: x_{t+1}
  positions: jax.Array  # [B, T] int32: t, restarting at 0 for every packed sample
  segments: jax.Array  # [B, T] int32: sample id within the row, 0 = padding / no pair
  weights: jax.Array  # [B, T] float32: 1 where x_{t+1} is a response token
  hidden: jax.Array  # [B, T, H] f_t: the target's final hidden state (after its final norm)
  aux: tuple[jax.Array, ...]  # EAGLE-3: the feature layers' outputs at t ([B, T, H] each); else ()
  next_hidden: jax.Array  # [B, T, H] f_{t+1}


def sequence_pairs(target: CausalLM, feature_layers: Sequence[int], rows: np.ndarray) -> Pairs:
  """Drafter pairs of packed rows ([4, B, T] from `pack`), features from one target forward."""
  check_feature_layers(target.config.num_layers, feature_layers)
  graphdef, params = nnx.split(target)
  return _sequence_pairs(graphdef, tuple(feature_layers), params, *(jnp.asarray(x) for x in rows))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _sequence_pairs(graphdef, feature_layers, params, tokens, positions, segments, loss_mask) -> Pairs:
  target = nnx.merge(graphdef, params)
  hidden, aux, _ = target(tokens, positions, None, segment_mask(segments), hidden_layers=feature_layers)
  shift = lambda x: jnp.concatenate([x[:, 1:], jnp.zeros_like(x[:, :1])], axis=1)
  # Pair t exists when x_{t+1} belongs to the same sample as x_t.
  valid = (shift(segments) == segments) & (segments > 0)
  return Pairs(tokens=shift(tokens), positions=positions, segments=jnp.where(valid, segments, 0),
               weights=(valid & (shift(loss_mask) > 0)).astype(jnp.float32), hidden=hidden, aux=aux,
               next_hidden=shift(hidden))


def step_mask(segments_BxT: jax.Array, step: int) -> jax.Array:
  """[B, T, step * T] attention mask of draft step `step` (1: the pairs themselves, `segment_mask`) in
  training-time test: the query at t stands for the step-th node of a chain rooted at t - step + 1, so
  it sees the step-1 keys of its sample up to that root (true features) and, of each later step j, the
  one key at t - (step - j) (the chain's predicted features); every slot sees itself."""
  t = segments_BxT.shape[1]
  same = segments_BxT[:, :, None] == segments_BxT[:, None, :]
  q, p = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
  parts = [same & (p <= q - (step - 1))] + [same & (p == q - (step - j)) for j in range(2, step + 1)]
  parts[-1] = parts[-1] | (p == q)
  return jnp.concatenate(parts, axis=-1)


def step_predictions(drafter: Drafter, target: CausalLM, pairs: Pairs, draft_steps: int = 1) -> list[jax.Array]:
  """The drafter's predicted next features [B, T, H] (float32) at each of `draft_steps` steps of
  training-time test: step k feeds position t the step-(k-1) prediction at t - 1 (step 1: the target's
  features) and the true next token, attending as the k-th node of a draft chain rooted at t - k + 1
  does (`step_mask`), so step k's prediction at t is what that chain's k-th draft step predicts."""
  b, t = pairs.tokens.shape
  features = drafter.target_features(pairs.hidden, pairs.aux)
  cache = drafter.empty_cache(b, draft_steps * t, features.dtype)
  out = []
  for k in range(1, draft_steps + 1):
    # With a window of k * T slots the step's keys land in the last T; the earlier steps' stay.
    predicted, cache = drafter(target, features, pairs.tokens, pairs.positions, cache, step_mask(pairs.segments, k))
    out.append(predicted.astype(jnp.float32))
    features = jnp.concatenate([jnp.zeros_like(predicted[:, :1]), predicted[:, :-1]], axis=1).astype(features.dtype)
  return out


def loss_fn(drafter: Drafter, target: CausalLM, pairs: Pairs, exact_top1: bool = False,
            draft_steps: int = 1, temperature: float = 1.0,
            logit_weight: float = LOGIT_WEIGHT) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Weighted mean EAGLE loss over the pairs, and metrics (the first step's losses and top-1 agreement,
  later steps' top-1 agreement, pair count).

  `draft_steps` > 1 adds EAGLE-3's training-time test (`step_predictions`): step k's loss is over the
  pairs with k - 1 earlier positions in their sample, and the loss returned averages the steps' with
  weights 0.8^(k-1) (metrics' `loss` is the first step's, comparable whatever `draft_steps`).
  top1 (step 1; top1_k: step k): the drafter's most likely token is the target's. With a reduced
  vocabulary it is compared within the draft vocabulary (cheap, for training steps) unless
  `exact_top1`, which compares it with the target's most likely token over its whole vocabulary (a
  full lm_head pass, for evaluation).
  """
  true_next = pairs.next_hidden.astype(jnp.float32)
  head = drafter.head(target)
  target_logits = drafter.logits(target, head, pairs.next_hidden)
  target_probs = jax.nn.softmax(target_logits / temperature)
  target_top = jnp.argmax(target.logits(pairs.next_hidden), -1) if exact_top1 and drafter.draft_vocab else None
  feature_weight = 0.0 if drafter.feature_layers else 1.0
  metrics, total, weight_sum = {}, 0.0, 0.0
  for k, predicted in enumerate(step_predictions(drafter, target, pairs, draft_steps), start=1):
    feature = optax.huber_loss(predicted, true_next, delta=1.0).mean(-1)  # SmoothL1 with beta 1
    logits = drafter.logits(target, head, predicted)
    logit = -jnp.sum(target_probs * jax.nn.log_softmax(logits / temperature), axis=-1)
    w = pairs.weights * (pairs.positions >= k - 1)
    n = jnp.maximum(w.sum(), 1.0)
    mean = lambda x, w=w, n=n: jnp.sum(x * w) / n
    loss = feature_weight * mean(feature) + logit_weight * mean(logit)
    if target_top is not None:
      top1 = drafter.target_ids(jnp.argmax(logits, -1)) == target_top
    else:
      top1 = jnp.argmax(logits, -1) == jnp.argmax(target_logits, -1)
    if k == 1:
      metrics.update(loss=loss, feature_loss=mean(feature), logit_loss=mean(logit), top1=mean(top1), pairs=w.sum())
    else:
      metrics[f"top1_{k}"] = mean(top1)
    total, weight_sum = total + 0.8 ** (k - 1) * loss, weight_sum + 0.8 ** (k - 1)
  return total / weight_sum, metrics


def frequent_tokens(sequences: Sequences, vocab_size: int, n: int) -> tuple[int, ...]:
  """The draft vocabulary of `n` tokens: the most frequent response tokens of `sequences` (ties and
  unseen fill-ins by lower id), in increasing id order."""
  if not 1 <= n <= vocab_size:
    raise ValueError(f"a draft vocabulary of {n} tokens does not fit the target's vocabulary of {vocab_size}")
  counts = np.zeros((vocab_size,), np.int64)
  for _, response, *_ in sequences:
    np.add.at(counts, np.asarray(response, np.int64), 1)
  order = np.lexsort((np.arange(vocab_size), -counts))  # by count descending, then id
  return tuple(int(i) for i in np.sort(order[:n]))


HEAD_COVERAGE = 0.99  # share of the response tokens a head chosen by coverage holds
HEAD_MULTIPLE = 256  # its size is rounded up to a multiple of this (whole lanes of a matmul) ...
HEAD_CAP = 32768  # ... and capped (fastrl's default head size)


def head_for_coverage(sequences: Sequences, vocab_size: int,
                      share: float = HEAD_COVERAGE) -> tuple[tuple[int, ...], float]:
  """A reduced head chosen by its data: the smallest N whose most frequent response tokens of
  `sequences` cover `share` of them, rounded up to a multiple of HEAD_MULTIPLE and capped at HEAD_CAP;
  () (the whole vocabulary) when that is not smaller than `vocab_size`. Returns the head's ids and the
  share of the response tokens they cover."""
  if not 0 < share <= 1:
    raise ValueError(f"a head's coverage must lie in (0, 1], got {share}")
  counts = np.zeros((vocab_size,), np.int64)
  for _, response, *_ in sequences:
    np.add.at(counts, np.asarray(response, np.int64), 1)
  total = counts.sum()
  if not total:
    return (), 1.0
  covered = np.cumsum(np.sort(counts)[::-1]) / total
  needed = int(np.searchsorted(covered, share - 1e-12)) + 1  # the first N reaching the share
  n = min(-(-needed // HEAD_MULTIPLE) * HEAD_MULTIPLE, HEAD_CAP)
  if n >= vocab_size:
    return (), 1.0
  return frequent_tokens(sequences, vocab_size, n), float(covered[n - 1])


def draft_head(sequences: Sequences, vocab_size: int, size: int = -1,
               share: float = HEAD_COVERAGE) -> tuple[tuple[int, ...], float]:
  """A drafter's head for its training `sequences`: `size` -1 chooses it by coverage
  (`head_for_coverage` of `share`), 0 is the whole vocabulary, N the N most frequent response tokens.
  Returns its ids (() for the whole vocabulary) and the share of the response tokens they cover."""
  if size == -1:
    return head_for_coverage(sequences, vocab_size, share)
  if size == 0:
    return (), 1.0
  vocab = frequent_tokens(sequences, vocab_size, size)
  return vocab, coverage(sequences, vocab)


def coverage(sequences: Sequences, draft_vocab: Sequence[int]) -> float:
  """Fraction of the response tokens of `sequences` inside `draft_vocab`."""
  tokens = np.concatenate([np.asarray(r, np.int64) for _, r, *_ in sequences] or [np.zeros((0,), np.int64)])
  return float(np.isin(tokens, np.asarray(draft_vocab)).mean()) if len(tokens) else 0.0


def cosine_schedule(learning_rate: float, steps: int, warmup_steps: int | None = None) -> optax.Schedule:
  """Linear warmup (default 10% of the steps) then cosine decay to 0 at `steps`."""
  warmup = max(steps // 10, 1) if warmup_steps is None else warmup_steps
  return optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup, max(steps, warmup + 1))


def make_optimizer(learning_rate: float | optax.Schedule) -> optax.GradientTransformation:
  """AdamW (betas 0.9, 0.95; weight decay 0.01) after global-norm clipping at 1.0."""
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(learning_rate, b1=0.9, b2=0.95, weight_decay=0.01))


def _grads(drafter_def, target_def, loss_args, drafter_params, target_params, pairs):
  target_model = nnx.merge(target_def, target_params)
  grad_fn = jax.grad(lambda p: loss_fn(nnx.merge(drafter_def, p), target_model, pairs, **dict(loss_args)),
                     has_aux=True)
  return grad_fn(drafter_params)


def _loss_args(draft_steps: int, temperature: float, logit_weight: float) -> tuple:
  return (("draft_steps", draft_steps), ("temperature", temperature), ("logit_weight", logit_weight))


def make_train_step(drafter: Drafter, target: CausalLM, optimizer: optax.GradientTransformation,
                    draft_steps: int = 1, temperature: float = 1.0, logit_weight: float = LOGIT_WEIGHT) -> Callable:
  """Jitted `step(drafter_params, opt_state, target_params, pairs) -> (drafter_params, opt_state, metrics)`
  (`loss_fn` over `draft_steps` steps, at `temperature` with `logit_weight`).

  The graphdefs are captured once; the target's params are an argument, so a live policy's
  new weights go in without recompiling. Drafter params and optimizer state are donated.
  """
  grads = functools.partial(_grads, nnx.graphdef(drafter), nnx.graphdef(target),
                            _loss_args(draft_steps, temperature, logit_weight))

  def step(drafter_params, opt_state, target_params, pairs):
    g, metrics = grads(drafter_params, target_params, pairs)
    return (*apply_gradients(optimizer, drafter_params, opt_state, g), metrics)

  return jax.jit(step, donate_argnums=(0, 1))


def make_grad_step(drafter: Drafter, target: CausalLM, draft_steps: int = 1, temperature: float = 1.0,
                   logit_weight: float = LOGIT_WEIGHT) -> Callable:
  """Jitted `grads(drafter_params, target_params, pairs) -> (grads, metrics)`: the train step's first
  half, for data-parallel training that averages gradients from several device groups."""
  return jax.jit(functools.partial(_grads, nnx.graphdef(drafter), nnx.graphdef(target),
                                   _loss_args(draft_steps, temperature, logit_weight)))


def apply_gradients(optimizer: optax.GradientTransformation, params, opt_state, grads):
  """One optimizer update: `(params, opt_state)` after `grads`."""
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


EVAL_STEPS = 3  # draft steps an evaluation measures (top1, top1_2, top1_3)


def make_eval_step(drafter: Drafter, target: CausalLM, temperature: float = 1.0,
                   logit_weight: float = LOGIT_WEIGHT) -> Callable:
  """Jitted `evaluate(drafter_params, target_params, pairs) -> metrics` (no update): exact top-1 at
  each of EVAL_STEPS draft steps (training-time test); `loss` the first step's at `temperature`."""
  drafter_def, target_def = nnx.graphdef(drafter), nnx.graphdef(target)
  return jax.jit(lambda dp, tp, pairs: loss_fn(nnx.merge(drafter_def, dp), nnx.merge(target_def, tp), pairs,
                                               exact_top1=True, draft_steps=EVAL_STEPS, temperature=temperature,
                                               logit_weight=logit_weight)[1])


CEILING_TOP_K = 8  # p(top-k of q) is reported for k = 1..this


def ceiling_sums(drafter: Drafter, target: CausalLM, pairs: Pairs, draft_steps: int, temperature: float, key):
  """Per draft step k (a [draft_steps] vector each): sums over the weighted pairs of 1 - TV(p, q), p's mass on
  q's top-1..CEILING_TOP_K tokens (cumulative), how often the target's draw is among the draft tree's first
  1..CEILING_TOP_K children there (cumulative), the coupled draw's agreement, and the pair count."""
  # The rollout's own draw and child ranking.
  from tlt_jax.rollout import sampling, speculative  # pylint: disable=import-outside-toplevel
  logp = jax.nn.log_softmax(target.logits(pairs.next_hidden) / temperature, axis=-1)  # [B, T, V]
  ids = jnp.asarray(drafter.draft_vocab or range(target.config.vocab_size), jnp.int32)
  keys = jax.random.split(key, logp.shape[:-1])
  target_draw = sampling.draw(logp, keys)
  head = drafter.head(target)
  params = sampling.SamplingParams(temperature=temperature)
  out = []
  for k, predicted in enumerate(step_predictions(drafter, target, pairs, draft_steps), start=1):
    logits = drafter.logits(target, head, predicted)
    logq = jax.nn.log_softmax(logits / temperature, axis=-1)  # [B, T, N]
    p_on_draft = jnp.exp(jnp.take(logp, ids, axis=-1))  # p at the drafter's tokens
    tv = 0.5 * (jnp.abs(jnp.exp(logq) - p_on_draft).sum(-1) + (1.0 - p_on_draft.sum(-1)))
    top = jax.lax.top_k(logq, CEILING_TOP_K)[1]
    mass = jnp.cumsum(jnp.take_along_axis(p_on_draft, top, axis=-1), axis=-1)  # [B, T, K]
    scores = speculative.level_scores(logits, params, keys, lambda i: ids[i], target.config.vocab_size)
    children = ids[jax.lax.top_k(scores, CEILING_TOP_K)[1]]
    tree = jnp.cumsum(children == target_draw[..., None], axis=-1).astype(jnp.float32)
    full = jnp.full(logp.shape, -jnp.inf).at[..., ids].set(logq)
    coupled = (sampling.draw(full, keys) == target_draw).astype(jnp.float32)
    w = pairs.weights * (pairs.positions >= k - 1)
    out.append((((1.0 - tv) * w).sum(), (mass * w[..., None]).sum((0, 1)), (tree * w[..., None]).sum((0, 1)),
                (coupled * w).sum(), w.sum()))
  return tuple(jnp.stack(x) for x in zip(*out))


def ceiling_metrics(sums) -> list[dict[str, float]]:
  """`acceptance_ceiling`'s figures per draft step from `ceiling_sums` (summed over batches)."""
  tv, mass, tree, coupled, n = (np.asarray(x) for x in sums)
  return [{"1-tv": float(tv[k] / n[k]), **{f"p_top{j + 1}": float(mass[k, j] / n[k]) for j in range(CEILING_TOP_K)},
           **{f"tree_top{j + 1}": float(tree[k, j] / n[k]) for j in range(CEILING_TOP_K)},
           "coupled": float(coupled[k] / n[k]), "pairs": float(n[k])} for k in range(len(n))]


def chain_accept_len(rates: Sequence[float]) -> float:
  """Tokens per verify pass of a chain whose k-th draft is accepted at rate `rates[k - 1]`, the depths taken
  as independent: 1 + r1 + r1 r2 + ... An estimate from above: the engine's passes start after rejections,
  which cluster (SmolLM2, a 4-draft greedy chain: 1.90 measured where this gives 2.01, docs/BENCHMARKS.md)."""
  return float(1.0 + np.cumprod(np.asarray(rates, np.float64)).sum())


TREE_VERIFY = (8, 16, 32, 48)  # verify tokens of the trees whose acceptance the reports estimate (the paper's arms)


def best_trees(ceiling: Sequence[dict[str, float]]) -> dict[str, float]:
  """`tree_accept_len` of the trees of each of TREE_VERIFY verify tokens (keyed by that number as a string)
  at `acceptance_ceiling`'s tree rates."""
  rates = [[c[f"tree_top{k}"] for k in range(1, CEILING_TOP_K + 1)] for c in ceiling]
  return {str(v): tree_accept_len(rates, v - 1) for v in TREE_VERIFY}


def tree_accept_len(rates: Sequence[Sequence[float]], drafts: int) -> float:
  """Tokens per verify pass of the best tree of `drafts` draft nodes (a strategy verifying `drafts` + 1
  tokens) when the target's draw at draft depth d falls among a node's first k children at rate
  `rates[d - 1][k - 1]` (`acceptance_ceiling`'s tree_top1..8; deeper depths take the last depth's),
  the depths taken as independent: a node is reached with its parent's chance times its own share,
  rates[d - 1][k - 1] - rates[d - 1][k - 2] for the k-th child, and the best tree holds the `drafts`
  likeliest nodes (a child is never likelier than its parent). An estimate from above, as
  `chain_accept_len` is: no drafter's tree selection knows these chances, and rejections cluster."""
  shares = [np.diff(np.asarray(r, np.float64), prepend=0.0) for r in rates]
  heap, total = [(-1.0, 0)], 0.0  # (minus the chance the walk reaches the node, its depth); the root first
  for _ in range(drafts + 1):
    if not heap:
      break
    chance, depth = heapq.heappop(heap)
    total -= chance
    for share in shares[min(depth, len(shares) - 1)]:
      heapq.heappush(heap, (chance * share, depth + 1))
  return float(total)


def acceptance_ceiling(target: CausalLM, drafter: Drafter, data: Sequences | Pairs, *, temperature: float,
                       draft_steps: int = EVAL_STEPS, batch_rows: int = 2, row_len: int = 512,
                       seed: int = 0) -> list[dict[str, float]]:
  """What verification can accept at `temperature`, per draft step k = 1..`draft_steps` (a chain's k-th
  draft, the drafter reading its own earlier predictions), averaged over `data`'s response pairs (the
  target's own samples): `1-tv`, 1 - the total variation between the target's distribution p and the
  drafter's q (a chain's acceptance rate when drafts are drawn coupled to the target's draw, at best);
  `p_top1`..`p_top8`, p's mass on q's k most likely tokens (a node's acceptance with those k children);
  `tree_top1`..`tree_top8`, how often the target's draw is among the k children a sampled draft tree
  ranks first with the draw's key (`speculative.level_scores`: q and the key's known noise), the
  acceptance of its nodes of k children; `coupled`, how often the target's draw equals q's drawn with
  the same key (`sampling.draw`: that ranking's first child). Every figure is a node's acceptance
  probability, so a chain of rate a accepts 1 + a + a^2 + ... tokens per verify."""
  pairs = all_pairs(target, drafter.feature_layers, data, row_len=row_len, batch_rows=batch_rows)
  drafter_def, target_def = nnx.graphdef(drafter), nnx.graphdef(target)
  fn = jax.jit(lambda dp, tp, chunk, key: ceiling_sums(nnx.merge(drafter_def, dp), nnx.merge(target_def, tp), chunk,
                                                       draft_steps, max(temperature, 1e-6), key))
  _, drafter_params = nnx.split(drafter)
  _, target_params = nnx.split(target)
  num_rows, key = pairs.tokens.shape[0], jax.random.key(seed)
  totals = None
  for start in range(0, num_rows, batch_rows):
    take = np.arange(start, start + batch_rows)  # one shape: the last chunk's padding rows weigh 0
    chunk = jax.tree.map(lambda x: np.where(
        (take < num_rows).reshape((-1,) + (1,) * (x.ndim - 1)), x[np.minimum(take, num_rows - 1)], 0), pairs)
    sums = jax.device_get(fn(drafter_params, target_params, chunk, jax.random.fold_in(key, start)))
    totals = sums if totals is None else jax.tree.map(np.add, totals, sums)
  return ceiling_metrics(totals)


@dataclasses.dataclass
class DistillResult:
  losses: list[float]  # training loss per step
  metrics: list[dict[str, float]]  # per step: loss, feature_loss, logit_loss, top1, pairs
  eval: dict[str, float] | None  # pair-weighted metrics on `eval_data` of the drafter returned, when given
  best_step: int  # the step whose parameters the drafter holds (held-out loss at its lowest; else the last)
  eval_history: list[tuple[int, float]]  # (step, held-out loss) of each evaluation during training
  steps: int  # the steps planned (`steps`, or fewer where `epochs` caps them)


def _pairs_in_batches(target: CausalLM, feature_layers, rows: np.ndarray, batch_rows: int) -> list[Pairs]:
  # Features are computed once up front: every epoch after the first reuses them.
  out = []
  for start in range(0, rows.shape[1], batch_rows):
    chunk = rows[:, start:start + batch_rows]
    pad = batch_rows - chunk.shape[1]  # keep one shape (one compilation); padding rows weigh 0
    out.append(jax.device_get(sequence_pairs(target, feature_layers, np.pad(chunk, ((0, 0), (0, pad), (0, 0))))))
  return out


def all_pairs(target: CausalLM, feature_layers, data: Sequences | Pairs, *, row_len: int, batch_rows: int) -> Pairs:
  """Host `Pairs` of every packed row of `data`: `data` itself when it is `Pairs` already (features a
  rollout captured, `DataBuffer.packed`), else its sequences packed into rows of `row_len` and their
  features computed by target forwards of `batch_rows` rows."""
  if isinstance(data, Pairs):
    return data
  rows = pack(data, row_len)
  logging.info("distill: %d sequences packed into %d rows of %d tokens", len(data), rows.shape[1], row_len)
  batches = _pairs_in_batches(target, feature_layers, rows, batch_rows)
  return jax.tree.map(lambda *xs: np.concatenate(xs)[:rows.shape[1]], *batches)


def _evaluator(target: CausalLM, drafter: Drafter, pairs: Pairs, batch_rows: int, temperature: float = 1.0,
               logit_weight: float = LOGIT_WEIGHT) -> Callable[[nnx.State], dict[str, float]]:
  """`metrics(drafter_params)`: the pair-weighted evaluation metrics of `pairs` (one compilation)."""
  evaluate_fn = make_eval_step(drafter, target, temperature, logit_weight)
  _, target_params = nnx.split(target)
  num_rows = pairs.tokens.shape[0]

  def metrics(drafter_params) -> dict[str, float]:
    sums, total = {}, 0.0
    for start in range(0, num_rows, batch_rows):
      take = np.arange(start, start + batch_rows)  # one shape: the last chunk's padding rows weigh 0
      chunk = jax.tree.map(lambda x: np.where(
          (take < num_rows).reshape((-1,) + (1,) * (x.ndim - 1)), x[np.minimum(take, num_rows - 1)], 0), pairs)
      m = {k: float(v) for k, v in evaluate_fn(drafter_params, target_params, chunk).items()}
      total += m["pairs"]
      for k, v in m.items():
        if k != "pairs":
          sums[k] = sums.get(k, 0.0) + v * m["pairs"]
    return {**{k: v / max(total, 1.0) for k, v in sums.items()}, "pairs": total}

  return metrics


def distill(target: CausalLM, drafter: Drafter, data: Sequences | Pairs, *, steps: int, batch_rows: int,
            row_len: int, lr: float, seed: int = 0, eval_data: Sequences | Pairs = (), warmup_steps: int | None = None,
            draft_steps: int = 1, temperature: float = 1.0, logit_weight: float = LOGIT_WEIGHT, eval_every: int = 0,
            patience: int = 0, epochs: float = 0.0,
            on_step: Callable[[int, dict[str, float]], None] | None = None) -> DistillResult:
  """Trains `drafter` in place for up to `steps` steps of `batch_rows` packed rows of `data`: the target's
  sequences (features recomputed) or `Pairs` of captured features (see `all_pairs`); `draft_steps`:
  the training-time test's steps, `temperature` and `logit_weight` the loss's (`loss_fn`). `epochs` > 0
  caps the steps at that many passes over the rows (the learning-rate schedule spans the steps left)
  and `eval_every` at one pass.

  With `eval_data` and `eval_every`, the held-out loss is measured every `eval_every` steps; the drafter
  ends with the parameters of its best measurement, and training stops once `patience` measurements in
  a row (0: never) have not improved on it: the steps fit the data instead of overfitting a small set."""
  if steps < 1 or batch_rows < 1 or epochs < 0:
    raise ValueError(f"steps and batch_rows must be positive and epochs >= 0, got steps={steps}, "
                     f"batch_rows={batch_rows}, epochs={epochs}")
  # One host array per field, from which each step gathers its rows.
  pairs = all_pairs(target, drafter.feature_layers, data, row_len=row_len, batch_rows=batch_rows)
  epoch = -(-pairs.tokens.shape[0] // batch_rows)  # steps per pass over the rows
  if epochs:
    steps, eval_every = min(steps, max(1, math.ceil(epochs * epoch))), min(eval_every, epoch)
  logging.info("distill: %d training rows, %d steps an epoch; %d steps at most", pairs.tokens.shape[0], epoch, steps)
  has_eval = isinstance(eval_data, Pairs) or len(eval_data) > 0
  held_out = _evaluator(target, drafter, all_pairs(target, drafter.feature_layers, eval_data, row_len=row_len,
                                                   batch_rows=batch_rows), batch_rows, temperature,
                        logit_weight) if has_eval else None
  num_rows = pairs.tokens.shape[0]
  optimizer = make_optimizer(cosine_schedule(lr, steps, warmup_steps))
  _, target_params = nnx.split(target)
  _, params = nnx.split(drafter)
  opt_state = optimizer.init(params)
  # Compiled ahead of time: a plain jit would compile again at step 2, once the fresh (uncommitted)
  # drafter state has come back committed to the target's mesh.
  abstract_batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct((batch_rows, *x.shape[1:]), x.dtype), pairs)
  step = _compiled_step(drafter, target, optimizer, draft_steps, temperature, logit_weight, params, opt_state,
                        target_params, abstract_batch)
  rng = np.random.default_rng(seed)
  order = np.empty(0, np.int64)
  losses, metrics, history = [], [], []
  best, best_step, since = None, steps - 1, 0
  for i in range(steps):
    while len(order) < batch_rows:  # epochs of shuffled rows; fewer rows than batch_rows repeat
      order = np.concatenate([order, rng.permutation(num_rows)])
    take, order = order[:batch_rows], order[batch_rows:]
    batch = jax.tree.map(lambda x: x[take], pairs)
    params, opt_state, m = step(params, opt_state, target_params, batch)
    m = {k: float(v) for k, v in m.items()}
    losses.append(m["loss"])
    metrics.append(m)
    if on_step is not None:
      on_step(i, {**m, "steps": steps})  # the steps planned, for a progress bar
    if held_out is not None and eval_every and ((i + 1) % eval_every == 0 or i == steps - 1):
      loss = held_out(params)["loss"]
      history.append((i, loss))
      logging.info("distill: step %d of %d, held-out loss %.4f", i + 1, steps, loss)
      if best is None or loss < best[0]:
        best, best_step, since = (loss, jax.device_get(params)), i, 0
      else:
        since += 1
        if patience and since >= patience:
          logging.info("distill: held-out loss not improved in %d evaluations; stopping at step %d (best: step %d)",
                       since, i + 1, best_step + 1)
          break
  nnx.update(drafter, params if best is None else best[1])
  eval_metrics = held_out(nnx.state(drafter)) if held_out is not None else None
  return DistillResult(losses, metrics, eval_metrics, best_step, history, steps)


def _compiled_step(drafter, target, optimizer, draft_steps, temperature, logit_weight, params, opt_state, target_params,
                   batch):
  return make_train_step(drafter, target, optimizer, draft_steps, temperature, logit_weight).lower(
      params, opt_state, target_params, batch).compile()


def compile_warmup(pool: ExecutablePool, target: CausalLM, drafter: Drafter, *, batch_rows: int, row_len: int,
                   draft_steps: int = 1, temperature: float = 1.0, logit_weight: float = LOGIT_WEIGHT) -> None:
  """`distill`'s executables compiled ahead into `pool` for the (possibly abstract: a dry run's) target and
  drafter, on the devices their params are on: the target's feature pass over `batch_rows` packed rows of
  `row_len` tokens ("features") and a training step on their pairs ("step")."""
  shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
  (target_def, target_params), (_, params) = nnx.split(target), nnx.split(drafter)
  target_params, params = jax.tree.map(shape, target_params), jax.tree.map(shape, params)
  rows = [jax.ShapeDtypeStruct((batch_rows, row_len), jnp.int32)] * 4
  layers = tuple(drafter.feature_layers)
  pool.get_or_compile("features", lambda: _sequence_pairs.lower(target_def, layers, target_params, *rows).compile())
  pairs = jax.eval_shape(functools.partial(_sequence_pairs, target_def, layers), target_params, *rows)
  optimizer = make_optimizer(1.0)
  opt_state = jax.eval_shape(optimizer.init, params)
  pool.get_or_compile("step", lambda: _compiled_step(drafter, target, optimizer, draft_steps, temperature,
                                                     logit_weight, params, opt_state, target_params, pairs))


def evaluate(target: CausalLM, drafter: Drafter, data: Sequences | Pairs, *, batch_rows: int,
             row_len: int, temperature: float = 1.0, logit_weight: float = LOGIT_WEIGHT) -> dict[str, float]:
  """Pair-weighted loss and (exact) top-1 agreement of the drafter on `data` (as `distill` takes it)."""
  pairs = all_pairs(target, drafter.feature_layers, data, row_len=row_len, batch_rows=batch_rows)
  return _evaluator(target, drafter, pairs, batch_rows, temperature, logit_weight)(nnx.state(drafter))
