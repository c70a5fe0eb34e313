"""Tests for tlt_jax/rl/tools.py: turns that append what the chat template renders (the tiny world's and a
ChatML one written here, Qwen2.5's layout), malformed calls and failing tools as messages to the model, calls in
worker processes (timeouts, replaced workers), the calculator, and the errors at start-up."""

import json
import multiprocessing
import textwrap
import time

import numpy as np
import pytest
import tokenizers
import transformers
from tokenizers import decoders, models, pre_tokenizers, trainers

from tlt_jax.rl import tools
from tlt_jax.rl import tokenizer as tokenizer_lib
from tlt_jax.rollout.state import Sample

USER_TOOLS = textwrap.dedent('''
    import time

    def lookup(city: str, year: int = 2024) -> dict:
      """Looks a city up.

      Args:
        city: The city's name.
        year: The year.
      """
      return {"city": city, "year": year}

    def explode(x: int) -> str:
      """Raises.

      Args:
        x: Anything.
      """
      raise RuntimeError("tool exploded")

    def hang(x: int) -> str:
      """Hangs.

      Args:
        x: Anything.
      """
      time.sleep(60)
      return "late"

    def thing(x: int) -> str:
      """Returns an object.

      Args:
        x: Anything.
      """
      return object()

    def words(n: int) -> str:
      """Numbered words.

      Args:
        n: How many.
      """
      return " ".join(f"w{i}" for i in range(n))

    def undocumented(x: int) -> str:
      return "x"

    def untyped(x):
      """Has no type hints.

      Args:
        x: Anything.
      """
      return "x"
    ''')

# Qwen2.5's layout, written for this test: the tools in a system message, each tool message in a user turn's
# <tool_response>, consecutive ones in the same turn.
CHATML_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these functions:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    'Call one as <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def user_tools(tmp_path_factory):
  path = tmp_path_factory.mktemp("tools") / "my_tools.py"
  path.write_text(USER_TOOLS)
  return lambda name: f"{path}:{name}"


@pytest.fixture(scope="module")
def tiny():
  return tokenizer_lib.build_tokenizer()


