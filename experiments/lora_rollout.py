"""A LoRA policy's rollouts: merged weights (W + scale A B, rebuilt after each update) vs the adapters'
own forward (x W + scale (x A) B, the base shared), side by side in one process.

  python experiments/lora_rollout.py --model=models/smollm2 --rank=32 --batches=1,8,64

Times a jitted decode step of each form (every linear layer of the decoder adapted, `--context` tokens
in the KV cache) at each batch, and the merge itself (`Actor.rollout_params`: what a LoRA run pays once
per step). Merged pays off once a step's rollout decodes more than merge / (adapters' step - merged step)
steps. Prints a JSON summary.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx

from tlt_jax.models import KVCache, decode, hf, lora, prefill
from tlt_jax.rl import actor as actor_lib

_MODEL = flags.DEFINE_string("model", "models/smollm2", "A Hugging Face model directory.")
_RANK = flags.DEFINE_integer("rank", 32, "LoRA rank (alpha = 2 x rank).")
_BATCHES = flags.DEFINE_list("batches", ["1", "8", "64"], "Rows decoding at once.")
_CONTEXT = flags.DEFINE_integer("context", 128, "Tokens in each row's cache when timing.")
_STEPS = flags.DEFINE_integer("steps", 20, "Decode steps timed per form and batch.")
_SCAN = flags.DEFINE_bool("scan_layers", False, "Scanned layers (the GPU configs) instead of unrolled (the CPU's).")


def _best_of(fn, repeats: int = 3) -> float:
  """Seconds of `fn()` (blocking on its result), the best of `repeats` after a warm-up call."""
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return min(times)


def main(_):
  model = hf.from_pretrained(_MODEL.value, scan_layers=_SCAN.value)
  lora.attach(model, lora.Spec(_RANK.value, 2.0 * _RANK.value, "all-linear"))
  actor = actor_lib.Actor(model, optax.sgd(0.0), micro_batch_rows=1)
  forms = {"adapters": model, "merged": lora.merged(model)}
  merge_s = _best_of(lambda: actor.rollout_params(model.dtype))
  out = {"model": _MODEL.value, "rank": _RANK.value, "scan_layers": _SCAN.value, "context": _CONTEXT.value,
         "merge_ms": round(1e3 * merge_s, 2), "decode_ms": {}}
  for b in map(int, _BATCHES.value):
    tokens = jnp.asarray(np.random.RandomState(0).randint(2, 1000, (b, _CONTEXT.value)), jnp.int32)
    row = {}
    for name, m in forms.items():
      graphdef, state = nnx.split(m)
      cache = jax.jit(lambda s, t: prefill(nnx.merge(graphdef, s), t, jnp.full((b,), _CONTEXT.value), KVCache.zeros(
          m.config, b, _CONTEXT.value + _STEPS.value + 1)).cache)(state, tokens)
      step = jax.jit(lambda s, c, t, g=graphdef: decode(nnx.merge(g, s), t, c).cache)

      def steps(cache=cache, step=step, state=state):
        c, t = cache, jnp.ones((b,), jnp.int32)
        for _ in range(_STEPS.value):
          c = step(state, c, t)
        return c
      row[name] = round(1e3 * _best_of(steps) / _STEPS.value, 3)
    row["adapters/merged"] = round(row["adapters"] / row["merged"], 3)
    saved = row["adapters"] - row["merged"]
    row["break_even_steps"] = round(1e3 * merge_s / saved, 1) if saved > 0 else None
    out["decode_ms"][b] = row
    print(b, row, flush=True)
  print(json.dumps(out))


if __name__ == "__main__":
  app.run(main)
