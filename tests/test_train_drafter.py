"""`python -m tlt_jax.train_drafter` end to end on a tiny model directory.

Run as a subprocess: the CLIs define absl flags of the same names (--model, --output), so two
of them cannot be imported into one test process.
"""

import json
import os
import shutil
import stat
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from tests.conftest import run_clis
from tlt_jax.drafter import checkpoint, train
from tlt_jax.drafter.model import Drafter
from tlt_jax.models import hf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args):
  return subprocess.run([sys.executable, "-m", "tlt_jax.train_drafter", "--verbosity=-1", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=300, check=False)


def write_prompts(tmp_path, rows):
  path = tmp_path / "prompts.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_trains_saves_and_reloads_a_drafter(hf_dirs, tmp_path):
  model_dir = hf_dirs["qwen3"][0]  # no tokenizer: prompts as token ids
  prompts = write_prompts(tmp_path, [{"prompt_ids": [5, 17, 40, 9]}, {"prompt_ids": [7, 3, 88]}])
  out = tmp_path / "drafter"
  earlier = Drafter(hf.read_config(model_dir)[0], rngs=nnx.Rngs(9))
  checkpoint.save_drafter(earlier, str(out))  # an earlier run's output: replaced with --overwrite
  proc = run_cli(f"--model={model_dir}", f"--prompts={prompts}", f"--output={out}", "--overwrite", "--num_samples=1",
                 "--max_new_tokens=12", "--steps=3", "--batch_rows=2", "--row_len=32", "--eval_fraction=0.5")
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads(proc.stdout.strip().splitlines()[-1])
  assert summary["samples"] == 2 and summary["train_sequences"] == 1 and summary["eval_sequences"] == 1
  assert summary["feature_layers"] == [] and summary["steps"] == 3
  assert np.isfinite(summary["loss_first"]) and 0 <= summary["top1_heldout"] <= 1
  rates = [summary["top1_heldout"], summary["top1_2_heldout"], summary["top1_3_heldout"]]  # greedy: a chain's
  assert summary["heldout_chain_accept_len"] == pytest.approx(1 + rates[0] + rates[0] * rates[1] + np.prod(rates),
                                                            abs=1e-3)
  drafter = checkpoint.load_drafter(str(out), hf.read_config(model_dir)[0])
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(nnx.state(drafter)))
  assert not np.array_equal(drafter.fc.kernel.get_value(), earlier.fc.kernel.get_value())
  assert stat.S_IMODE(os.stat(out).st_mode) == 0o777 & ~_umask()  # not tempfile's 0700


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def test_output_that_is_the_model_is_refused_and_the_model_kept(hf_dirs, tmp_path):
  """`--output=M` with `--model=M` used to delete the model and put the drafter in its place (both cases forked
  from one process: tests/conftest.py `run_clis`)."""
  model_dir = str(tmp_path / "model")
  shutil.copytree(hf_dirs["qwen3"][0], model_dir)
  before = sorted(os.listdir(model_dir))
  prompts = write_prompts(tmp_path, [{"prompt_ids": [5, 17]}])
  outputs = (model_dir, str(tmp_path))  # the model, or a directory holding it
  logs = tmp_path / "logs"
  logs.mkdir()
  runs = run_clis([("tlt_jax.train_drafter", ["--verbosity=-1", f"--model={model_dir}", f"--prompts={prompts}",
                                              f"--output={output}", "--overwrite"], REPO) for output in outputs], logs)
  for (code, _, stderr), output in zip(runs, outputs):
    assert code == 1 and stderr.strip().splitlines() == [
        f"error: --output={output} {'is' if output == model_dir else 'holds'} --model={model_dir}: writing it would "
        "delete that input; choose another --output"], stderr[-3000:]
  assert sorted(os.listdir(model_dir)) == before and hf.read_config(model_dir)


