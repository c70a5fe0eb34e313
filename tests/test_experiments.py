"""The experiment scripts start: each one's imports and absl flags load (a flag defined twice, in the
script and in a module it imports, fails at import), and its --helpshort lists its own flags. Running
them takes minutes each (docs/BENCHMARKS.md records what they measured); experiments/accelerator.py
runs end to end at its smoke size, and bench_kernels' smoke, which checks every tree-attention
implementation in its interpreter, in seconds; gpu_check.py's smoke runs every part of the GPU check,
vs_trl.py's both sides."""

import csv
import json
import os
import re
import subprocess
import sys
import tarfile

import pytest

from tests.conftest import run_clis, xla_flags_without_device_count

EXPERIMENTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments")
# imported by the scripts; no flags of their own
HELPERS = ("starting_point.py", "side_by_side.py", "gpu_parts.py", "gpu_plan.py", "open_requests.py")
SCRIPTS = sorted(f[:-3] for f in os.listdir(EXPERIMENTS) if f.endswith(".py") and f not in HELPERS)


@pytest.fixture(scope="module")
def help_runs(tmp_path_factory):
  """(exit code, stdout, stderr) of `python experiments/SCRIPT.py --helpshort` per script, each as a user
  runs it but forked from one process that imported what they import (tests/conftest.py `run_clis`)."""
  runs = run_clis([(f"{s}.py", ["--helpshort"], EXPERIMENTS) for s in SCRIPTS], tmp_path_factory.mktemp("help"))
  return dict(zip(SCRIPTS, runs))


@pytest.mark.parametrize("script", SCRIPTS)
def test_experiment_flags_load(script, help_runs):
  code, stdout, stderr = help_runs[script]
  assert "Traceback" not in stderr, stderr[-3000:]
  assert code == 1 and f"{script}.py" in stdout, stdout[-2000:]  # absl's help: its flags, exit status 1


