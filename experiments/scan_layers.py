"""Scanned vs unrolled decoder layers: a rollout group's pool compile time and decode tokens/s.

  python experiments/scan_layers.py [--config=configs/tiny.py] [--model=DIR] \
      [--rows=16 --new_tokens=128 --repeats=3 --measure=compile,decode]

The same weights in both forms (`ModelConfig.scan_layers`): `--model` (a Hugging Face directory),
else the config's tiny policy shape with random weights. Compile: the wall time of
`Engine.prepare` for one rollout group as the config's trainer builds it (TLT: a random drafter of
the target, the strategies, every batch bucket and prompt bucket of a step's rows), without a
persistent compilation cache; scanned first, so that one-time costs of a process fall on it.
Decode: plain greedy decoding of `--new_tokens` tokens per row (no stop token) from 32-token
prompts at batch 1 and `--rows`, tokens/s over the decode segments, the median of `--repeats`
timed rollouts after a warm-up one, the two forms interleaved; the forms' greedy tokens are
compared. Prints one JSON record per measurement and the unrolled / scanned ratios.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import numpy as np
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

from tlt_jax.rl import builders
from tlt_jax.drafter.model import Drafter
from tlt_jax.models import hf
from tlt_jax.models.transformer import CausalLM
from tlt_jax.rl import sft
from tlt_jax.rl import tokenizer as tokenizer_lib
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.state import EngineConfig
from tlt_jax.rollout.sampling import SamplingParams

_CONFIG = config_flags.DEFINE_config_file("config", os.path.join(os.path.dirname(__file__), "..", "configs",
                                                                 "tiny.py"), "Config of the rollout group.")
_MODEL = flags.DEFINE_string("model", None, "Hugging Face model directory (default: the config's tiny policy shape).")
_ROWS = flags.DEFINE_integer("rows", 16, "The larger decode batch.")
_NEW = flags.DEFINE_integer("new_tokens", 128, "Tokens decoded per row.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed decode rollouts per form and batch (median reported).")
_MEASURE = flags.DEFINE_list("measure", ["compile", "decode"], "compile and/or decode.")


def models(config) -> dict[bool, CausalLM]:
  """scan_layers -> the model in that form, the same weights."""
  if _MODEL.value:
    return {scan: hf.from_pretrained(_MODEL.value, dtype="float32", scan_layers=scan) for scan in (True, False)}
  tok = tokenizer_lib.build_tokenizer(config.model.max_position_embeddings)
  out = {}
  for scan in (True, False):
    config.policy.scan_layers = scan
    out[scan] = sft.build_policy(config, tok)  # the same seed: the same weights, layer for layer
  return out


def compile_time(config, model: CausalLM) -> float:
  """Seconds to compile one rollout group's executable pool, as the trainer's TLT engines need it."""
  strategies = builders.strategies(config) if config.rollout.speculative else ()
  drafter = Drafter(model.config, rngs=nnx.Rngs(0)) if strategies else None
  bandit = builders.bandit(config, strategies) if strategies else None  # the trainer's group engines have one
  r = config.rollout
  engine = Engine(model, builders.engine_config(config, strategies, capture_hidden=bool(strategies)),
                  builders.sampling_params(config), drafter=drafter, bandit=bandit)
  rows = -(-r.prompts_per_step // r.groups) * r.num_samples
  start = time.perf_counter()
  engine.prepare(rows)
  return time.perf_counter() - start


def decode_speeds(forms: dict[bool, CausalLM], batches, repeats: int):
  """{(scan, batch): [decode tokens/s of each timed rollout]} and whether the forms' tokens agree."""
  params = SamplingParams(temperature=0.0, max_new_tokens=_NEW.value, seed=0)
  prompts = np.random.RandomState(0).randint(2, forms[True].config.vocab_size, (max(batches), 32)).tolist()
  engines = {(scan, b): Engine(model, EngineConfig(batch_buckets=tuple(2**i for i in range(b.bit_length())),
                                                   max_prompt_len=32, max_new_tokens=_NEW.value, compact=False),
                               params)
             for scan, model in forms.items() for b in batches}
  speeds, tokens = {key: [] for key in engines}, {}
  for round_ in range(repeats + 1):  # round 0 is the warm-up (compiles)
    for (scan, b), engine in engines.items():
      rollout = engine.generate(prompts[:b])
      m = rollout.metrics
      if round_:
        speeds[(scan, b)].append(sum(s.tokens for s in m.segments) / m.decode_s)
      tokens[(scan, b)] = [s.tokens.tolist() for s in rollout.samples]
  same = all(tokens[(True, b)] == tokens[(False, b)] for b in batches)
  return speeds, same


def main(argv):
  del argv
  config = _CONFIG.value
  config.unlock()
  config.rollout.compilation_cache_dir = ""  # measure compiling, not reading a cache
  forms = models(config)
  name = _MODEL.value or f"tiny ({config.model.num_layers} layers)"
  layers = forms[True].config.num_layers
  records = []
  if "compile" in _MEASURE.value:
    seconds = {scan: compile_time(config, forms[scan]) for scan in (True, False)}
    records.append({"measurement": "pool compile s", "model": name, "layers": layers,
                    "scanned": round(seconds[True], 1), "unrolled": round(seconds[False], 1),
                    "unrolled/scanned": round(seconds[False] / seconds[True], 2)})
  if "decode" in _MEASURE.value:
    batches = sorted({1, _ROWS.value})
    speeds, same = decode_speeds(forms, batches, _REPEATS.value)
    for b in batches:
      s, u = (statistics.median(speeds[(scan, b)]) for scan in (True, False))
      records.append({"measurement": f"decode tokens/s, batch {b}", "model": name, "layers": layers,
                      "scanned": round(s, 1), "unrolled": round(u, 1), "unrolled/scanned": round(u / s, 2),
                      "same_greedy_tokens": same})
  for r in records:
    print(json.dumps(r))


if __name__ == "__main__":
  app.run(main)
