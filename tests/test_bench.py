"""`python -m tlt_jax.bench` end to end on a tiny model with a tokenizer (as a subprocess: CLIs own flags),
each mode's run forked from one process that imported the CLI (tests/conftest.py `run_clis`)."""

import csv
import json
import os

import pytest
from flax import nnx

from tests.conftest import run_clis
from tlt_jax.drafter import checkpoint
from tlt_jax.drafter.model import Drafter
from tlt_jax.models import CausalLM, ModelConfig, hf
from tlt_jax.rl import tokenizer as tokenizer_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_model_dir(tmp_path):
  tok = tokenizer_lib.build_tokenizer()
  cfg = ModelConfig("Qwen3ForCausalLM", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=2, num_kv_heads=1, head_dim=16, qk_norm=True, tie_word_embeddings=True,
                    eos_token_id=tok.eos_token_id)
  model_dir = str(tmp_path / "model")
  hf.save_pretrained(CausalLM(cfg, rngs=nnx.Rngs(0)), model_dir, tokenizer=tok)
  return model_dir


# Each mode's flags (its --output and --model added; --drafter=random unless given).
CASES = {
    "grid": ["--batch_sizes=1", "--strategies=2_1_3,3_2_6", "--max_new_tokens=12", "--rows=3", "--temperatures=0,1"],
    "suffix": ["--batch_sizes=1,8", "--strategies=s3_1_4", "--drafter=", "--num_samples=4", "--history_len=64",
               "--max_new_tokens=12"],
    "phases_refused": ["--model=m", "--phases", "--strategies=2_1_3,s2_1_3"],
    "adaptive": ["--adaptive", "--rows=2", "--num_samples=2", "--strategies=2_1_3,s2_1_3", "--max_new_tokens=12",
                 "--sd_max_batch=4", "--repeats=1"],
    # One batch size: each cell compiles an engine and its phases; the grid covers the batch-size loop.
    "phases": ["--phases", "--batch_sizes=2", "--strategies=2_2_4", "--max_new_tokens=40", "--prompts={prompts}",
               "--drafter={drafter}"],
    "refill": ["--refill", "--rows=6", "--num_samples=2", "--bucket=4", "--max_new_tokens=16", "--temperature=1.0",
               "--repeats=1"],
    "paged": ["--paged", "--rows=3", "--num_samples=4", "--bucket=2", "--paged_bucket=8", "--page_size=16",
              "--max_new_tokens=64", "--temperature=1.0", "--repeats=1"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, xla_cache):
  """name -> ((exit code, stdout, stderr), its output directory) of each case's run on one tiny model; the
  phases case reads a prompt file and a reduced-head drafter (timed beside the full head on the same layers).
  The cases share the session's compilation cache: the engines of a mode share most of their programs."""
  root = tmp_path_factory.mktemp("bench")
  model_dir = tiny_model_dir(root)
  prompts = root / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"prompt": f"Calculate {i} + {i + 2}."}) + "\n" for i in range(3)))
  cfg, _ = hf.read_config(model_dir)
  drafter_dir = str(root / "drafter")
  checkpoint.save_drafter(Drafter(cfg, draft_vocab=tuple(range(0, cfg.vocab_size, 2)), rngs=nnx.Rngs(0)), drafter_dir)
  cases = []
  for name, flags in CASES.items():
    (root / name).mkdir()
    flags = [f.format(prompts=prompts, drafter=drafter_dir) for f in flags]
    drafter = [] if any(f.startswith("--drafter=") for f in flags) else ["--drafter=random"]
    model = [] if any(f.startswith("--model=") for f in flags) else [f"--model={model_dir}"]
    cases.append(("tlt_jax.bench", [*drafter, "--verbosity=-1", *model, f"--output={root / name / 'out.json'}",
                                    *flags], REPO))
  logs = root / "logs"
  logs.mkdir()
  results = run_clis(cases, logs, timeout=1200, compilation_cache=xla_cache)
  return {"vocab_size": cfg.vocab_size, **{name: (run, root / name) for name, run in zip(CASES, results)}}


def output(runs, name):
  """The case's JSON record (after checking it ran) and its output directory."""
  (code, _, stderr), out = runs[name]
  assert code == 0, stderr[-3000:]
  return json.loads((out / "out.json").read_text()), out


def test_bench_writes_the_grid(runs):
  """A cell of batch size b rolls out b rows, or --rows: batch 1 over 3 prompts one after another; a grid
  per temperature, and the acceptance picture."""
  record, out = output(runs, "grid")
  assert record["command"].startswith("python -m tlt_jax.bench --drafter=random") and "CPU cores" in record["machine"]
  assert record["date"].endswith("UTC") and set(record) == {"command", "machine", "commit", "date", "rows"}
  records = record["rows"]
  assert [(r["temperature"], r["batch_size"], r["rows"], r["strategy"], r["verify_tokens"]) for r in records] == [
      (t, 1, 3, s, v) for t in (0.0, 1.0) for s, v in (("2_1_3", 3), ("3_2_6", 6))]
  for r in records:
    assert set(r) == {"temperature", "batch_size", "rows", "strategy", "verify_tokens", "tokens_per_s",
                      "baseline_tokens_per_s", "speedup", "accept_len"}
    assert r["tokens_per_s"] > 0 and r["accept_len"] >= 1
    assert abs(r["speedup"] - r["tokens_per_s"] / r["baseline_tokens_per_s"]) < 1e-2
  with open(out / "out.csv", encoding="utf-8") as f:
    assert len(list(csv.DictReader(f))) == 4
  assert (out / "out.png").stat().st_size > 0


