"""Tests for tlt_jax/rl/datasets.py."""

import collections
import json
import logging
import string

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tlt_jax.rl import datasets
from tlt_jax.rl import rewards, scorer
from tlt_jax.rl import tokenizer as tokenizer_lib

# Eurus-2-RL / verl shape: chat messages and a nested ground truth.
VERL_ROWS = [
    {
        "data_source": "numina_olympiads",
        "prompt": [
            {"role": "system", "content": "Think step by step."},
            {"role": "user", "content": "What is 6 * 7?"},
        ],
        "ability": "math",
        "reward_model": {"ground_truth": "42", "style": "rule"},
    },
    {
        "data_source": "numina_amc_aime",
        "prompt": [{"role": "user", "content": "Half of 1?"}],
        "ability": "math",
        "reward_model": {"ground_truth": "\\frac{1}{2}", "style": "rule"},
    },
]
# DAPO-Math (processed) shape: a string prompt and a top-level answer.
FLAT_ROWS = [
    {"prompt": "What is 2 + 2?", "solution": "4", "data_source": "math_dapo"},
    {"prompt": "What is 3 * 3?", "solution": "9", "data_source": "math_dapo"},
]


@pytest.fixture(scope="module")
def tokenizer():
  return tokenizer_lib.build_tokenizer()


def _write_jsonl(path, rows):
  path.write_text("".join(json.dumps(row) + "\n" for row in rows))
  return str(path)


def _write_parquet(path, rows):
  pq.write_table(pa.Table.from_pylist(rows), path)
  return str(path)


@pytest.mark.parametrize("writer, suffix", [(_write_jsonl, ".jsonl"), (_write_parquet, ".parquet")])
@pytest.mark.parametrize("rows, ground_truths", [(VERL_ROWS, ["42", "\\frac{1}{2}"]),
                                                 (FLAT_ROWS, ["4", "9"])])
def test_file_shapes_load(tokenizer, tmp_path, writer, suffix, rows, ground_truths):
  path = writer(tmp_path / f"data{suffix}", rows)
  dataset = datasets.from_file(path, tokenizer)
  assert dataset.skipped == {}
  assert [e.ground_truth for e in dataset] == ground_truths
  for line, (example, row) in enumerate(zip(dataset, rows), start=1):
    assert example.reward == rewards.Reward.of("auto")
    assert (example.where, example.data_source, example.extra_info) == (f"{path}:{line}", row["data_source"], {})
    assert example.columns == row and example.item("x").prompt == row["prompt"]  # what a TRL reward gets
    assert example.item("x").prompt == (row["prompt"] if rows is VERL_ROWS else row["prompt"])
    assert example.prompt.startswith("<bos>") and example.prompt.endswith("<|assistant|>")
    assert tokenizer.decode(example.prompt_ids) == example.prompt
  if rows is VERL_ROWS:
    assert dataset[0].prompt == (
        "<bos><|system|>Think step by step.<|user|>What is 6 * 7?<|assistant|>")
  else:
    assert dataset[0].prompt == "<bos><|user|>What is 2 + 2?<|assistant|>"


# GSM8K's shape: the answer ends with "#### <number>" after the worked solution.
GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7",
     "extra_info": {"split": "test", "index": 0}, "data_source": "openai/gsm8k"},
    {"question": "Half of 10?", "answer": "10 / 2 = 5\n####  5 ", "extra_info": {"split": "test", "index": 1},
     "data_source": "openai/gsm8k"},
    {"question": "No answer line", "answer": "just prose"},
]


def test_keys_regex_system_prompt_and_what_reaches_the_reward(tokenizer, tmp_path):
  path = _write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
  keys = datasets.Keys(prompt_key="question", answer_key="answer", answer_regex="#### (.*)",
                       system_prompt="Reason, then answer.")
  dataset = datasets.from_file(path, tokenizer, keys=keys)
  # Where the regex does not match, the ground truth is taken as it is (verl's are bare already).
  assert [e.ground_truth for e in dataset] == ["7", "5", "just prose"] and dataset.skipped == {}
  first = dataset[0]
  assert first.prompt == ("<bos><|system|>Reason, then answer.<|user|>Tom has 3 apples and buys 4. How many?"
                          "<|assistant|>")
  item = first.item("so 7\nAnswer: 7", [5, 6])
  assert (item.data_source, item.ground_truth, item.extra_info, item.where) == (
      "openai/gsm8k", "7", {"split": "test", "index": 0}, f"{path}:1")
  # TRL's `prompts` entry for a string prompt is the string; its tokens and the row's columns come along.
  assert (item.prompt, item.completion_ids, item.columns) == (GSM8K_ROWS[0]["question"], (5, 6), GSM8K_ROWS[0])
  nested = datasets.from_file(_write_jsonl(tmp_path / "verl.jsonl", VERL_ROWS), tokenizer,
                              keys=datasets.Keys(answer_key="reward_model.ground_truth", system_prompt="Be brief."))
  assert [e.ground_truth for e in nested] == ["42", "\\frac{1}{2}"]
  # A chat prompt: the model reads data.system_prompt where the row has none; TRL's `prompts` entry is the row's.
  assert nested[1].messages[0] == {"role": "system", "content": "Be brief."}
  assert [e.item("x").prompt for e in nested] == [row["prompt"] for row in VERL_ROWS]
  with pytest.raises(ValueError, match=r"answer_regex '\(': missing \)"):
    datasets.Keys(answer_regex="(")