def test_reduced_vocabulary_drafter(hf_dirs, tmp_path):
  """--draft_vocab_size: the head covers the most frequent training response tokens, the checkpoint
  keeps them, the summary reports the held-out coverage; a size over the vocabulary is refused first."""
  model_dir = hf_dirs["qwen2_tied"][0]
  prompts = write_prompts(tmp_path, [{"prompt_ids": [5, 17, 40, 9]}, {"prompt_ids": [7, 3, 88]},
                                     {"prompt_ids": [11, 12]}, {"prompt_ids": [30]}])
  out = tmp_path / "drafter"
  proc = run_cli(f"--model={model_dir}", f"--prompts={prompts}", f"--output={out}", "--num_samples=2",
                 "--temperature=1", "--max_new_tokens=16", "--steps=3", "--batch_rows=2", "--row_len=32",
                 "--eval_fraction=0.25", "--draft_vocab_size=24")
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads(proc.stdout.strip().splitlines()[-1])
  assert summary["draft_vocab_size"] == 24 and 0 < summary["draft_vocab_coverage_heldout"] <= 1
  # Sampled responses: the loss at their temperature, two draft steps, and what verification can accept.
  assert (summary["loss_temperature"], summary["logit_weight"], summary["draft_steps"]) == (1.0, 1.0, 2)
  ceiling = summary["heldout_acceptance_per_draft_step"]
  assert len(ceiling) == 3 and all(0 <= c["p_top1"] <= c["p_top4"] <= c["p_top8"] <= 1 for c in ceiling)
  assert all(c["coupled"] <= c["tree_top4"] <= c["tree_top8"] <= 1 for c in ceiling)
  assert summary["heldout_chain_accept_len"] == pytest.approx(train.chain_accept_len([c["coupled"] for c in ceiling]),
                                                            abs=1e-3)
  trees = summary["heldout_tree_accept_len"]  # the best trees of 8-48 verify tokens hold a chain of 3
  assert list(trees) == ["8", "16", "32", "48"] and trees["8"] <= trees["16"] <= trees["32"] <= trees["48"]
  assert trees["8"] >= summary["heldout_chain_accept_len"] - 1e-3
  drafter = checkpoint.load_drafter(str(out), hf.read_config(model_dir)[0])
  assert len(drafter.draft_vocab) == 24 and list(drafter.draft_vocab) == sorted(drafter.draft_vocab)
  refused = {"--draft_vocab_size=97": "error: --draft_vocab_size=97 is larger than the target's vocabulary of 96",
             **{f"--draft_vocab_coverage={c}": f"error: flag --draft_vocab_coverage={float(c)}: --draft_vocab_coverage "
                "must lie in (0, 1]" for c in ("0", "1.5")},
             "--num_samples=2": "error: flags num_samples=2, temperature=0.0: --num_samples > 1 needs --temperature > "
                                "0 (greedy draws one response)"}
  logs = tmp_path / "logs"
  logs.mkdir()
  runs = run_clis([("tlt_jax.train_drafter", ["--verbosity=-1", f"--model={model_dir}", f"--prompts={prompts}",
                                              f"--output={tmp_path / 'd'}", flag], REPO) for flag in refused], logs)
  for (code, _, stderr), error in zip(runs, refused.values()):
    assert code == 1 and stderr.strip().splitlines()[-1] == error and "Traceback" not in stderr, stderr[-3000:]
  assert not os.path.exists(tmp_path / "d")


def test_bad_input_is_named(hf_dirs, tmp_path):
  model_dir = hf_dirs["qwen3"][0]
  prompts = write_prompts(tmp_path, [{"prompt_ids": [5, 17]}, {"prompt_ids": [5, 99]}])
  proc = run_cli(f"--model={model_dir}", f"--prompts={prompts}", f"--output={tmp_path / 'd'}")
  assert proc.returncode != 0 and "prompts.jsonl:2: 'prompt_ids' must be a list of token ids in [0, 96)" in proc.stderr
  assert not os.path.exists(tmp_path / "d")
