"""Tests for tlt_jax/rl/scorer.py: scoring in worker processes (a user's file or module), failures, timeouts
and values that are no scores, the stop when too many calls fail, several functions summed as TRL sums them,
and workers that outlive a signal to the process group until the scorer stops them."""

import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from tlt_jax.rl import rewards, scorer

# A verl user's reward file, unchanged: it reads the data source and the extra info, returns a dict with more
# to log, raises on one sample, hangs on another; and functions that return what is no score.
USER_REWARD = textwrap.dedent("""
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
      if solution_str == "boom":
        raise RuntimeError("scorer exploded")
      if solution_str == "hang":
        time.sleep(60)
      if solution_str == "nan":
        return float("nan")
      if solution_str == "text":
        return "1.0"
      if solution_str == "none":
        return None
      if solution_str == "no score":
        return {"acc": 1.0}
      right = solution_str.strip() == ground_truth
      return {"score": float(right) * extra_info.get("weight", 1.0), "acc": float(right), "len": len(solution_str),
              "source_is_mine": float(data_source == "mine")}

    def has_answer(completions, **kwargs):
      return [None if c == "skip" else float(c.strip().isdigit()) for c in completions]

    def short_batch(solution_strs, **kwargs):
      return [1.0]

    def four(solution_str, **kwargs):
      return 4.0

    def crash(solution_str, **kwargs):
      if solution_str == "crash":
        import os
        os._exit(3)  # as a segfaulting extension would end the interpreter
      return 1.0
    """)


@pytest.fixture(scope="module")
def user_reward(tmp_path_factory):
  path = tmp_path_factory.mktemp("reward") / "my_reward.py"
  path.write_text(USER_REWARD)
  return lambda name="compute_score": f"{path}:{name}"


def _items(responses, truth="4"):
  return [rewards.Item("mine", r, truth, {"weight": 0.5}, f"train.jsonl:{i + 1}", "2 + 2?")
          for i, r in enumerate(responses)]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_users_reward_file_scores_and_logs_its_extra_keys(user_reward, workers):
  s = scorer.Scorer(workers=workers, timeout_s=20)
  per_function = []
  try:
    scores, stats = s.score(user_reward(), _items(["4", "5", "4 "]), per_function=per_function)
  finally:
    s.close()
  np.testing.assert_array_equal(scores, [0.5, 0.0, 0.5])
  (values, weights), = per_function  # one function, weight 1: its values are the scores
  np.testing.assert_array_equal(values, [[0.5, 0.0, 0.5]])
  np.testing.assert_array_equal(weights, [1.0])
  assert stats == {"mean": pytest.approx(1 / 3), "failures": 0.0, "timeouts": 0.0, "acc": pytest.approx(2 / 3),
                   "len": pytest.approx(4 / 3), "source_is_mine": 1.0}


def test_a_worker_of_the_trainer_imports_its_main_module_without_jax(tmp_path):
  """A spawned worker imports the program's main module again (`python -m tlt_jax.main`'s, as
  multiprocessing prepares it): cheap, seconds of CPU for each of a run's workers otherwise."""
  (tmp_path / "probe.py").write_text(textwrap.dedent("""
      import sys
      def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        main = sys.modules.get("__mp_main__")
        return {"score": float("jax" in sys.modules), "main": float(getattr(main, "__spec__", None) is not None
                                                                     and main.__spec__.name == "tlt_jax.main")}
      """))
  code = ("import importlib.util, sys; from tlt_jax.rl import rewards, scorer; "
          "sys.modules['__main__'].__spec__ = importlib.util.find_spec('tlt_jax.main'); "
          "s = scorer.Scorer(workers=1, timeout_s=60); "
          f"scores, stats = s.score({str(tmp_path / 'probe.py')!r} + ':compute_score', "
          "[rewards.Item('mine', '4', '4', {})]); s.close(); print(scores.tolist(), stats['main'])")
  run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]
  assert run.stdout.split() == ["[0.0]", "1.0"], run.stdout  # jax not loaded; the main module was