@pytest.mark.parametrize("writer", [_write_jsonl, _write_parquet])
def test_a_key_the_file_lacks_names_it_and_the_columns(tokenizer, tmp_path, writer):
  path = writer(tmp_path / ("d.jsonl" if writer is _write_jsonl else "d.parquet"), FLAT_ROWS)
  with pytest.raises(ValueError, match=r"no column 'query' \(data.prompt_key='query'\); its columns: data_source, "
                                       r"prompt, solution"):
    datasets.from_file(path, tokenizer, keys=datasets.Keys(prompt_key="query"))
  with pytest.raises(ValueError, match=r"no column 'reward_model' \(data.answer_key='reward_model.ground_truth'\)"):
    datasets.from_file(path, tokenizer, keys=datasets.Keys(answer_key="reward_model.ground_truth"))


def test_a_directory_saved_by_hf_datasets(tokenizer, tmp_path):
  hf_datasets = pytest.importorskip("datasets")
  hf_datasets.Dataset.from_list(GSM8K_ROWS[:2]).save_to_disk(str(tmp_path / "gsm8k"))
  dataset = datasets.from_file(str(tmp_path / "gsm8k"), tokenizer,
                               keys=datasets.Keys(answer_key="answer", answer_regex="#### (.*)"))
  assert [e.ground_truth for e in dataset] == ["7", "5"] and dataset[1].where == f"{tmp_path / 'gsm8k'}:2"
  hf_datasets.DatasetDict({"test": hf_datasets.Dataset.from_list(GSM8K_ROWS[:2])}).save_to_disk(str(tmp_path / "dd"))
  with pytest.raises(ValueError, match=r"holds the splits \['test'\]: point at one of them"):
    datasets.from_file(str(tmp_path / "dd"), tokenizer)
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match="empty: not a directory saved by datasets.save_to_disk"):
    datasets.from_file(str(tmp_path / "empty"), tokenizer)


def test_other_ground_truth_keys(tokenizer, tmp_path):
  rows = [{"question": "q1", "answer": 5}, {"problem": "q2", "ground_truth": "7"}]
  dataset = datasets.from_file(_write_jsonl(tmp_path / "d.jsonl", rows), tokenizer)
  assert [e.ground_truth for e in dataset] == ["5", "7"]


def test_malformed_rows_are_skipped_and_counted(tokenizer, tmp_path, caplog):
  good = {"prompt": "What is 1 + 1?", "answer": "2"}
  lines = [
      json.dumps(good),
      "{not json",
      "",  # blank lines are not rows
      json.dumps([1, 2]),
      json.dumps({"answer": "2"}),
      json.dumps({"prompt": "   ", "answer": "2"}),
      json.dumps({"prompt": [{"role": "user"}], "answer": "2"}),
      json.dumps({"prompt": "q", "reward_model": {"style": "rule"}}),
      json.dumps({"prompt": "q", "answer": ["2", "3"]}),
      json.dumps({"prompt": "x" * 100, "answer": "2"}),
      json.dumps(good),
  ]
  path = tmp_path / "mixed.jsonl"
  path.write_bytes("\n".join(lines).encode() + b"\n\xff\xfe{}\n")
  with caplog.at_level(logging.WARNING):
    dataset = datasets.from_file(str(path), tokenizer, max_prompt_len=64)
  assert len(dataset) == 2
  assert dataset.skipped == {
      "bad_json": 3,
      "missing_prompt": 1,
      "empty_prompt": 1,
      "bad_prompt": 1,
      "missing_ground_truth": 1,
      "bad_ground_truth": 1,
      "prompt_too_long": 1,
  }
  assert [e.where for e in dataset] == [f"{path}:1", f"{path}:11"]
  assert f"{path}:2: skipped (bad_json)" in caplog.text
  assert f"{path}:5: skipped (missing_prompt)" in caplog.text
  assert "skipped 9 of 11 rows" in caplog.text  # the blank line is not a row