@pytest.fixture(scope="module")
def chatml():
  """A byte-level BPE tokenizer with ChatML's special tokens and Qwen's tool tags (added tokens, not special)."""
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(
      ["What is 123 + 456 in Paris? The answer is 579.", '{"name": "calculator", "arguments": {"expression": "1"}}'],
      trainers.BpeTrainer(vocab_size=400, special_tokens=["<|im_start|>", "<|im_end|>"],
                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
  return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                              extra_special_tokens=["<|im_start|>"], chat_template=CHATML_TEMPLATE,
                                              clean_up_tokenization_spaces=False)


def _ids(tokenizer, text):
  return tokenizer(text, add_special_tokens=False).input_ids


def _call(name, **arguments):
  return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


@pytest.mark.parametrize("which", ["tiny", "chatml"])
def test_a_conversation_with_tool_turns_is_the_templates_token_for_token(which, request, user_tools):
  """Prompt + the model's turn + Turn.tokens + its answer are the tokens of the conversation the chat template
  renders with the tools (transformers' schemas of the functions themselves) and their messages."""
  tokenizer = request.getfixturevalue(which)
  stop = tokenizer.eos_token
  turns = tools.ToolTurns(["calculator", user_tools("lookup")], tokenizer, max_turns=2, timeout_s=5, workers=0)
  user = [{"role": "user", "content": "What is 123 + 456 in Paris?"}]
  content = "Let me compute. " + _call("calculator", expression="123 + 456") + _call("lookup", city="Paris")
  answer = "The answer is 579."
  prompt = _ids(tokenizer, tokenizer_lib.chat_prompt(tokenizer, user, turns.schemas))
  turn = turns.submit(_ids(tokenizer, content + stop)).result()
  assert [(c["name"], c["result"], c["error"]) for c in turn.calls] == [
      ("calculator", "579", None), ("lookup", '{"city": "Paris", "year": 2024}', None)]
  assert turn.tokens.dtype == np.int32
  ids = prompt + _ids(tokenizer, content + stop) + turn.tokens.tolist() + _ids(tokenizer, answer + stop)
  conversation = user + [{"role": "assistant", "content": content}]
  conversation += [{"role": "tool", "name": c["name"], "content": c["result"]} for c in turn.calls]
  conversation.append({"role": "assistant", "content": answer})
  text = tokenizer.apply_chat_template(conversation, tools=[tools.calculator, tools.load(user_tools("lookup"))],
                                       tokenize=False)
  full = _ids(tokenizer, text)
  assert full[:len(ids)] == ids
  assert tokenizer.decode(full[len(ids):]) == ("" if which == "tiny" else "\n")  # the template's end after a turn
  if which == "tiny":
    assert tokenizer.decode(turn.tokens) == '<|tool|>579<|tool|>{"city": "Paris", "year": 2024}<|assistant|>'


@pytest.mark.parametrize("which", ["tiny", "chatml"])
def test_a_multi_turn_response_is_the_conversation_trl_passes_a_reward(which, request, user_tools):
  """The whole trajectory after the prompt, as TRL's GRPOTrainer builds a tool rollout's completion: each
  assistant turn's text and its calls ("tool_calls"), then a "tool" message per call with its result."""
  tokenizer = request.getfixturevalue(which)
  stop = tokenizer.eos_token
  turns = tools.ToolTurns(["calculator", user_tools("lookup")], tokenizer, max_turns=2, timeout_s=5, workers=0)
  content = "Let me compute. " + _call("calculator", expression="123 + 456") + _call("lookup", city="Paris")
  first, answer = _ids(tokenizer, content + stop), _ids(tokenizer, "The answer is 579." + stop)
  turn = turns.submit(first).result()
  tokens = np.asarray(first + turn.tokens.tolist() + answer, np.int32)
  mask = np.zeros(len(tokens), bool)
  mask[len(first):len(first) + len(turn.tokens)] = True
  sample = Sample(0, 0, tokens, np.zeros(len(tokens), np.float32), "stop", tool_mask=mask, tool_calls=turn.calls)
  assert tools.conversation(sample, tokenizer) == [
      {"role": "assistant", "content": "Let me compute.", "tool_calls": [
          {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "123 + 456"}}},
          {"type": "function", "function": {"name": "lookup", "arguments": {"city": "Paris"}}}]},
      {"role": "tool", "name": "calculator", "content": "579"},
      {"role": "tool", "name": "lookup", "content": '{"city": "Paris", "year": 2024}'},
      {"role": "assistant", "content": "The answer is 579."}]
  assert tools.conversation(Sample(0, 0, tokens, tokens * 0.0, "stop"), tokenizer) is None  # no tools: no turns


def test_the_tiny_worlds_prompt_names_the_tools(tiny, user_tools):
  turns = tools.ToolTurns(["calculator", user_tools("lookup")], tiny, max_turns=2, timeout_s=5, workers=0)
  assert turns.stop_token_id == tiny.eos_token_id
  assert tokenizer_lib.chat_prompt(tiny, [{"role": "user", "content": "1 + 2 ="}], turns.schemas) == (
      "<bos><|system|>tools: calculator(expression), lookup(city, year)<|user|>1 + 2 =<|assistant|>")


def test_a_turn_without_a_tool_call_finishes_the_row(tiny):
  """So does one that another stop token ended (not the template's end of an assistant turn)."""
  turns = tools.ToolTurns(["calculator"], tiny, max_turns=2, timeout_s=5, workers=0)
  assert turns.submit(_ids(tiny, "Answer: 3<eos>")) is None
  call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 2"}}</tool_call>'
  assert turns.submit(_ids(tiny, call + "<eos>")) is not None
  assert turns.submit(_ids(tiny, call + "<pad>")) is None


def test_a_long_result_keeps_its_first_and_last_tokens(chatml, user_tools):
  """`max_tokens`: a longer result is cut in the middle, a note saying how much (the record keeps its length);
  a short one is as it was; what the turn appends is the template's rendering of the cut result."""
  turns = tools.ToolTurns([user_tools("words")], chatml, max_turns=2, timeout_s=5, workers=0, max_tokens=16)
  turn = turns.submit(_ids(chatml, _call("words", n=3) + _call("words", n=400) + "<|im_end|>")).result()
  short, long = turn.calls
  assert (short["result"], short["result_tokens"]) == ("w0 w1 w2", len(_ids(chatml, "w0 w1 w2")))
  full = len(_ids(chatml, " ".join(f"w{i}" for i in range(400))))
  assert long["result_tokens"] == full > 16
  head, note, tail = long["result"].split("\n")
  assert note == f"...({full - 16} tokens cut)..." and head.startswith("w0 w1") and tail.endswith("w399")
  assert len(_ids(chatml, head)) + len(_ids(chatml, tail)) <= 18  # 8 + 8, give or take a merge at the cuts
  whole = tools.ToolTurns([user_tools("words")], chatml, max_turns=2, timeout_s=5, workers=0)
  assert turn.tokens.tolist() == whole.turn([{"name": "words", "result": short["result"]},
                                             {"name": "words", "result": long["result"]}]).tokens.tolist()
  uncut = whole.submit(_ids(chatml, _call("words", n=400) + "<|im_end|>")).result().calls[0]
  assert uncut["result"] == " ".join(f"w{i}" for i in range(400)) and "result_tokens" not in uncut


