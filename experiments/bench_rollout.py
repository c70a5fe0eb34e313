"""Rollout engine vs `transformers.generate` on identical weights, and compaction on vs off.

  python experiments/bench_rollout.py [--new_tokens=128 --repeats=3]

A random Qwen2-family model the size of the tiny world's policy is saved as a HF directory;
both engines load it. Each figure is the median of `--repeats` timed runs after a warm-up run
(compilation excluded). Prints one JSON record per measurement and the ratios.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time

import numpy as np
import torch
import transformers
from absl import app, flags

from tlt_jax.models import hf
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.state import EngineConfig

_NEW = flags.DEFINE_integer("new_tokens", 128, "Tokens generated per row (batch 1 / 16 runs).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per measurement (median reported).")
_TAIL_ROWS = flags.DEFINE_integer("tail_rows", 64, "Rows of the long-tail batch.")
_TAIL_MAX = flags.DEFINE_integer("tail_max", 512, "Longest response of the long-tail batch.")


def tiny_qwen2(path: str) -> transformers.PreTrainedModel:
  cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                                 tie_word_embeddings=True)
  torch.manual_seed(0)
  model = transformers.Qwen2ForCausalLM(cfg).eval()
  model.save_pretrained(path)
  return model


def median_time(fn, repeats):
  fn()  # warm-up (compilation for ours)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main(argv):
  del argv
  torch.set_num_threads(torch.get_num_threads())
  path = tempfile.mkdtemp()
  ref = tiny_qwen2(path)
  model = hf.from_pretrained(path)
  rng = np.random.RandomState(0)
  new = _NEW.value
  records = []

  def record(name, seconds, tokens, **extra):
    rec = {"name": name, "seconds": round(seconds, 4), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
           **extra}
    records.append(rec)
    print(json.dumps(rec), flush=True)
    return rec["tokens_per_s"]

  ratios = {}
  for batch in (1, 16):
    prompts = [rng.randint(3, 128, 32).tolist() for _ in range(batch)]
    engine = Engine(model, EngineConfig(batch_buckets=tuple(2**i for i in range(5)), max_prompt_len=32,
                                        max_new_tokens=new, kv_block=64),
                    SamplingParams(temperature=0, max_new_tokens=new))
    ours = record(f"tlt_jax batch {batch}", median_time(lambda: engine.generate(prompts), _REPEATS.value),
                  batch * new)
    ids = torch.tensor(prompts)

    def hf_generate():
      with torch.no_grad():
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
      assert out.shape[1] == 32 + new

    theirs = record(f"transformers batch {batch}", median_time(hf_generate, _REPEATS.value), batch * new)
    ratios[f"vs_transformers_batch_{batch}"] = round(ours / theirs, 2)

  # Long tail: response lengths from a heavy-tailed law (most short, a few at the cap).
  rows = _TAIL_ROWS.value
  lengths = np.minimum(8 * np.floor((1 - rng.random(rows)) ** -1.0), _TAIL_MAX.value).astype(int)
  prompts = [rng.randint(3, 128, 32).tolist() for _ in range(rows)]
  limits = [32 + int(n) for n in lengths]
  buckets = tuple(2**i for i in range(7))
  tail = {}
  for compact in (True, False):
    engine = Engine(model, EngineConfig(batch_buckets=buckets, max_prompt_len=32, max_new_tokens=_TAIL_MAX.value,
                                        kv_block=64, compact=compact),
                    SamplingParams(temperature=1.0, max_new_tokens=_TAIL_MAX.value))
    tail[compact] = record(f"long tail, compaction {'on' if compact else 'off'}",
                           median_time(lambda: engine.generate(prompts, max_total_len=limits), _REPEATS.value),
                           int(lengths.sum()), median_len=float(np.median(lengths)), max_len=int(lengths.max()))
  ratios["compaction_on_vs_off"] = round(tail[True] / tail[False], 2)
  print(json.dumps({"ratios": ratios}))


if __name__ == "__main__":
  app.run(main)
