"""`python -m tlt_jax.generate`: greedy parity with transformers, and bad input rejected cleanly."""

import json
import os
import re

import numpy as np
import pytest
import torch
from absl import flags

from tests.conftest import FAMILIES, VOCAB, run_clis
from tlt_jax import cli, generate


def run_cli(args):
  flags.FLAGS.unparse_flags()
  argv = ["generate", *args]
  flags.FLAGS(argv)
  generate.main(argv[:1])


def write_jsonl(path, rows):
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
  return str(path)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers(family, hf_dirs, tmp_path, capsys):
  model_dir, ref = hf_dirs[family]
  rng = np.random.RandomState(7)
  prompts = [rng.randint(2, VOCAB, n).tolist() for n in (3, 11, 6)]
  out = tmp_path / "out.jsonl"
  in_path = write_jsonl(tmp_path / "in.jsonl", [{"prompt_ids": p} for p in prompts])
  run_cli([f"--model={model_dir}", f"--prompts={in_path}",
           f"--output={out}", "--temperature=0", "--max_new_tokens=64", "--batch_size=4"])
  summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  records = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["prompt_index"] for r in records] == [0, 1, 2] and summary["samples"] == 3
  assert summary["tokens"] == sum(len(r["output_ids"]) for r in records)
  for r in records:
    with torch.no_grad():
      expected = ref.generate(torch.tensor([prompts[r["prompt_index"]]]), max_new_tokens=64, do_sample=False,
                              eos_token_id=1, pad_token_id=0)[0, len(prompts[r["prompt_index"]]):].tolist()
    assert r["output_ids"] == expected


def test_one_long_prompt_cuts_only_its_own_budget(hf_dirs, tmp_path, capsys, caplog):
  """A 250-token prompt in a 256-position model gets 6 new tokens; the short prompts beside it keep
  --max_new_tokens (they used to get 6 too, silently). The cut is reported."""
  model_dir, ref = hf_dirs["qwen2_tied"]
  rng = np.random.RandomState(3)
  prompts = [rng.randint(2, VOCAB, n).tolist() for n in (5, 250, 9)]
  out = tmp_path / "out.jsonl"
  in_path = write_jsonl(tmp_path / "in.jsonl", [{"prompt_ids": p} for p in prompts])
  run_cli([f"--model={model_dir}", f"--prompts={in_path}",
           f"--output={out}", "--temperature=0", "--max_new_tokens=20", "--batch_size=4"])
  for r in (json.loads(line) for line in out.read_text().splitlines()):
    prompt = prompts[r["prompt_index"]]
    with torch.no_grad():
      expected = ref.generate(torch.tensor([prompt]), max_new_tokens=min(20, 256 - len(prompt)), do_sample=False,
                              eos_token_id=1, pad_token_id=0)[0, len(prompt):].tolist()
    assert r["output_ids"] == expected
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["cut_prompts"] == 1
  assert "1 of 3 prompts are too long for --max_new_tokens=20 within the model's 256 positions" in caplog.text


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_temperature_is_refused(value, hf_dirs, tmp_path):
  """--temperature=nan used to run and emit token 0s."""
  with pytest.raises(flags.IllegalFlagValueError, match=f"flag --temperature={value}: must be a finite number >= 0"):
    run_cli([f"--model={hf_dirs['qwen3'][0]}", "--prompts=p.jsonl", f"--output={tmp_path / 'o.jsonl'}",
             f"--temperature={value}"])
  assert os.listdir(tmp_path) == []


def test_cli_fails_cleanly_without_partial_output(hf_dirs, tmp_path):
  """`python -m tlt_jax.generate` on a malformed prompt file and on a misspelt flag (forked from one process:
  tests/conftest.py `run_clis`)."""
  model_dir, _ = hf_dirs["qwen2_tied"]
  data, logs = tmp_path / "data", tmp_path / "logs"
  data.mkdir()
  logs.mkdir()
  bad = write_jsonl(data / "in.jsonl", [{"prompt_ids": [3, 4]}, "{oops"])
  cases = [[f"--model={model_dir}", f"--prompts={bad}", f"--output={data / 'out.jsonl'}"],
           ["--model=x", "--prompts=y", "--output=z", "--temprature=1"]]
  (code, _, stderr), (misspelt, _, flag_error) = run_clis([("tlt_jax.generate", args, data) for args in cases], logs,
                                                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert code != 0 and "in.jsonl:2: malformed JSON" in stderr, stderr[-3000:]
  assert os.listdir(data) == ["in.jsonl"]
  assert misspelt != 0 and "temprature" in flag_error, flag_error[-3000:]


def test_random_drafter_gives_the_same_greedy_output(hf_dirs, tmp_path, capsys):
  model_dir, _ = hf_dirs["qwen3"]
  prompts = write_jsonl(tmp_path / "in.jsonl", [{"prompt_ids": [5, 9, 14]}, {"prompt_ids": [7, 3]}])
  outputs = {}
  # The random drafter; suffix drafts with no drafter model; both, as bandit arms beside SD off.
  modes = (("plain", []), ("sd", ["--drafter=random", "--strategy=3_2_5"]),
           ("suffix", ["--drafter=suffix", "--strategy=3_2_5", "--suffix_bank_len=64"]),
           ("both", ["--drafter=random", "--strategy=3_2_5,s3_1_4"]))
  for name, extra in modes:
    out = tmp_path / f"{name}.jsonl"
    run_cli([f"--model={model_dir}", f"--prompts={prompts}", f"--output={out}", "--temperature=0",
             "--max_new_tokens=24", "--batch_size=2", *extra])
    outputs[name] = [json.loads(line)["output_ids"] for line in out.read_text().splitlines()]
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    if name != "plain":
      assert outputs[name] == outputs["plain"], name
      assert summary["verify_passes"] > 0 and summary["accept_len"] >= 1, name


@pytest.mark.parametrize("extra,message", [
    (["--drafter=suffix", "--strategy=4_x_5"], "--strategy=4_x_5: strategy 's4_x_5' is not"),
    (["--drafter=random", "--strategy=4_2_8,s4_1_9"],
     "--strategy=4_2_8,s4_1_9: strategy s4_1_9: verify_tokens must be in [2, 5]"),
    (["--drafter=suffix", "--strategy=4_1_5,s4_1_5"], "a strategy is named twice"),
    (["--drafter=suffix", "--suffix_bank_len=4"], "--suffix_bank_len=4: must hold the longest prompt (3 tokens) + 2")])
def test_bad_suffix_flags_are_named(extra, message, hf_dirs, tmp_path):
  prompts = write_jsonl(tmp_path / "in.jsonl", [{"prompt_ids": [5, 9, 14]}])
  with pytest.raises(cli.InputError, match=re.escape(message)):
    run_cli([f"--model={hf_dirs['qwen3'][0]}", f"--prompts={prompts}", f"--output={tmp_path / 'o.jsonl'}", *extra])
  assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]
