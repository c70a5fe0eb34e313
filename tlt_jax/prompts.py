"""Prompts JSONL files for the CLIs: {"prompt": "text"} or {"prompt_ids": [1, 2, 3]} per line."""

from __future__ import annotations

import json
import os

from tlt_jax.rl import tokenizer as tokenizer_lib


def read_prompts(path: str, tokenizer, *, chat: bool, max_len: int, vocab_size: int) -> list[list[int]]:
  """Token ids of every line. Text prompts need `tokenizer`; `chat` applies its chat template."""
  if not os.path.isfile(path):
    raise ValueError(f"{path}: no such file")
  prompts = []
  with open(path, "rb") as f:
    for n, raw in enumerate(f, 1):
      where = f"{path}:{n}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: malformed JSON ({e.msg})") from None
      if not isinstance(row, dict) or ("prompt" not in row and "prompt_ids" not in row):
        raise ValueError(f"{where}: needs a 'prompt' or 'prompt_ids' field")
      if "prompt_ids" in row:
        ids = row["prompt_ids"]
        # bool is an int subclass, but `true` is no token id.
        if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < vocab_size for i in ids):
          raise ValueError(f"{where}: 'prompt_ids' must be a list of token ids in [0, {vocab_size})")
      else:
        if tokenizer is None:
          raise ValueError(f"{where}: a text 'prompt' needs a tokenizer in the model directory; "
                           "give 'prompt_ids' instead")
        text = row["prompt"]
        if not isinstance(text, str):
          raise ValueError(f"{where}: 'prompt' must be a string")
        if chat:
          try:
            text = tokenizer_lib.chat_prompt(tokenizer, [{"role": "user", "content": text}])
          except tokenizer_lib.ChatTemplateError as e:
            raise ValueError(f"{where}: {e}") from None
        # A chat template writes its special tokens (BOS, role markers) as text.
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
      if not ids:
        raise ValueError(f"{where}: empty prompt")
      if len(ids) >= max_len:
        raise ValueError(f"{where}: prompt has {len(ids)} tokens; the model allows {max_len} positions in all")
      prompts.append(list(ids))
  if not prompts:
    raise ValueError(f"{path}: no prompts")
  return prompts