@pytest.mark.parametrize("call, kind, message", [
    ("<tool_call>{name: calculator}</tool_call>", "bad_json", "Error: the tool call is not valid JSON (Expecting"),
    ('<tool_call>["calculator"]</tool_call>', "bad_json", 'Error: a tool call is a JSON object with a "name"'),
    ('<tool_call>{"arguments": {}}</tool_call>', "bad_json", 'Error: a tool call is a JSON object with a "name"'),
    (_call("search", query="x"), "unknown_tool", "Error: unknown tool 'search'; the tools are calculator"),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "bad_arguments",
     'Error: the "arguments" of a call to calculator must be a JSON object'),
    (_call("calculator", expr="1"), "bad_arguments", "Error: bad arguments for calculator: missing a required"),
    (_call("calculator", expression="x + 1"), "raised", "Error: ValueError: 'x' is not allowed: only numbers"),
    ('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2 * 3\\"}"}</tool_call>', None, "6"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "2 * 3"}}', None, "6"),  # unclosed, last
])
def test_a_malformed_call_is_an_error_message_to_the_model(tiny, call, kind, message):
  turns = tools.ToolTurns(["calculator"], tiny, max_turns=2, timeout_s=5, workers=0)
  turn = turns.submit(_ids(tiny, "Let me see. " + call + "<eos>")).result()
  [record] = turn.calls
  assert record["error"] == kind and record["result"].startswith(message)
  assert set(record) == {"name", "arguments", "result", "error", "seconds"}
  assert tiny.decode(turn.tokens) == f"<|tool|>{record['result']}<|assistant|>"


def test_tools_run_in_workers_with_a_timeout_and_failures_become_messages(tiny, user_tools):
  """One turn calls a tool that raises, one that hangs past its timeout, one that returns an object and one that
  works, at once in two workers; the hung worker is killed (replaced when a call needs it)."""
  specs = [user_tools(name) for name in ("explode", "hang", "thing", "lookup")]
  turns = tools.ToolTurns(specs, tiny, max_turns=4, timeout_s=1.0, workers=2)
  try:
    text = _call("explode", x=1) + _call("hang", x=1) + _call("thing", x=1) + _call("lookup", city="Oslo")
    future = turns.submit(_ids(tiny, text + "<eos>"))
    assert not future.done()  # submit returns at once
    calls = future.result(timeout=60).calls
    assert [(c["error"], c["result"]) for c in calls] == [
        ("raised", "Error: RuntimeError: tool exploded"), ("timeout", "Error: the call timed out after 1 s"),
        ("bad_result", "Error: the tool returned a object, not text, a number or JSON"),
        (None, '{"city": "Oslo", "year": 2024}')]
    assert calls[1]["seconds"] == 1.0 and calls[3]["seconds"] < 1.0
    assert len(multiprocessing.active_children()) == 1
    again = turns.submit(_ids(tiny, _call("lookup", city="Rome", year=1) + "<eos>")).result(timeout=60)
    assert again.calls[0]["result"] == '{"city": "Rome", "year": 1}'
  finally:
    start = time.monotonic()
    turns.close()
  assert time.monotonic() - start < 2 and not multiprocessing.active_children()


def test_without_workers_a_hung_call_times_out_too(tiny, user_tools):
  """`workers=0` (in this process): the hung call is a timeout message after timeout_s, the next call runs."""
  turns = tools.ToolTurns([user_tools("hang"), user_tools("lookup")], tiny, max_turns=2, timeout_s=0.5, workers=0)
  start = time.monotonic()
  calls = turns.submit(_ids(tiny, _call("hang", x=1) + _call("lookup", city="Oslo") + "<eos>")).result().calls
  assert [(c["error"], c["result"]) for c in calls] == [
      ("timeout", "Error: the call timed out after 0.5 s"), (None, '{"city": "Oslo", "year": 2024}')]
  assert time.monotonic() - start < 5