def test_grid_of_suffix_strategies_with_samples_and_history_needs_no_drafter(runs):
  """4 samples per prompt: batch 1 rolls one prompt's 4 samples one after another, batch 4 two prompts'
  (4 rows at once); the suffix arm is also timed with an earlier rollout's responses in the bank."""
  records = output(runs, "suffix")[0]["rows"]
  assert [(r["batch_size"], r["rows"], r["strategy"]) for r in records] == [
      (1, 4, "s3_1_4"), (1, 4, "s3_1_4+history"), (8, 8, "s3_1_4"), (8, 8, "s3_1_4+history")]
  assert all(r["tokens_per_s"] > 0 and r["accept_len"] >= 1 for r in records)


def test_phases_mode_refuses_suffix_strategies(runs):
  """They draft without the drafter: no phases to time (refused before any model is read: --model=m)."""
  code, _, stderr = runs["phases_refused"][0]
  assert code == 1 and "error: --strategies=2_1_3,s2_1_3: --phases times the EAGLE" in stderr, stderr[-3000:]


def test_adaptive_mode_compares_bandit_fixed_and_plain(runs):
  records = output(runs, "adaptive")[0]["rows"]
  assert [r["mode"] for r in records] == ["plain", "sd_off", "2_1_3", "s2_1_3", "bandit"]
  assert records[0]["speedup"] == 1.0 and all(r["tokens_per_s"] > 0 for r in records)
  assert all(r["compilations"] == 0 for r in records)  # the warm-up round compiled every engine
  bandit = records[-1]
  plays = sum(arm["plays"] for bucket in bandit["bandit"].values() for arm in bucket.values())
  assert plays == bandit["warmup_plays"] + bandit["timed_plays"] and bandit["timed_plays"] > 0
  arms = [r["tokens_per_s"] for r in records[1:-1]]  # SD off and the strategy, each alone; not plain
  assert abs(bandit["vs_best_fixed"] - bandit["tokens_per_s"] / max(arms)) < 1e-2
  assert abs(bandit["vs_worst_fixed"] - bandit["tokens_per_s"] / min(arms)) < 1e-2
  assert bandit["summary"]["rollout/tokens_per_s"] > 0
  assert all(len(r["tokens_per_s_rounds"]) == 1 for r in records)  # --repeats=1
  summary = bandit["summary"]
  assert summary["rollout/probe_s"] / summary["rollout/wall_s"] - 1e-3 <= bandit["learning_share"] < 1
  assert bandit["settled_vs_best_fixed"] > 0


def test_phases_mode_splits_an_iteration_and_reads_prompt_files(runs):
  records = output(runs, "phases")[0]["rows"]
  vocab = runs["vocab_size"]
  assert [(r["batch_size"], r["strategy"], r["draft_vocab"]) for r in records] == [
      (2, "2_2_4", (vocab + 1) // 2), (2, "2_2_4", vocab)]
  for r in records:
    assert all(r[k] > 0 for k in ("draft", "verify", "feed", "iteration", "plain", "segment"))
    assert 1 <= r["accept_len"] <= 3


def test_refill_mode_compares_refill_with_waves(runs):
  """Not timed: the three modes run, sample the same tokens, and refill fills the freed slots."""
  records = output(runs, "refill")[0]["rows"]
  assert [r["mode"] for r in records] == ["waves", "refill", "longest_first"]
  waves, refill, longest = records
  assert waves["rows"] == refill["rows"] == longest["rows"] == 12 and waves["speedup"] == 1.0
  assert waves["refills"] == 0 < refill["refills"] and refill["same_samples"] and longest["same_samples"]
  assert longest["refills"] > 0
  for r in (refill, longest):
    assert abs(r["speedup"] - r["tokens_per_s"] / waves["tokens_per_s"]) < 1e-2
  assert all(0 <= r[k] <= 1 for r in records for k in ("idle_slot_fraction", "tail_share"))


def test_paged_mode_compares_pages_with_the_contiguous_cache(runs):
  """Not timed: both caches hold the same slots and sample the same tokens; the paged one has more
  rows in flight."""
  contiguous, paged = output(runs, "paged")[0]["rows"]
  assert (contiguous["mode"], paged["mode"]) == ("contiguous", "paged")
  assert contiguous["rows"] == paged["rows"] == 12 and contiguous["cache_slots"] == paged["cache_slots"]
  assert paged["same_samples"] and paged["peak_rows"] > contiguous["peak_rows"] == 2
  assert abs(paged["speedup"] - paged["tokens_per_s"] / contiguous["tokens_per_s"]) < 1e-2
