"""report: the closing summary leads with the held-out evaluation and its noise; the run's figure."""

import builtins
import math

import numpy as np
import pytest

from tlt_jax import metrics, report


def _records(first_prompts, last_prompts, train=(0.1, 0.3, 0.2, 0.4)):
  evaluation = lambda step, p: {"step": step, "eval/reward": float(np.mean(p)), "eval/reward_ci95": metrics.ci95(p),
                                "eval/prompt_rewards": list(p), "eval/answered": 0.5 + step / 10,
                                "eval/reward_failures": float(step == 2)}
  steps = [{"step": i + 1, "reward/mean": r, "rollout/tokens_per_s": 100.0 * (i + 1), "time/rollout_s": 2.0,
            "time/step_s": 3.0, "rollout/tail_share": 0.5, "rollout/sd_share": 0.2 * (i % 2),
            "rollout/accept_len": 2.0 + i, "rollout/compilations": 7 if i == 0 else 0, "drafter/version": i + 1,
            "response_length/median": 20, "response_length/p90": 60, "train/updates": 2 if i else 0,
            "reward/failures": float(i == 3), "reward/timeouts": float(i == 2)} for i, r in enumerate(train)]
  return [evaluation(0, first_prompts), *steps[:2], evaluation(2, first_prompts), *steps[2:],
          evaluation(len(train), last_prompts)]


def test_ci95_is_the_normal_interval_over_independent_units():
  assert metrics.ci95([0.0, 1.0, 0.0, 1.0]) == pytest.approx(1.96 * np.std([0, 1, 0, 1], ddof=1) / 2)
  assert metrics.ci95([0.3]) == 0.0
  assert metrics.group_means([1.0, 0.0, 0.5, 0.5, 1.0], [7, 7, 3, 3, 9]) == [0.5, 0.5, 1.0]  # groups 3, 7, 9


def test_the_change_is_judged_against_its_paired_interval():
  rng = np.random.default_rng(0)
  first = rng.uniform(0, 1, 64)  # prompts of very different difficulty: each evaluation's own interval is wide
  last = np.clip(first + 0.05 + rng.normal(0, 0.02, 64), 0, 1)  # every prompt a little better
  h = report.summary(_records(first, last), "nowhere")["held_out"]
  assert h["first"]["step"] == 0 and h["last"]["step"] == 4 and h["evaluations"] == 3
  assert h["change"] == pytest.approx(np.mean(last) - np.mean(first))
  assert h["change_ci95"] == pytest.approx(metrics.ci95(last - first))
  assert h["change_ci95"] < h["change"] < h["first"]["ci95"]  # within each evaluation's noise, yet clearly up
  assert h["verdict"] == "up" and h["change_interval"] == "paired over 64 prompts"
  assert report.summary(_records(last, first), "nowhere")["held_out"]["verdict"] == "down"
  noisy = np.clip(first + rng.normal(0, 0.3, 64), 0, 1)
  assert report.summary(_records(first, noisy), "nowhere")["held_out"]["verdict"] == "within noise"


def test_a_prompt_with_nothing_scorable_leaves_the_pairs_and_the_rest_stay_paired():
  """An evaluation lists every prompt in order, None where no response could be scored (every reward function
  returned None): the pairs are the prompts scorable both times, not shifted by the missing one."""
  records = _records([0.2, 0.4, 0.6], [0.3, 0.5, 0.7])
  records[-1]["eval/prompt_rewards"] = [0.3, None, 0.7]
  h = report.held_out(records)
  assert h["change_interval"] == "paired over 2 prompts" and h["change_ci95"] == pytest.approx(0.0, abs=1e-9)


def test_without_per_prompt_rewards_the_two_intervals_combine():
  records = _records([0.0, 1.0], [1.0, 1.0])
  for r in records:
    r.pop("eval/prompt_rewards", None)
  h = report.held_out(records)
  assert h["change_ci95"] == pytest.approx(math.hypot(records[0]["eval/reward_ci95"], records[-1]["eval/reward_ci95"]))
  assert h["change_interval"] == "the two evaluations' intervals combined"