@pytest.fixture(scope="module")
def smoke_env(xla_cache):
  """The accelerator and gpu_check smokes' environment: one device and the run's persistent compilation
  cache (JAX's environment variables; accelerator.py keeps it), so the second reuses what the first compiled."""
  return {**os.environ, "XLA_FLAGS": xla_flags_without_device_count(), "JAX_COMPILATION_CACHE_DIR": xla_cache,
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def test_accelerator_smoke_measures_every_figure(tmp_path, smoke_env):
  """`accelerator.py --smoke` on the CPU (one device): every figure gets a value and a verdict, nothing
  compiles inside a rollout after warm-up, TLT and plain RL steps get the same rewards, and a run in
  the same --out with other settings is refused before any work."""
  out = tmp_path / "out"
  run = lambda *args: subprocess.run([sys.executable, "accelerator.py", f"--out={out}", "--smoke", *args],
                                     cwd=EXPERIMENTS, env=smoke_env, capture_output=True, text=True,
                                     timeout=600)
  cached = lambda: set(os.listdir(smoke_env["JAX_COMPILATION_CACHE_DIR"]))
  before = cached()
  done = run()
  assert done.returncode == 0, done.stderr[-3000:]
  # The cache JAX_COMPILATION_CACHE_DIR names gets what it compiled (its target's programs, which no test
  # before it builds), none goes under --out.
  assert not (out / "xla_cache").exists() and cached() - before
  summary = json.loads((out / "summary.json").read_text())
  goals = summary["goals"]
  assert set(goals) == {"sd_batch1", "sd_up_to_16", "bandit", "rl_step", "compilations"}
  assert all(g["value"] is not None and isinstance(g["met"], bool) for g in goals.values()), goals
  assert goals["compilations"]["value"] == 0 and summary["rl"]["rewards_identical"]
  target = summary["target"]
  assert target["architecture"] == "Qwen2ForCausalLM" and target["vocab_size"] == 128 > target["tokenizer_size"]
  assert target["drafter"]["draft_vocab_size"] == 64 and target["drafter"]["eval_sequences"] == 1
  grid = json.loads((out / "grid.json").read_text())
  assert [(r["head"], r["batch_size"]) for r in grid] == [("reduced", 1), ("reduced", 2), ("full", 1)]
  steps = json.loads((out / "rl.json").read_text())["rows"]
  assert [r["rollout/compilations"] > 0 for r in steps] == [True, True, False, False]  # step 1 compiles
  for name in ("grid.csv", "bandit.csv", "rl_steps.csv", "sd_grid.png", "bandit.png", "rl_step.png"):
    assert (out / name).stat().st_size > 0, name
  assert "device: 1 x cpu" in done.stdout and all(f"{name}:" in done.stdout for name in goals)
  refused = run("--bandit_rows=3")
  assert refused.returncode == 1 and refused.stderr.strip().splitlines()[-1] == (
      f"error: --out={out} holds a run with other settings (differing: bandit_rows; see its settings.json); "
      "choose another --out"), refused.stderr[-3000:]


def test_gpu_check_smoke_runs_every_part_and_continues(tmp_path, smoke_env):
  """`gpu_check.py --smoke` on the CPU: every part runs (or says why not) within its deadline, every goal
  gets a verdict, the results fit what a device run sends back (a few files, no folders), and a second
  run with the same --out skips what is done."""
  out, work = tmp_path / "out", tmp_path / "work"
  # Without the env part's run of the package (test_setup runs the same command).
  run = lambda: subprocess.run([sys.executable, "gpu_check.py", f"--out={out}", f"--work={work}", "--smoke",
                                "--nomain_smoke", "--budget_s=600", "--target=h100"], cwd=EXPERIMENTS, env=smoke_env,
                               capture_output=True, text=True, timeout=900)
  done = run()
  assert done.returncode == 0, done.stderr[-3000:]
  summary = json.loads((out / "summary.json").read_text())
  parts = summary["parts"]
  assert list(parts) == ["compile", "env", "figures", "parity", "kernels"]
  assert all(p["status"] == "done" and p["seconds"] <= p["deadline_s"] for p in parts.values()), parts
  assert "bandit and rl not run" in parts["figures"]["reason"]  # test_accelerator_smoke runs them
  compiled = parts["compile"]["result"]  # accelerator.py's smoke config for an H100, by its compiler
  assert compiled["target"] == "h100" and compiled["failed"] == [] and compiled["fits"]
  assert compiled["roofline"]["steps"]["1/1"]["ms"] > 0
  beside = summary["roofline_vs_measured"]["1"]  # batch 1: the roofline's decode step beside the grid's
  assert beside["decode_ms"]["roofline"] > 0 and beside["decode_ms"]["measured"] > 0
  assert all(v["measured"] > 0 for v in beside["verify_over_decode"].values()) and beside["verify_over_decode"]
  env_result = parts["env"]["result"]
  assert "main_smoke" not in env_result and env_result["device"]["backend"] == "cpu"
  assert all(r["ok"] for r in env_result["requirements"]) and env_result["pycosat_solves"]
  runs = parts["parity"]["result"]["runs"]
  assert [(r["attention"], "skipped" in r) for r in runs] == [("xla", False), ("pallas_gpu", False), ("triton", True)]
  goals = summary["goals"]
  assert list(goals) == ["kernel_accuracy", "decode_bandwidth", "verify_16", "engine_parity", "sd_batch1",
                         "sd_up_to_16", "bandit", "rl_step", "compilations", "compiles"]
  status = {name: g["status"] for name, g in goals.items()}
  assert set(status.values()) <= {"MET", "NOT MET", "NOT RUN"}
  assert [status[n] for n in ("kernel_accuracy", "engine_parity", "compilations", "compiles")] == ["MET"] * 4, goals
  assert goals["sd_batch1"]["value"] is not None and status["bandit"] == status["rl_step"] == "NOT RUN"
  assert status["decode_bandwidth"] == "NOT RUN"  # no peak bandwidth for a CPU
  plan = parts["figures"]["result"]["plan"]  # the full-size plan on an H100, sized to the budget left
  assert plan["sizes"]["sft_steps"] >= 20 and plan["fits"]["grid_b1"] in ("fits", "does not fit")
  files = sorted(f.name for f in out.iterdir())
  assert files == sorted(summary["files"]) and len(files) <= 8 and all(f.is_file() for f in out.iterdir())
  assert {"summary.json", "summary.txt", "details.tar.gz", "kernels.png", "sd_grid.png"} <= set(files)
  assert "env: main smoke not run" in done.stdout and "roofline of the compile part" in done.stdout
  assert "b=1, roofline / measured: decode " in done.stdout
  with tarfile.open(out / "details.tar.gz") as tar:
    names = set(tar.getnames())
  assert {"env/installed.txt", "kernels/result.json", "parity/reference.json", "figures/plan.json"} <= names
  assert all(f"{g['status']:<8} {name}" in done.stdout for name, g in goals.items())
  again = run()
  assert again.returncode == 0, again.stderr[-3000:]
  assert all(f"[gpu_check] {name}: done before, skipped" in again.stdout for name in parts)
  assert json.loads((out / "summary.json").read_text())["parts"] == parts


PLAN = """
import json, sys
sys.path.insert(0, "..")
import gpu_plan
from configs import accelerator
c = accelerator.get_config()
print(json.dumps({"plans": {str(s): gpu_plan.plan(c, s, {}) for s in (200, 250, 300, 540, 800, 1200)},
                  "after_b1": gpu_plan.plan(c, 300, {"target": True, "grid_b1": True}),
                  "sft_steps": c.sft.steps}))
"""


def test_gpu_check_plans_sd_at_batch_1_into_the_time_it_has():
  """The figures plan (estimates from an H200 run): with less time than the target's full training and SD vs
  plain at batch 1 (the headline) take, the training is cut short so that batch 1 fits; with less still, the
  target alone; with more, all its training and more batch sizes, the bandit and the RL step keeping their
  time from the grid's later cells where they fit after its first two. The grid's cells fit in
  accelerator.py's order (none after one that does not), the full head's after them; what is done is left out."""
  run = subprocess.run([sys.executable, "-c", PLAN], cwd=EXPERIMENTS, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]
  got = json.loads(run.stdout)
  plans = got["plans"]
  for p in plans.values():
    fits = [p["fits"][f"grid_b{b}"] for b in p["sizes"]["batch_sizes"]] + [p["fits"]["grid_full"]]
    assert fits == sorted(fits, key=lambda v: v != "fits"), p["fits"]  # "fits" first, then none
  small, short, check = plans["200"], plans["250"], plans["300"]
  assert small["parts"] == [] and small["enough_for_target"]
  sft = [plans[s]["sizes"]["sft_steps"] for s in ("200", "250", "300", "1200")]
  assert sft[0] < sft[1] < sft[2] == sft[3] == got["sft_steps"]  # cut short below 300 s
  for p in (short, check):
    assert p["parts"] == ["grid"] and p["fits"]["grid_b1"] == "fits" and p["sizes"]["batch_sizes"] == [1]
  assert plans["540"]["sizes"]["batch_sizes"][:2] == [1, 16] and plans["540"]["fits"]["bandit"] == "does not fit"
  assert plans["800"]["sizes"]["batch_sizes"] == [1, 16] and plans["800"]["parts"] == ["grid", "bandit", "rl"]
  assert plans["1200"]["fits"]["bandit"] == "fits" and len(plans["1200"]["sizes"]["batch_sizes"]) > 2
  assert got["after_b1"]["fits"]["grid_b1"] == "done" and got["after_b1"]["target_s"] == 0
  assert "rl" in got["after_b1"]["parts"]


def test_seeds_runs_the_config_once_per_seed_and_reports_the_spread(tmp_path, xla_cache):
  """`seeds.py` on the tiny smoke config with evaluations: a run per seed, each its own summary and
  metrics, the ranges over seeds and a figure with a line per seed; a second call keeps the runs.
  The seeds share the run's compilation cache (the second seed compiles nothing new)."""
  out = tmp_path / "seeds"
  env = {**os.environ, "XLA_FLAGS": xla_flags_without_device_count()}
  run = lambda: subprocess.run([sys.executable, "seeds.py", "--seeds=0,1", f"--out={out}",
                                "--config=../configs/tiny.py:smoke", "--config.eval.every=1", "--config.eval.size=4",
                                "--config.rollout.speculative=False",  # seeds, not speculation: no drafter warm-up
                                f"--config.rollout.compilation_cache_dir={xla_cache}"], cwd=EXPERIMENTS, env=env,
                               capture_output=True, text=True, timeout=900)
  done = run()
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads((out / "seeds.json").read_text())
  assert [r["seed"] for r in result["runs"]] == [0, 1]
  assert all(r["steps"] == 1 and r["held_out"]["first"]["step"] == 0 for r in result["runs"])
  firsts = [r["held_out"]["first"]["reward"] for r in result["runs"]]
  assert result["held_out_first"] == {"min": min(firsts), "max": max(firsts), "mean": sum(firsts) / 2}
  assert (out / "seeds.png").stat().st_size > 0 and (out / "seed1" / "metrics.jsonl").is_file()
  again = run()
  assert again.returncode == 0 and "+ " not in again.stdout and json.loads((out / "seeds.json").read_text()) == result


def test_open_chat_requests_hold_out_other_seeds():
  """`chat_prompts.py --open` (`open_requests.py`): a seed's requests are distinct, any other seed's share
  none of seed 0's, and asking for more than a seed's part of the combinations is refused by number."""
  sys.path.insert(0, EXPERIMENTS)
  from open_requests import open_requests  # pylint: disable=import-outside-toplevel
  sys.path.remove(EXPERIMENTS)
  train, held_out = open_requests(256, 0), open_requests(39, 1)
  assert len(set(train)) == 256 and len(set(held_out)) == 39 and not set(train) & set(held_out)
  assert set(open_requests(12, 2)) <= set(held_out) and open_requests(12, 1) != open_requests(12, 2)
  with pytest.raises(ValueError, match="--size=40: --seed=1 draws from 39 open requests"):
    open_requests(40, 1)


def test_side_by_side_summary_says_whether_every_arm_sampled_alike():
  """end_to_end's summary: time ratios over the steps after the first, and `rewards_identical` only
  when every arm got the same rewards and response lengths at every step."""
  sys.path.insert(0, EXPERIMENTS)
  import side_by_side  # pylint: disable=import-outside-toplevel
  sys.path.remove(EXPERIMENTS)
  row = lambda arm, step, rollout_s, length: {
      "trainer": arm, "step": step, "reward/mean": 0.25 * step, "response_length/median": 40,
      "response_length/p90": 80, "response_length/max": length, "time/step_s": rollout_s + 10,
      "time/rollout_s": rollout_s, "rollout/accept_len": 0.0}
  rows = [row("tlt", 1, 30, 256), row("baseline", 1, 60, 256), row("tlt", 2, 5, 200), row("baseline", 2, 10, 200)]
  s = side_by_side.summary(rows, "baseline")
  assert s["rollout_time_ratio"] == {"tlt": 2.0, "baseline": 1.0} and s["step_time_ratio"]["tlt"] == 20 / 15
  assert s["rewards_identical"]
  rows[-1]["response_length/max"] = 201
  assert not side_by_side.summary(rows, "baseline")["rewards_identical"]


def test_bench_kernels_smoke_checks_every_implementation(tmp_path):
  """On CPU: the kernels in their interpreters (Triton's too: tests/conftest.py sets TRITON_INTERPRET=1)
  against the reference at R1-7B's heads; timings flagged meaningless; JSON, CSV, the plot and the xla
  path's optimized HLO written."""
  proc = subprocess.run([sys.executable, "bench_kernels.py", f"--out={tmp_path}", "--tree=8", "--filled=40"],
                        cwd=EXPERIMENTS, text=True, capture_output=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((tmp_path / "results.json").read_text())
  assert summary["smoke"] and (summary["heads"], summary["kv_heads"], summary["head_dim"]) == (28, 4, 128)
  results = summary["results"]
  assert [r["impl"] for r in results] == ["xla", "pallas_gpu", "pallas_tpu", "triton"]
  assert all(r["ok"] and r["max_abs_err"] < 1e-5 and r["timing"].startswith("meaningless") for r in results), results
  with open(tmp_path / "results.csv", encoding="utf-8") as f:
    assert len(list(csv.DictReader(f))) == len(results)
  assert (tmp_path / "bandwidth.png").stat().st_size > 0
  assert "while" in (tmp_path / "xla_hlo.txt").read_text()  # the blockwise walk over the cache


def test_bench_kernels_says_what_failed(tmp_path):
  """An implementation that fails (Triton's interpreter refuses bfloat16) is recorded, the rest goes on, exit 1."""
  run = lambda *flags: subprocess.run([sys.executable, "bench_kernels.py", f"--out={tmp_path}", "--tree=1",
                                       "--filled=16", *flags], cwd=EXPERIMENTS, text=True, capture_output=True,
                                      timeout=600)
  proc = run("--impls=xla,triton", "--dtype=bfloat16")
  assert proc.returncode == 1
  assert "error: 1 of 2 measurements failed or missed the reference (triton)" in proc.stderr, proc.stderr[-3000:]
  xla, triton = json.loads((tmp_path / "results.json").read_text())["results"]
  assert xla["ok"] and not triton["ok"] and "does not support bfloat16" in triton["error"]
  proc = run("--impls=xla,cuda")
  assert proc.returncode == 1 and proc.stderr.startswith("error: --impls: 'cuda' is not one of"), proc.stderr[-3000:]


def test_vs_trl_smoke_runs_both_sides_on_the_same_prompts(tmp_path, tiny_policy_dir, smoke_env):
  """`vs_trl.py` on configs/smollm2.py's smoke job (a tiny policy): tlt_jax's trainer and TRL's GRPOTrainer each
  run a step in a process of its own, TRL gets the same prompt tokens, and the summary holds both sides'
  phases, the update's phases, each phase's peak memory and the ratios."""
  out = tmp_path / "out"
  done = subprocess.run([sys.executable, "vs_trl.py", "--config=../configs/smollm2.py:smoke", "--steps=2",
                         f"--config.policy.path={tiny_policy_dir}", "--config.rl.dynamic_sampling=False",
                         f"--out={out}"], cwd=EXPERIMENTS, env=smoke_env,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  summary = json.loads((out / "summary.json").read_text())
  assert json.loads((out / "trl.json").read_text())["same_prompt_tokens"]
  assert set(summary["last_step"]) == {"tlt_jax", "trl"} and set(summary["trl_over_tlt_jax"]) == {
      "rollout_s", "reward_s", "old_logp_s", "update_s", "step_s"}
  phases = summary["tlt_jax_update_phases"]
  assert all(phases[k] > 0 for k in ("forward_s", "forward_backward_s", "optimizer_s", "forward_backward_temp_gb"))
  assert all(v > 0 for v in summary["peak_rss_gb"].values())
  # Each side's phases' own peaks (after the first step), at TRL's micro-batch of equal tokens (printed).
  assert set(summary["phase_peaks_gb"]["trl"]) == {"prepare", "update"}
  assert {"rollout", "rewards", "old_logp", "update"} <= set(summary["phase_peaks_gb"]["tlt_jax"])
  assert all(v > 0.1 for side in summary["phase_peaks_gb"].values() for v in side.values())
  assert re.search(r"TRL: \d+ samples a micro-batch \(per_device_train_batch_size; tlt_jax: ", done.stdout)


def test_objectives_runs_each_arm_and_compares_it_with_the_first(tmp_path, xla_cache):
  """`objectives.py` on the tiny smoke config: an arm's run each (CISPO's objective set), its last held-out
  reward against the first arm's paired over the same prompts, its step times, and a figure."""
  out = tmp_path / "objectives"
  env = {**os.environ, "XLA_FLAGS": xla_flags_without_device_count()}
  done = subprocess.run([sys.executable, "objectives.py", "--arms=default,cispo", f"--out={out}",
                         "--config=../configs/tiny.py:smoke", "--config.eval.every=1", "--config.eval.size=4",
                         "--config.steps=2", "--config.rollout.speculative=False",
                         f"--config.rollout.compilation_cache_dir={xla_cache}"], cwd=EXPERIMENTS, env=env,
                        capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads((out / "objectives.json").read_text())
  assert json.loads((out / "cispo" / "config.json").read_text())["rl.loss.kind"] == "cispo"
  cispo = result["compare"]["cispo"]
  assert cispo["vs_baseline_ci95"] >= 0 and cispo["step_s"] > 0 and "vs_baseline" not in result["compare"]["default"]
  assert (out / "objectives.png").stat().st_size > 0 and "cispo" in done.stdout
