"""Prompts JSONL files: good lines become token ids, bad lines are named."""

import json

import pytest

from tlt_jax import prompts


def write_jsonl(path, rows):
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
  return str(path)


def test_ids_and_text_prompts(tmp_path):
  from tlt_jax.rl import tokenizer as tokenizer_lib
  tok = tokenizer_lib.build_tokenizer()
  path = write_jsonl(tmp_path / "in.jsonl", [{"prompt_ids": [3, 4]}, "", {"prompt": "1+2"}])
  plain = prompts.read_prompts(path, tok, chat=False, max_len=256, vocab_size=len(tok))
  assert plain == [[3, 4], tok("1+2", add_special_tokens=False)["input_ids"]]
  chat = prompts.read_prompts(path, tok, chat=True, max_len=256, vocab_size=len(tok))
  assert tok.decode(chat[1]) == "<bos><|user|>1+2<|assistant|>"


@pytest.mark.parametrize("line, message", [
    ("{not json", r"in.jsonl:2: malformed JSON"),
    ({"text": "x"}, r"in.jsonl:2: needs a 'prompt' or 'prompt_ids' field"),
    ({"prompt_ids": []}, r"in.jsonl:2: empty prompt"),
    ({"prompt_ids": [3] * 300}, r"in.jsonl:2: prompt has 300 tokens; the model allows 256"),
    ({"prompt": "hello"}, r"in.jsonl:2: a text 'prompt' needs a tokenizer"),
    ({"prompt_ids": [3, 1000]}, r"in.jsonl:2: 'prompt_ids' must be a list of token ids in \[0, 1000\)"),
    # Booleans are ints to Python, but no token ids: [true, false, true] is not [1, 0, 1].
    ({"prompt_ids": [True, False, True]}, r"in.jsonl:2: 'prompt_ids' must be a list of token ids"),
])
def test_bad_lines_are_named(line, message, tmp_path):
  path = write_jsonl(tmp_path / "in.jsonl", [{"prompt_ids": [3, 4]}, line])
  with pytest.raises(ValueError, match=message):
    prompts.read_prompts(path, None, chat=False, max_len=256, vocab_size=1000)




def test_non_utf8_line_is_named(tmp_path):
  path = tmp_path / "in.jsonl"
  path.write_bytes(b'{"prompt_ids": [3]}\n\xff\xfe{"prompt_ids": [4]}\n')
  with pytest.raises(ValueError, match=r"in.jsonl:2: not UTF-8 text \(invalid start byte at byte 0\)"):
    prompts.read_prompts(str(path), None, chat=False, max_len=256, vocab_size=1000)


def test_chat_template_failure_names_line_tokenizer_and_cause(tmp_path):
  from tlt_jax.rl import tokenizer as tokenizer_lib
  tok = tokenizer_lib.build_tokenizer()
  tok.chat_template = "{{ raise_exception('no chats here') }}"
  path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "1+2"}])
  with pytest.raises(ValueError, match=r"in.jsonl:1: the in-memory tokenizer \(\w+\): chat template failed "
                     r"\(TemplateError: no chats here\)"):
    prompts.read_prompts(path, tok, chat=True, max_len=256, vocab_size=len(tok))