def test_missing_and_unsupported_files(tokenizer, tmp_path):
  missing = str(tmp_path / "nope.parquet")
  with pytest.raises(FileNotFoundError, match=f"not found: {missing}"):
    datasets.from_file(missing, tokenizer)
  csv = tmp_path / "data.csv"
  csv.write_text("prompt,answer\n")
  with pytest.raises(ValueError, match="data.csv: unsupported"):
    datasets.from_file(str(csv), tokenizer)
  broken = tmp_path / "broken.parquet"
  broken.write_text("not parquet")
  with pytest.raises(ValueError, match="broken.parquet: not a readable Parquet file"):
    datasets.from_file(str(broken), tokenizer)


def test_bad_reward_fails_fast(tokenizer, tmp_path):
  path = _write_jsonl(tmp_path / "d.jsonl", FLAT_ROWS)
  with pytest.raises(ValueError, match="unknown reward"):
    datasets.from_file(path, tokenizer, reward="accuracy")
  # A TRL function's required parameter must be a column of the file.
  (tmp_path / "r.py").write_text("def acc(completions, answer, **kwargs):\n  return [1.0] * len(completions)\n")
  with pytest.raises(ValueError, match=r"d.jsonl: reward '.*r.py:acc': its required parameter 'answer' is neither"):
    datasets.from_file(path, tokenizer, reward=f"{tmp_path}/r.py:acc")
  assert len(datasets.from_file(_write_jsonl(tmp_path / "a.jsonl", GSM8K_ROWS[:2]), tokenizer,
                                reward=f"{tmp_path}/r.py:acc")) == 2


def test_a_row_the_reward_cannot_score_is_an_error_naming_it(tokenizer, tmp_path):
  """reasoning_gym reads a reasoning-gym entry that a file's rows do not hold: refused at start-up, not 0 on
  every sample. auto sends such rows (no reasoning-gym source) to math_verify."""
  path = _write_jsonl(tmp_path / "d.jsonl", FLAT_ROWS)
  with pytest.raises(rewards.Unscorable, match=r"d.jsonl:1: reward 'reasoning_gym' scores it with reasoning-gym's "
                                               r"scorer, which reads the row's reasoning-gym entry "
                                               r"\(extra_info.entry\)"):
    datasets.from_file(path, tokenizer, reward="reasoning_gym")
  assert len(datasets.from_file(path, tokenizer, reward="auto")) == 2


def test_verl_gsm8k_files_need_no_keys(tokenizer, tmp_path):
  """verl's preprocessed GSM8K (chat prompt with its instruction, a bare ground truth) and GSM8K's own rows
  both load with the default keys and GSM8K's answer regex; the default reward scores them with gsm8k."""
  verl = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{r['question']} Let's think step "
                                                      "by step and output the final answer after \"####\"."}],
           "ability": "math", "reward_model": {"style": "rule", "ground_truth": r["answer"].split("####")[-1].strip()},
           "extra_info": {"split": "train", "index": i}} for i, r in enumerate(GSM8K_ROWS[:2])]
  keys = datasets.Keys(answer_regex="#### (.*)")
  for rows in (verl, GSM8K_ROWS[:2]):
    dataset = datasets.from_file(_write_parquet(tmp_path / "d.parquet", rows), tokenizer, keys=keys)
    assert [e.ground_truth for e in dataset] == ["7", "5"]
  scores, stats = scorer.Scorer(workers=0).score("auto", [dataset[0].item("3 + 4 = 7\n#### 7")])
  assert scores.tolist() == [1.0] and stats["formatted"] == 1.0


def test_procedural_dataset(tokenizer):
  dataset = datasets.from_tasks("chain_sum", tokenizer, size=32, seed=0)
  assert len(dataset) == 32 and dataset.skipped == {}
  assert dataset.examples == datasets.from_tasks("chain_sum", tokenizer, size=32, seed=0).examples
  example = dataset[0]
  assert example.reward == rewards.Reward.of("auto") and example.data_source == "chain_sum"
  assert example.prompt == f"<bos><|user|>{example.extra_info['entry']['question']}<|assistant|>"
  assert tokenizer.decode(example.prompt_ids) == example.prompt
  assert example.columns == {"prompt": example.extra_info["entry"]["question"], "ground_truth": example.ground_truth,
                             "data_source": "chain_sum", "extra_info": example.extra_info}
  scores_B, stats = scorer.Scorer(workers=0).score("auto", [e.item(e.solution) for e in dataset])
  assert scores_B.tolist() == [1.0] * 32 and stats["failures"] == 0