def test_a_module_reward(tmp_path, monkeypatch):
  (tmp_path / "my_rewards.py").write_text(USER_REWARD)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))  # the workers' import path
  s = scorer.Scorer(workers=1, timeout_s=20)
  try:
    scores, _ = s.score("my_rewards:compute_score", _items(["4"]))
  finally:
    s.close()
  assert scores.tolist() == [0.5]


def test_a_raising_or_hanging_reward_scores_0_and_is_counted_once_logged(user_reward, caplog):
  """The hung worker is replaced: the next batch scores as usual."""
  s = scorer.Scorer(workers=2, timeout_s=3, max_failures=0.5)
  try:
    with caplog.at_level(logging.WARNING):
      scores, stats = s.score(user_reward(), _items(["4", "boom", "hang", "4"]))
    np.testing.assert_array_equal(scores, [0.5, 0.0, 0.0, 0.5])
    assert stats["failures"] == 1 and stats["timeouts"] == 1
    assert "failed on sample 1 (train.jsonl:2): RuntimeError: scorer exploded" in caplog.text
    assert "timed out on sample 2 (train.jsonl:3)" in caplog.text
    assert s.score(user_reward(), _items(["4"]))[0].tolist() == [0.5]
  finally:
    s.close()


def test_a_worker_that_dies_is_a_failed_call_and_is_replaced(user_reward):
  s = scorer.Scorer(workers=2, timeout_s=20, max_failures=0.5)
  try:
    scores, stats = s.score(user_reward("crash"), _items(["4", "crash", "4", "4"]))
    assert scores.tolist() == [1.0, 0.0, 1.0, 1.0] and stats["failures"] == 1
    assert s.score(user_reward("crash"), _items(["4"] * 4))[0].tolist() == [1.0] * 4
  finally:
    s.close()


@pytest.mark.parametrize("max_failures, responses, stops", [
    (0.1, ["4"] * 9 + ["boom"], False), (0.1, ["4"] * 8 + ["boom"] * 2, True), (0.0, ["4"] * 9 + ["boom"], True),
    (1.0, ["boom"] * 3, True), (1.0, ["4", "boom", "boom"], False)])
def test_more_failures_than_the_limit_or_all_stop_naming_the_first(user_reward, max_failures, responses, stops):
  """A step whose rewards failed has nothing to learn from: more failed calls than `max_failures` of them,
  or all of them, is an error naming the reward, the count and the first exception."""
  s = scorer.Scorer(workers=0, max_failures=max_failures)
  if not stops:
    assert s.score(user_reward(), _items(responses))[1]["failures"] == responses.count("boom")
    return
  first = responses.index("boom")
  with pytest.raises(rewards.RewardError, match=rf"reward '.*my_reward.py:compute_score' failed on "
                                                rf"{responses.count('boom')} of {len(responses)} samples in step 3 "
                                                rf"\(.*\), .* the first, sample {first} \(train.jsonl:{first + 1}\): "
                                                "RuntimeError: scorer exploded"):
    s.score(user_reward(), _items(responses), what="in step 3")


@pytest.mark.parametrize("response, what", [("nan", "nan"), ("text", "'1.0'"), ("none", "None"),
                                            ("no score", "a dict without 'score'")])
def test_a_score_that_is_no_number_is_an_error_naming_the_row(user_reward, response, what):
  with pytest.raises(rewards.RewardError, match=f"returned {what} for sample 1 \\(train.jsonl:2\\)"):
    scorer.Scorer(workers=0).score(user_reward(), _items(["4", response]))


def test_a_batch_of_the_wrong_length_is_an_error(user_reward):
  with pytest.raises(rewards.RewardError, match="returned 1 values for a batch of 2: a batch function returns one"):
    scorer.Scorer(workers=0).score(user_reward("short_batch"), _items(["4", "5"]))