@pytest.mark.parametrize("expression, value", [
    ("123 + 456", "579"), ("2 + 3 * 4", "14"), ("(2 + 3) * 4", "20"), ("-3 - -4", "1"), ("-(2 + 3) * 4", "-20"),
    ("+5", "5"), ("7 / 2", "3.5"), ("10 / 4 * 2", "5"), ("1 / 3", "0.3333333333333333"), ("0.1 + 0.2", "0.3"),
    ("1.5 * 2", "3"), ("8 - 2 - 1", "5"), ("12 / 2 / 3", "2"), (" 42 ", "42"), ("1e20 * 3", "3e+20")])
def test_the_calculator(expression, value):
  assert tools.calculator(expression) == value


@pytest.mark.parametrize("expression, why", [
    ("x + 1", "'x' is not allowed"), ("abs(-1)", "'abs\\(-1\\)' is not allowed"),
    ("__import__('os').system('true')", "is not allowed"), ("math.pi", "'math.pi' is not allowed"),
    ("2 ** 3", "'2 \\*\\* 3' is not allowed"), ("7 // 2", "is not allowed"), ("True + 1", "'True' is not allowed"),
    ("1 / 0", "division by zero"), ("1 / (2 - 2)", "division by zero"), ("1 +", "is not an arithmetic expression"),
    ("", "is not an arithmetic expression"), ("1; 2", "is not an arithmetic expression"),
    ("1e999", "too large"), ("1" * 1001, "longer than 1000 characters"), ("-" * 999 + "1", "nested too deeply")])
def test_the_calculator_rejects_what_is_not_arithmetic(expression, why):
  with pytest.raises(ValueError, match=why):
    tools.calculator(expression)


def test_a_tool_that_cannot_be_loaded_or_described_is_an_error_naming_it(tiny, user_tools, tmp_path):
  start = lambda *specs: tools.ToolTurns(list(specs), tiny, max_turns=2, timeout_s=5, workers=0)
  with pytest.raises(tools.ToolError, match="unknown tool 'search': one of \\['calculator'\\], 'path/to/file.py"):
    start("search")
  with pytest.raises(tools.ToolError, match="tool '.*missing.py:f': cannot import .*missing.py: FileNotFoundError"):
    start(f"{tmp_path}/missing.py:f")
  with pytest.raises(tools.ToolError, match="tool 'no_such_module:f': cannot import no_such_module: ModuleNotFound"):
    start("no_such_module:f")
  with pytest.raises(tools.ToolError, match="tool '.*my_tools.py:nothing': .*my_tools.py has no function 'nothing'"):
    start(user_tools("nothing"))
  with pytest.raises(tools.ToolError, match="tool '.*:undocumented': transformers cannot describe it "
                                            "\\(DocstringParsingException: .*has no docstring"):
    start(user_tools("undocumented"))
  with pytest.raises(tools.ToolError, match="tool '.*:untyped': transformers cannot describe it "
                                            "\\(TypeHintParsingException: .*missing a type hint"):
    start(user_tools("untyped"))
  with pytest.raises(tools.ToolError, match="tools 'calculator' and 'tlt_jax.rl.tools:calculator' are both named"):
    start("calculator", "tlt_jax.rl.tools:calculator")


def test_a_template_that_cannot_render_tool_turns_fails_at_start_naming_the_tokenizer(tiny):
  no_tools = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tiny.backend_tokenizer, eos_token="<eos>", chat_template=(
          "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
          "{{ m.content }}{% endfor %}"))
  with pytest.raises(tools.ToolError, match=r"tool turns cannot be rendered: the in-memory tokenizer "
                                            r"\(\w+\): chat template failed .*no tool role"):
    tools.ToolTurns(["calculator"], no_tools, max_turns=2, timeout_s=5, workers=0)
  no_stop = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tiny.backend_tokenizer, eos_token="<eos>",
      chat_template="{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
  with pytest.raises(tools.ToolError, match=r"does not end an assistant turn with a special token right after the "
                                            r"content \(it renders '\\ntool: probe\\n'\)"):
    tools.ToolTurns(["calculator"], no_stop, max_turns=2, timeout_s=5, workers=0)