def test_summary_leads_with_the_held_out_reward_then_the_rollout_then_the_outputs(tmp_path):
  (tmp_path / "metrics.jsonl").write_text("")
  s = report.summary(_records([0.1, 0.2, 0.3], [0.2, 0.3, 0.5]), str(tmp_path), wall_s=90)
  r = s["rollout"]
  # Steps after the first (it compiles): tokens/s 200..400, acceptance over the steps that speculated (step 2, 4).
  assert r["tokens_per_s"] == pytest.approx(300.0) and r["accept_len"] == pytest.approx(4.0)
  assert r["compilations_after_first_step"] == 0 and r["drafter_version"] == 4 and r["tail_share"] == 0.5
  assert s["training_reward"] == {"first_steps": pytest.approx(0.2), "last_steps": pytest.approx(0.3), "window": 2}
  assert s["outputs"] == {"metrics": str(tmp_path / "metrics.jsonl")}  # only what exists
  lines = report.text(s).splitlines()
  assert lines[0] == "RL: 4 steps (1.5 min in this process)"
  assert lines[1].startswith("  held-out reward (95% interval): 0.200 +- ") and "at step 0 -> 0.333 +- " in lines[1]
  assert lines[2].startswith("    change +0.133 +- ") and lines[2].endswith("(paired over 3 prompts): up")
  assert lines[3] == "  held-out responses with an answer line: 50% -> 90%"
  assert lines[4].startswith("  training reward, first / last 2 steps: 0.200 / 0.300")
  assert s["training"] == {"reward_failures": 2, "eval_reward_failures": 1, "steps_without_update": 1, "steps": 4}
  assert lines[5] == ("  reward calls failed: 2 in the steps, 1 in the evaluations; steps without a policy update: 1 "
                      "of 4")
  assert "NEVER UPDATED" not in report.text(s)
  records = _records([0.1, 0.2, 0.3], [0.2, 0.3, 0.5])
  never = report.text(report.summary([{**r, "train/updates": 0} for r in records], str(tmp_path))).splitlines()
  assert never[6] == ("  THE POLICY WAS NEVER UPDATED: no step had a group whose rewards differed (or every update was "
                      "skipped); it is the policy the run started from")
  assert lines[6] == ("rollout (steps after the first): 300 tokens/s, tail 50% of decode time, acceptance 4.00 "
                      "tokens per verify, drafter v4")
  assert lines[7:] == ["outputs:", f"  metrics:     {tmp_path / 'metrics.jsonl'}"]
  no_eval = [r for r in _records([0.1], [0.2]) if "eval/reward" not in r]
  assert "  no held-out evaluation (config.eval.every=0)" in report.text(report.summary(no_eval, str(tmp_path)))


def test_figure_is_a_png_and_without_matplotlib_one_line_instead(tmp_path, monkeypatch):
  records = _records([0.1, 0.2], [0.3, 0.4])
  plain = [{k: v for k, v in r.items() if not k.startswith("rollout/sd")} for r in records]
  path = report.figure({"TLT": records, "plain": plain}, str(tmp_path / "run.png"))
  assert path == str(tmp_path / "run.png") and (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  real_import = builtins.__import__

  def no_matplotlib(name, *args, **kwargs):
    if name.startswith("matplotlib"):
      raise ImportError(name)
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", no_matplotlib)
  warnings = []
  monkeypatch.setattr(report.logging, "warning", lambda msg, *a: warnings.append(msg % a))
  assert report.figure({"TLT": records}, str(tmp_path / "other.png")) is None
  assert warnings == ["no figure of the run: matplotlib is not installed (pip install matplotlib)"]
  assert not (tmp_path / "other.png").exists()