def test_procedural_dataset_skips_long_prompts(tokenizer):
  full = datasets.from_tasks("chain_sum", tokenizer, size=64, seed=0)
  max_len = sorted(len(e.prompt_ids) for e in full)[48]
  short = datasets.from_tasks("chain_sum", tokenizer, size=64, seed=0, max_prompt_len=max_len)
  assert all(len(e.prompt_ids) <= max_len for e in short)
  assert short.skipped == {"prompt_too_long": 64 - len(short)} and len(short) < 64


def test_load_dispatches_on_source(tokenizer, tmp_path):
  procedural = datasets.load("basic_arithmetic", tokenizer, size=4, seed=1)
  assert len(procedural) == 4 and procedural[0].reward == rewards.Reward.of("auto")
  path = _write_parquet(tmp_path / "d.parquet", VERL_ROWS)
  from_file = datasets.load(path, tokenizer, size=4, seed=1, reward="format")
  assert len(from_file) == 2 and from_file[0].reward == rewards.Reward.of("format")
  with pytest.raises(FileNotFoundError, match="chain_sum"):
    datasets.load("chain_summ", tokenizer, size=4, seed=1)


@pytest.mark.parametrize("cause, message", [
    ("no_jinja2", r"chat template failed \(ImportError: apply_chat_template requires jinja2"),
    ("broken", r"chat template failed \(TemplateSyntaxError: "),
    ("none", r"has no chat template"),
])
def test_a_chat_template_that_fails_is_an_error_not_a_skip(cause, message, tmp_path, monkeypatch):
  """jinja2 missing (the fresh-install failure: every problem used to be skipped, and SFT failed
  later on row lengths), a broken template, no template: an error naming the tokenizer and the cause,
  for procedural tasks and files alike."""
  tok = tokenizer_lib.build_tokenizer()
  tok.name_or_path = "/models/tiny"
  if cause == "no_jinja2":
    import transformers.utils.chat_template_utils as chat_utils
    monkeypatch.setattr(chat_utils, "is_jinja_available", lambda: False)
    tok.chat_template += "{# not compiled before: the compiled-template cache is per string #}"
  else:
    tok.chat_template = "{% for message in messages %}{{ message['content'] }" if cause == "broken" else None
  path = _write_jsonl(tmp_path / "d.jsonl", FLAT_ROWS)
  for load in (lambda: datasets.from_tasks("chain_sum", tok, size=4, seed=0), lambda: datasets.from_file(path, tok)):
    with pytest.raises(tokenizer_lib.ChatTemplateError, match=f"^tokenizer '/models/tiny'(: )?.*{message}"):
      load()


def test_rows_the_chat_template_rejects_are_skipped(tmp_path):
  strict = tokenizer_lib.build_tokenizer()
  strict.chat_template = (
      "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}"
      "{% for message in messages %}{{ message['content'] }}{% endfor %}")
  dataset = datasets.from_file(_write_jsonl(tmp_path / "d.jsonl", VERL_ROWS), strict)
  assert dataset.skipped == {"template_error": 1}
  assert [e.prompt for e in dataset] == ["Half of 1?"]


# ---- property-based: random mixes of good and malformed rows ----

FUZZ_MAX_PROMPT_LEN = 100
text = st.text(string.ascii_letters + string.digits + " +-*/=?.", min_size=1, max_size=30).filter(str.strip)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]), "content": text}),
                    min_size=1, max_size=2)
answers = st.one_of(text, st.integers(-10**30, 10**30), st.floats(allow_nan=False, allow_infinity=False))


