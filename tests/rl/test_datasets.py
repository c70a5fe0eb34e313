"""Tests for tlt_jax/rl/datasets.py."""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tlt_jax.rl import datasets
from tlt_jax.rl import rewards
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
    assert example.reward == "math_verify"
    assert example.metadata == {"source": f"{path}:{line}", "data_source": row["data_source"]}
    assert example.prompt.startswith("<bos>") and example.prompt.endswith("<|assistant|>")
    assert tokenizer.decode(example.prompt_ids) == example.prompt
  if rows is VERL_ROWS:
    assert dataset[0].prompt == (
        "<bos><|system|>Think step by step.<|user|>What is 6 * 7?<|assistant|>")
  else:
    assert dataset[0].prompt == "<bos><|user|>What is 2 + 2?<|assistant|>"


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
  assert [e.metadata["source"] for e in dataset] == [f"{path}:1", f"{path}:11"]
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


def test_bad_reward_or_tokenizer_fails_fast(tokenizer, tmp_path):
  path = _write_jsonl(tmp_path / "d.jsonl", FLAT_ROWS)
  with pytest.raises(ValueError, match="unknown reward"):
    datasets.from_file(path, tokenizer, reward="accuracy")
  bare = tokenizer_lib.build_tokenizer()
  bare.chat_template = None
  with pytest.raises(ValueError, match="no chat template"):
    datasets.from_file(path, bare)


def test_procedural_dataset(tokenizer):
  dataset = datasets.from_tasks("chain_sum", tokenizer, size=32, seed=0)
  assert len(dataset) == 32 and dataset.skipped == {}
  assert dataset.examples == datasets.from_tasks("chain_sum", tokenizer, size=32, seed=0).examples
  example = dataset[0]
  assert example.reward == "reasoning_gym"
  assert example.prompt == f"<bos><|user|>{example.metadata['entry']['question']}<|assistant|>"
  assert tokenizer.decode(example.prompt_ids) == example.prompt
  scores_B, stats = rewards.score_batch(
      "reasoning_gym", [e.solution for e in dataset], [e.ground_truth for e in dataset],
      [e.metadata for e in dataset])
  assert scores_B.tolist() == [1.0] * 32 and stats["failures"] == 0


def test_procedural_dataset_skips_long_prompts(tokenizer):
  full = datasets.from_tasks("chain_sum", tokenizer, size=64, seed=0)
  max_len = sorted(len(e.prompt_ids) for e in full)[48]
  short = datasets.from_tasks("chain_sum", tokenizer, size=64, seed=0, max_prompt_len=max_len)
  assert all(len(e.prompt_ids) <= max_len for e in short)
  assert short.skipped == {"prompt_too_long": 64 - len(short)} and len(short) < 64


def test_load_dispatches_on_source(tokenizer, tmp_path):
  procedural = datasets.load("basic_arithmetic", tokenizer, size=4, seed=1)
  assert len(procedural) == 4 and procedural[0].reward == "reasoning_gym"
  path = _write_parquet(tmp_path / "d.parquet", VERL_ROWS)
  from_file = datasets.load(path, tokenizer, size=4, seed=1, reward="format")
  assert len(from_file) == 2 and from_file[0].reward == "format"
  with pytest.raises(FileNotFoundError, match="chain_sum"):
    datasets.load("chain_summ", tokenizer, size=4, seed=1)


def test_rows_the_chat_template_rejects_are_skipped(tmp_path):
  strict = tokenizer_lib.build_tokenizer()
  strict.chat_template = (
      "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}"
      "{% for message in messages %}{{ message['content'] }}{% endfor %}")
  dataset = datasets.from_file(_write_jsonl(tmp_path / "d.jsonl", VERL_ROWS), strict)
  assert dataset.skipped == {"template_error": 1}
  assert [e.prompt for e in dataset] == ["Half of 1?"]
