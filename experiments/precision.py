"""How far GRPO updates move a policy's weights at the paper's learning rate, by precision.

  python experiments/precision.py

A small random Qwen2-shaped policy (weights ~0.02, where bfloat16's spacing is ~1e-4), the project's
Actor and optimizer (AdamW after clipping, no weight decay), `--updates` GRPO updates on one packed
batch, per learning rate and precision:
  float32          float32 weights and compute;
  mixed            float32 masters, bfloat16 compute (the default for `policy.dtype=bfloat16`);
  bf16 stochastic  bfloat16 weights and moments, updates stochastically rounded
                   (`policy.weight_dtype=bfloat16`);
  bf16 nearest     the same rounded to nearest, as `optax.apply_updates` does: what the GPU configs
                   trained with before float32 masters (not offered).
Prints the mean |dw| over the weights, its ratio to float32's, and the share of weights that moved.
"""

from __future__ import annotations

import jax
import numpy as np
from absl import app, flags
from flax import nnx

from tlt_jax import packing
from tlt_jax.models import CausalLM, ModelConfig
from tlt_jax.rl import actor as actor_lib

_RATES = flags.DEFINE_list("learning_rates", ["1e-6", "1e-5"], "Learning rates.")
_UPDATES = flags.DEFINE_integer("updates", 5, "GRPO updates on the batch.", lower_bound=1)

CONFIG = ModelConfig("Qwen2ForCausalLM", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=32, qkv_bias=True, tie_word_embeddings=False)
PRECISIONS = {"float32": ("float32", "float32", True), "mixed": ("bfloat16", "float32", True),
              "bf16 stochastic": ("bfloat16", "bfloat16", True), "bf16 nearest": ("bfloat16", "bfloat16", False)}


def moved(initial: nnx.State, dtype: str, weight_dtype: str, stochastic: bool, learning_rate: float,
          updates: int) -> np.ndarray:
  """|dw| of every weight after `updates` updates from `initial` (float32) held in `weight_dtype` (the
  change from the weights as held: bfloat16 ones start as the float32 ones rounded)."""
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: CausalLM(CONFIG, dtype=dtype, param_dtype=weight_dtype,
                                                          rngs=nnx.Rngs(0))))
  model = nnx.merge(graphdef, jax.tree.map(lambda x: jax.numpy.array(x, weight_dtype), initial))  # a copy: donated
  actor = actor_lib.Actor(model, actor_lib.make_optimizer(learning_rate, 0, 0.0), micro_batch_rows=8, max_grad_norm=1.0)
  actor.rounding = actor.rounding and stochastic  # nearest: the plain float update of bfloat16 weights
  rng = np.random.default_rng(0)
  sequences = [(rng.integers(2, CONFIG.vocab_size, 8).tolist(), rng.integers(2, CONFIG.vocab_size, 24).tolist())
               for _ in range(8)]
  rows = packing.pack(sequences, 64, index=True)
  advantages = rng.standard_normal(len(sequences)).astype(np.float32)
  flat = lambda p: np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(p)])
  start = flat(actor.params)  # bfloat16 weights: the float32 ones rounded
  for _ in range(updates):
    old = actor.logprobs(actor.params, rows)
    actor.update(actor_lib.training_batch(rows, advantages, np.ones(len(sequences), bool), "token", old, None))
  return np.abs(flat(actor.params) - start)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  initial = nnx.state(CausalLM(CONFIG, rngs=nnx.Rngs(0)))
  matrices = [np.abs(np.asarray(x)).ravel() for x in jax.tree.leaves(initial) if x.ndim == 2]
  print(f"{CONFIG.architecture}, {sum(x.size for x in jax.tree.leaves(initial)):,} weights (median |w| of the "
        f"matrices {np.median(np.concatenate(matrices)):.3f}), "
        f"{_UPDATES.value} updates; jax {jax.__version__} on {jax.devices()[0].device_kind}")
  print(f"{'lr':>6}  {'precision':<16} {'mean |dw|':>10} {'/ float32':>9} {'moved':>7}")
  for rate in map(float, _RATES.value):
    base = None
    for name, (dtype, weight_dtype, stochastic) in PRECISIONS.items():
      dw = moved(initial, dtype, weight_dtype, stochastic, rate, _UPDATES.value)
      base = dw.mean() if base is None else base
      print(f"{rate:>6.0e}  {name:<16} {dw.mean():>10.3g} {dw.mean() / base:>9.3f} {(dw > 0).mean():>7.1%}")


if __name__ == "__main__":
  app.run(main)