@st.composite
def jsonl_line(draw):
  """(line bytes, reason it is skipped for, or None for a good row, or "" for a blank line)."""
  prompt_key = draw(st.sampled_from(["prompt", "question", "problem"]))
  row = {prompt_key: draw(text | messages)}
  if draw(st.booleans()):
    row["reward_model"] = {"ground_truth": draw(text), "style": "rule"}
  else:
    row[draw(st.sampled_from(["ground_truth", "answer", "solution"]))] = draw(answers)
  gt_keys = [k for k in row if k != prompt_key]
  good = json.dumps(row).encode()
  reason = draw(st.sampled_from([None, None, None, "", "bad_json", "missing_prompt", "bad_prompt", "empty_prompt",
                                 "missing_ground_truth", "bad_ground_truth", "prompt_too_long"]))
  if reason == "":
    return draw(st.sampled_from([b"", b"  ", b"\t"])), reason
  if reason == "bad_json":
    return draw(st.one_of(
        st.integers(1, len(good) - 1).map(lambda n: good[:n]),  # cut short
        st.sampled_from([b"[1, 2]", b"42", b'"prompt"', b"null", b"true"]),  # JSON, not an object
        st.just(b"\xff\xfe" + good),  # not UTF-8
        st.just(good.replace(b'": "', b'": "\\ud800', 1)))), reason  # a lone surrogate escape
  if reason == "missing_prompt":
    if draw(st.booleans()):
      row[prompt_key] = None
    else:
      del row[prompt_key]
  elif reason == "bad_prompt":
    row[prompt_key] = draw(st.sampled_from([7, 1.5, {"role": "user", "content": "hi"}, [1], [{"role": "user"}],
                                            [{"role": "user", "content": 3}]]))
  elif reason == "empty_prompt":
    row[prompt_key] = draw(st.sampled_from([" ", "\n\t ", [{"role": "user", "content": "  "}], []]))
  elif reason == "missing_ground_truth":
    for k in gt_keys:
      row[k] = draw(st.sampled_from([None, "", "   "])) if k != "reward_model" else {"style": "rule"}
  elif reason == "bad_ground_truth":
    bad = draw(st.sampled_from([[1, 2], {"x": 1}, True, float("nan"), float("inf")]))
    for k in gt_keys:
      row[k] = bad if k != "reward_model" else {"ground_truth": bad}
  elif reason == "prompt_too_long":
    row[prompt_key] = draw(st.text("abc", min_size=FUZZ_MAX_PROMPT_LEN, max_size=2 * FUZZ_MAX_PROMPT_LEN))
  return json.dumps(row).encode(), reason


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("fuzz")


def assert_loaded(path, reasons, tokenizer, caplog):
  """Good rows load in order, bad ones are counted by reason and the first five logged; all bad fails."""
  caplog.clear()
  rows = [(line, r) for line, r in enumerate(reasons, 1) if r != ""]
  bad = [(line, r) for line, r in rows if r is not None]
  if len(bad) == len(rows):
    with pytest.raises(ValueError, match=f"{path}: no usable rows"):
      datasets.from_file(path, tokenizer, max_prompt_len=FUZZ_MAX_PROMPT_LEN)
    event("no usable row: rejected")
    return
  with caplog.at_level(logging.WARNING):
    dataset = datasets.from_file(path, tokenizer, max_prompt_len=FUZZ_MAX_PROMPT_LEN)
  assert dataset.skipped == dict(collections.Counter(r for _, r in bad))
  assert [e.where for e in dataset] == [f"{path}:{line}" for line, r in rows if r is None]
  for line, r in bad[:5]:
    assert f"{path}:{line}: skipped ({r})" in caplog.text
  if bad:
    assert f"skipped {len(bad)} of {len(rows)} rows" in caplog.text
  for r in {r for _, r in bad}:
    event(f"skipped: {r}")


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(jsonl_line(), min_size=1, max_size=12))
def test_fuzz_jsonl_malformed_rows_are_skipped_and_counted(tokenizer, fuzz_dir, caplog, lines):
  path = fuzz_dir / "rows.jsonl"
  path.write_bytes(b"\n".join(line for line, _ in lines) + b"\n")
  assert_loaded(str(path), [r for _, r in lines], tokenizer, caplog)


PARQUET_CELLS = {  # reason -> (prompt, answer) cells of a string-typed table
    None: st.tuples(text, text),
    "missing_prompt": st.tuples(st.none(), text),
    "empty_prompt": st.tuples(st.sampled_from(["", " ", "\t\n"]), text),
    "missing_ground_truth": st.tuples(text, st.sampled_from([None, "", "  "])),
    "prompt_too_long": st.tuples(st.text("xyz", min_size=FUZZ_MAX_PROMPT_LEN, max_size=150), text),
}


@settings(max_examples=50, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from([None, *PARQUET_CELLS]).flatmap(
    lambda r: PARQUET_CELLS[r].map(lambda cells: (cells, r))), min_size=1, max_size=12))
def test_fuzz_parquet_malformed_rows_are_skipped_and_counted(tokenizer, fuzz_dir, caplog, rows):
  path = str(fuzz_dir / "rows.parquet")
  schema = pa.schema([("prompt", pa.string()), ("answer", pa.string())])
  pq.write_table(pa.Table.from_pylist([{"prompt": p, "answer": a} for (p, a), _ in rows], schema), path)
  assert_loaded(path, [r for _, r in rows], tokenizer, caplog)
