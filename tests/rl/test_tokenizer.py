"""Tests for tlt_jax/rl/tokenizer.py."""

import pytest
import transformers

from tlt_jax.rl import tasks
from tlt_jax.rl import tokenizer as tokenizer_lib


@pytest.fixture(scope="module")
def tokenizer():
  return tokenizer_lib.build_tokenizer()


def test_vocab_is_small_with_special_tokens(tokenizer):
  assert len(tokenizer) == len(tokenizer_lib.SPECIAL_TOKENS) + len(tokenizer_lib.CHARACTERS) < 128
  assert tokenizer.pad_token_id == 0
  assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token) == ("<bos>", "<eos>", "<unk>")
  assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}) == 3


def test_task_text_round_trips_one_token_per_character(tokenizer):
  texts = [t for p in tasks.generate("chain_sum", 64, seed=0) for t in (p.prompt, p.solution)]
  texts.append("  spaces, tabs-free punctuation: ~`!@#$%^&*()_+{}|:\"<>?[]\\;',./ 3 . 's\n\n")
  for text in texts:
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text


def test_unknown_characters_become_unk(tokenizer):
  ids = tokenizer("a\té", add_special_tokens=False).input_ids
  assert ids[1:] == [tokenizer.unk_token_id] * 2


def test_chat_template(tokenizer):
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 2 ="}]
  text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
  assert text == "<bos><|system|>Be brief.<|user|>1 + 2 =<|assistant|>"
  ids = tokenizer(text, add_special_tokens=False).input_ids
  assert ids[0] == tokenizer.bos_token_id
  assert len(ids) == 3 + len("Be brief.") + len("1 + 2 =") + 1  # markers are single tokens
  conversation = messages + [{"role": "assistant", "content": "Answer: 3"}]
  assert tokenizer.apply_chat_template(conversation, tokenize=False).endswith(
      "<|assistant|>Answer: 3<eos>")


def test_save_and_reload_with_auto_tokenizer(tokenizer, tmp_path):
  tokenizer.save_pretrained(tmp_path)
  loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
  text = tasks.generate("chain_sum", 1, seed=0)[0].solution
  assert loaded(text).input_ids == tokenizer(text).input_ids
  assert loaded.decode(loaded(text).input_ids) == text
  assert loaded.get_vocab() == tokenizer.get_vocab()
  assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (
      tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
  messages = [{"role": "user", "content": "7 - 9 ="}]
  assert loaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
      tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


def test_chat_template_with_tools(tokenizer):
  """A system line names each tool and its parameters; a tool message is "<|tool|>" (characters) and its content;
  without tools the prompt is as before."""
  tools = [{"type": "function", "function": {"name": "calculator", "parameters": {
      "type": "object", "properties": {"expression": {"type": "string"}}}}},
           {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
  messages = [{"role": "user", "content": "1 + 2 ="}, {"role": "assistant", "content": "<tool_call>..."},
              {"role": "tool", "name": "calculator", "content": "3"}]
  assert tokenizer_lib.chat_prompt(tokenizer, messages, tools) == (
      "<bos><|system|>tools: calculator(expression), now()<|user|>1 + 2 =<|assistant|><tool_call>...<eos><|tool|>3"
      "<|assistant|>")
  assert tokenizer_lib.chat_prompt(tokenizer, messages[:1], []) == "<bos><|user|>1 + 2 =<|assistant|>"
  ids = tokenizer("<|tool|>", add_special_tokens=False).input_ids
  assert len(ids) == len("<|tool|>") and len(tokenizer) == 103  # no token added
