"""A character-level tokenizer for the tiny world, as a Hugging Face fast tokenizer.

One token per printable ASCII character and newline, plus special tokens: small enough
(103 ids) for a few-million-parameter model, exact on task text, and an ordinary
`PreTrainedTokenizerFast` so that `save_pretrained`, `AutoTokenizer.from_pretrained` and
`apply_chat_template` work as they do for real models.

`chat_prompt` is how every prompt goes through a tokenizer's chat template (this one's or a real
model's), with the tools' schemas when the model may call tools: a template that fails is an error
naming the tokenizer and the cause.
"""

from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers
import transformers

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<bos>", "<eos>"
ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = (PAD, UNK, BOS, EOS) + tuple(f"<|{role}|>" for role in ROLES)
CHARACTERS = tuple(chr(c) for c in range(32, 127)) + ("\n",)

# One marker token per turn and no separators, to keep sequences short. Assistant turns end
# with EOS so that a rendered conversation is also an SFT target. With `tools` (JSON schemas, as
# `apply_chat_template(tools=...)` passes them) a system line names each tool and its parameters,
# "<|system|>tools: calculator(expression)"; a tool message is "<|tool|>" (characters, not a
# token) and its content.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>tools: "
    "{% for tool in tools %}{% set f = tool.function if tool.function is defined else tool %}"
    "{{ f.name }}({{ (f.parameters.properties if f.parameters is defined else {}) | join(', ') }})"
    "{% if not loop.last %}, {% endif %}{% endfor %}{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_tokenizer(model_max_length: int = 4096) -> transformers.PreTrainedTokenizerFast:
  """The character tokenizer; characters outside CHARACTERS encode as <unk>."""
  vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
  tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=UNK))
  # `[\s\S]` rather than `.`, which would not match a newline.
  tokenizer.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
  tokenizer.decoder = decoders.Fuse()  # concatenate; the default decoder joins with spaces
  tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=tokenizer,
      pad_token=PAD,
      unk_token=UNK,
      bos_token=BOS,
      eos_token=EOS,
      extra_special_tokens=list(SPECIAL_TOKENS[4:]),
      chat_template=CHAT_TEMPLATE,
      clean_up_tokenization_spaces=False,  # exact round trips: "3 ." must stay "3 ."
      model_max_length=model_max_length,
  )


class ChatTemplateError(ValueError):
  """A tokenizer's chat template failed; the message names the tokenizer and the cause."""


def describe(tokenizer: transformers.PreTrainedTokenizerBase) -> str:
  """The tokenizer as errors name it: its path, or its class when it was built in memory."""
  return (f"tokenizer {tokenizer.name_or_path!r}" if tokenizer.name_or_path
          else f"the in-memory tokenizer ({type(tokenizer).__name__})")


def chat_prompt(tokenizer: transformers.PreTrainedTokenizerBase, messages: list[dict[str, str]],
                tools: list[dict[str, Any]] | None = None) -> str:
  """`messages` rendered by the tokenizer's chat template, ending with the assistant turn's opening; `tools`:
  the JSON schemas of the tools the model may call (tlt_jax.rl.tools)."""
  name = describe(tokenizer)
  if not tokenizer.chat_template:
    raise ChatTemplateError(f"{name} has no chat template")
  try:
    return tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=False)
  except Exception as e:  # pylint: disable=broad-exception-caught
    # Whatever the cause (jinja2 not installed, a broken template, a conversation it rejects), it is named.
    raise ChatTemplateError(f"{name}: chat template failed ({type(e).__name__}: {e})") from e