def test_a_scorer_error_on_a_bad_entry_is_a_failure():
  # A missing or unknown reasoning-gym entry makes the scorer raise: a failure, not a crash.
  entry = {"question": "?", "answer": "1", "metadata": {"source_dataset": "no_such_task"}}
  items = [rewards.Item("chain_sum", "Answer: 1", "1", extra) for extra in ({"entry": entry}, {}, {"entry": entry})]
  items.append(rewards.Item("openai/gsm8k", "#### 1", "1", {}))
  scores, stats = scorer.Scorer(workers=0, max_failures=1.0).score("auto", items)
  np.testing.assert_array_equal(scores, [0.0, 0.0, 0.0, 1.0])
  assert stats["failures"] == 3 and stats["formatted"] == 1.0


@pytest.mark.parametrize("workers", [0, 2])
def test_several_functions_are_summed_with_their_weights_as_trl_sums_them(user_reward, workers):
  """TRL's rule: rewards_per_func * weights, NaN (None) left out of the sum; each function's mean over the
  samples it applies to is logged under its name."""
  responses = ["4", "five", "skip", "44"]
  reward = rewards.Reward.of((user_reward(), user_reward("has_answer"), user_reward("four")), (1.0, 0.5, -0.25))
  s = scorer.Scorer(workers=workers, timeout_s=20)
  try:
    scores, stats = s.score(reward, _items(responses))
  finally:
    s.close()
  per_func = np.array([[0.5, 0.0, 0.0, 0.0], [1.0, 0.0, math.nan, 1.0], [4.0] * 4])
  np.testing.assert_allclose(scores, np.nansum(per_func * np.array([[1.0], [0.5], [-0.25]]), axis=0), rtol=1e-6)
  assert stats["compute_score"] == pytest.approx(0.125) and stats["has_answer"] == pytest.approx(2 / 3)
  assert stats["four"] == 4.0 and stats["mean"] == pytest.approx(float(scores.mean()))


def test_a_sample_no_function_applies_to_scores_nan_out_of_the_mean_as_in_trl(user_reward):
  """Every function returned None: NaN (TRL marks the row unscorable), left out of the logged mean."""
  s = scorer.Scorer(workers=0)
  scores, stats = s.score(user_reward("has_answer"), _items(["4", "skip", "five"]))
  np.testing.assert_array_equal(scores, [1.0, np.nan, 0.0])
  assert stats["mean"] == 0.5


def test_workers_outlive_a_signal_to_the_process_group_until_closed(user_reward, tmp_path):
  """A Ctrl-C (SIGINT) or a scheduler's SIGTERM reaches every process of the group: the workers ignore it, so
  the trainer can finish its step's scoring; close() then stops them at once, leaving none behind."""
  code = textwrap.dedent(f"""
      import multiprocessing, os, signal, sys, time
      from tlt_jax.rl import rewards, scorer
      got = []
      for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda n, _: got.append(n))
      s = scorer.Scorer(workers=2, timeout_s=20)
      items = [rewards.Item("mine", "4", "4", {{}})] * 4
      s.score({user_reward()!r}, items)
      print("ready", flush=True)
      while len(got) < 2:
        time.sleep(0.05)
      print(s.score({user_reward()!r}, items)[0].tolist(), flush=True)
      start = time.monotonic()
      s.close()
      print(round(time.monotonic() - start, 1), len(multiprocessing.active_children()), flush=True)
      """)
  proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)
  try:
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-3000:]
    for signum in (signal.SIGINT, signal.SIGTERM):
      os.killpg(proc.pid, signum)
      time.sleep(0.3)
    out, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == 0, err[-3000:]
  scores, (close_s, left) = out.split("\n")[0], out.split("\n")[1].split()
  assert scores == "[1.0, 1.0, 1.0, 1.0]" and float(close_s) < 2 and left == "0"
