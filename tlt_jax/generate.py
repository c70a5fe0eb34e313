"""Sample from a Hugging Face model directory with the rollout engine.

  python -m tlt_jax.generate --model=DIR --prompts=IN.jsonl --output=OUT.jsonl \\
      [--max_new_tokens=256 --temperature=1.0 --top_p=1.0 --top_k=0 --seed=0 --num_samples=1 --batch_size=64]

Input lines are {"prompt": "text"} (needs a tokenizer in DIR; `--chat` applies its chat
template) or {"prompt_ids": [1, 2, 3]}. Output lines: prompt_index, sample_index, output_ids,
text (with a tokenizer), finish_reason. A JSON summary goes to stdout, a progress bar to stderr.
The output file appears only when generation succeeded (written to a temporary path, renamed).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from absl import app, flags
from tqdm import tqdm

from tlt_jax.models import hf
from tlt_jax.rollout.engine import Engine, EngineConfig
from tlt_jax.rollout.sampling import SamplingParams

_MODEL = flags.DEFINE_string("model", None, "Hugging Face model directory.", required=True)
_PROMPTS = flags.DEFINE_string("prompts", None, "Input JSONL file.", required=True)
_OUTPUT = flags.DEFINE_string("output", None, "Output JSONL file.", required=True)
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 256, "Tokens to generate at most per sample.", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "0 = greedy.", lower_bound=0.0)
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass.", lower_bound=0.0, upper_bound=1.0)
_TOP_K = flags.DEFINE_integer("top_k", 0, "0 = off.", lower_bound=0)
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 1, "Samples per prompt.", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch_size", 64, "Rows decoded together at most (rounded up to a power of two).",
                              lower_bound=1)
_CHAT = flags.DEFINE_bool("chat", False, "Apply the tokenizer's chat template to text prompts.")
_DTYPE = flags.DEFINE_enum("dtype", None, list(hf.DTYPES), "Compute dtype (default: the checkpoint's).")


class InputError(ValueError):
  """Bad input; the message names the file and line."""


def read_prompts(path: str, tokenizer, chat: bool, max_len: int) -> list[list[int]]:
  """Token ids of every line of a prompts JSONL file."""
  if not os.path.isfile(path):
    raise InputError(f"{path}: no such file")
  prompts = []
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path}:{n}"
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise InputError(f"{where}: malformed JSON ({e.msg})") from None
      if not isinstance(row, dict) or ("prompt" not in row and "prompt_ids" not in row):
        raise InputError(f"{where}: needs a 'prompt' or 'prompt_ids' field")
      if "prompt_ids" in row:
        ids = row["prompt_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
          raise InputError(f"{where}: 'prompt_ids' must be a list of non-negative integers")
      else:
        if tokenizer is None:
          raise InputError(f"{where}: a text 'prompt' needs a tokenizer in the model directory; "
                           "give 'prompt_ids' instead")
        text = row["prompt"]
        if not isinstance(text, str):
          raise InputError(f"{where}: 'prompt' must be a string")
        if chat:
          ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False)
        else:
          ids = tokenizer(text, add_special_tokens=False)["input_ids"]
      if not ids:
        raise InputError(f"{where}: empty prompt")
      if len(ids) >= max_len:
        raise InputError(f"{where}: prompt has {len(ids)} tokens; the model allows {max_len} positions in all")
      prompts.append(list(ids))
  if not prompts:
    raise InputError(f"{path}: no prompts")
  return prompts


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  model = hf.from_pretrained(_MODEL.value, dtype=_DTYPE.value)
  tokenizer = hf.load_tokenizer(_MODEL.value)
  cfg = model.config
  try:
    prompts = read_prompts(_PROMPTS.value, tokenizer, _CHAT.value, cfg.max_position_embeddings)
  except InputError as e:
    sys.exit(f"error: {e}")
  stop = set(cfg.stop_token_ids)
  if tokenizer is not None and tokenizer.eos_token_id is not None:
    stop.add(tokenizer.eos_token_id)
  longest = max(len(p) for p in prompts)
  max_new = min(_MAX_NEW.value, cfg.max_position_embeddings - longest)
  buckets = [1]
  while buckets[-1] < _BATCH.value:
    buckets.append(buckets[-1] * 2)
  engine = Engine(
      model, EngineConfig(batch_buckets=tuple(buckets), max_prompt_len=longest, max_new_tokens=max_new),
      SamplingParams(temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value, max_new_tokens=max_new,
                     stop_token_ids=tuple(sorted(stop)), seed=_SEED.value))
  with tqdm(total=len(prompts) * _NUM_SAMPLES.value, unit="sample", file=sys.stderr) as bar:
    tokens = [0]

    def progress(rows, new_tokens):
      tokens[0] += new_tokens
      bar.set_postfix(tokens=tokens[0], refresh=False)
      bar.update(rows)

    rollout = engine.generate(prompts, num_samples=_NUM_SAMPLES.value, on_progress=progress)

  out_dir = os.path.dirname(os.path.abspath(_OUTPUT.value))
  os.makedirs(out_dir, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=out_dir)
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      for s in rollout.samples:
        rec = {"prompt_index": s.prompt_index, "sample_index": s.sample_index, "output_ids": s.tokens.tolist(),
               "finish_reason": s.finish_reason}
        if tokenizer is not None:
          rec["text"] = tokenizer.decode(s.tokens, skip_special_tokens=True)
        f.write(json.dumps(rec) + "\n")
    os.replace(tmp, _OUTPUT.value)
  except BaseException:
    os.unlink(tmp)
    raise
  m = rollout.metrics
  print(json.dumps({"samples": len(rollout.samples), "tokens": m.tokens, "wall_s": round(m.wall_s, 4),
                    "tokens_per_s": round(m.tokens_per_s, 2), "prefill_s": round(m.prefill_s, 4),
                    "decode_s": round(m.decode_s, 4), "compact_s": round(m.compact_s, 4),
                    "executables": len(engine.pool)}))


if __name__ == "__main__":
  app.run(main)
