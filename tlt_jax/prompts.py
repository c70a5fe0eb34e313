"""Prompts JSONL files for the CLIs: {"prompt": "text"} or {"prompt_ids": [1, 2, 3]} per line."""

from __future__ import annotations

import json
import os


class InputError(ValueError):
  """Bad input; the message names the file and line (or the flag)."""


def read_prompts(path: str, tokenizer, *, chat: bool, max_len: int, vocab_size: int) -> list[list[int]]:
  """Token ids of every line. Text prompts need `tokenizer`; `chat` applies its chat template."""
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
        if not isinstance(ids, list) or not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids):
          raise InputError(f"{where}: 'prompt_ids' must be a list of token ids in [0, {vocab_size})")
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
