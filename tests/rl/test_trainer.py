"""The RL loop: a step trains, 2 steps + stop + resume to 4 equals 4 steps straight, a TLT step
trains the drafter, suffix drafts need none, and non-finite updates are skipped until too many in a row stop the run."""

import concurrent.futures
import inspect
import os

import jax
import numpy as np
import pytest
from flax import nnx

from tests.conftest import float_order_mismatches, tiny_rl_config
from tlt_jax import metrics
from tlt_jax.models import hf, lora
from tlt_jax.rl import bootstrap, builders, evaluation, grpo
from tlt_jax.rl import tokenizer as tokenizer_lib
from tlt_jax.rl.trainer import NonFiniteUpdates, Trainer
from tlt_jax.rollout.tools import Turn, Turns


def _timing(key: str) -> bool:
  """Timing figures, peak memory and what compiled (a resumed process compiles in its first step) differ
  between runs; everything else must not."""
  return key.endswith(("_s", "_share")) or key.startswith(("time/", "memory/")) or key == "rollout/compilations"


def _run(workdir, steps, policy_dir, cache_dir, **overrides):
  c = tiny_rl_config(workdir, steps, cache_dir)
  c.policy.path = policy_dir
  c.update_from_flattened_dict(overrides)
  trainer = Trainer(c, *bootstrap.load(c), devices=jax.devices()[:2])  # the plain engine data-parallel over 2 devices
  try:
    trainer.run()
    return trainer.actor.params
  finally:
    trainer.close()


def test_resume_continues_exactly(tmp_path, tiny_policy_dir, xla_cache):
  policy_dir, cache = tiny_policy_dir, xla_cache
  straight = _run(tmp_path / "straight", 4, policy_dir, cache)
  _run(tmp_path / "resumed", 2, policy_dir, cache)
  resumed = _run(tmp_path / "resumed", 4, policy_dir, cache)

  same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), straight, resumed)
  assert all(jax.tree.leaves(same))
  a = metrics.read(str(tmp_path / "straight" / "metrics.jsonl"))
  b = metrics.read(str(tmp_path / "resumed" / "metrics.jsonl"))
  assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2, 3, 4]
  strip = lambda r: {k: v for k, v in r.items() if not _timing(k)}
  assert [strip(r) for r in a] == [strip(r) for r in b]
  # Each step's responses as text (all 8 here: 2 prompts x 4 samples), the same after the resume.
  texts = metrics.read(str(tmp_path / "straight" / "completions.jsonl"))
  assert texts == metrics.read(str(tmp_path / "resumed" / "completions.jsonl"))
  assert [(r["step"], r["prompt"], r["sample"]) for r in texts] == [
      (step, p, s) for step in (1, 2, 3, 4) for p in (0, 1) for s in range(4)]
  for r in a[1:]:
    rows = [t for t in texts if t["step"] == r["step"]]
    assert np.mean([t["reward"] for t in rows]) == pytest.approx(r["reward/mean"])
    assert np.median([t["length"] for t in rows]) == r["response_length/median"]
  assert all(t["prompt_text"].startswith("Calculate") and t["finish_reason"] in ("stop", "length") for t in texts)
  # Held-out evaluations before the first step and every 2 steps, identical after the resume.
  assert [r["step"] for r in a if "eval/reward" in r] == [0, 2, 4] and set(a[0]) == {"step", "eval/reward",
      "eval/reward_ci95", "eval/prompt_rewards", "eval/accuracy", "eval/pass@1", "eval/pass@2", "eval/answered",
      "eval/response_length", "eval/reward_failures", "time/eval_s", "memory/eval_gb"}
  # The interval is over the held-out prompts' means (3 prompts: `tiny_rl_config`'s eval.size).
  assert len(a[0]["eval/prompt_rewards"]) == 3 and a[0]["eval/reward"] == pytest.approx(
      np.mean(a[0]["eval/prompt_rewards"]), abs=1e-4)
  assert a[0]["eval/reward_ci95"] == pytest.approx(metrics.ci95(a[0]["eval/prompt_rewards"]), abs=1e-3)
  a = a[1:]
  # The policy did train: rewards varied in some groups, so there were gradients and the parameters moved.
  assert all(r["train/updates"] == 2 for r in a) and any(r["train/grad_norm"] > 0 for r in a)
  assert not any(k.startswith("mismatch/") for r in a for k in r)  # float32: the rollout's old log-probs
  initial = nnx.state(hf.from_pretrained(policy_dir))
  moved = jax.tree.map(lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y)).max()), initial, straight)
  assert max(jax.tree.leaves(moved)) > 1e-3
  assert os.path.isdir(tmp_path / "straight" / "tensorboard")
  exported = nnx.state(hf.from_pretrained(str(tmp_path / "straight" / "export" / "policy")))
  assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), exported, straight)))
  # The checkpoints hold the scanned form's stacked layers: the unrolled form refuses them, naming the key.
  c = tiny_rl_config(tmp_path / "straight", 4, cache)
  c.policy.path, c.policy.scan_layers = policy_dir, False
  with pytest.raises(ValueError, match=r"layers scanned; resume it with --config.policy.scan_layers=True"):
    Trainer(c, *bootstrap.load(c), devices=jax.devices()[:2])


def test_a_lora_run_trains_its_adapters_resumes_exactly_and_exports_them_for_peft(tmp_path, tiny_policy_dir,
                                                                                   xla_cache):
  lora_run = {"policy.lora.rank": 4, "rl.optimizer.learning_rate": 5e-2, "eval.every": 0}
  straight = _run(tmp_path / "straight", 2, tiny_policy_dir, xla_cache, **lora_run)
  _run(tmp_path / "resumed", 1, tiny_policy_dir, xla_cache, **lora_run)
  resumed = _run(tmp_path / "resumed", 2, tiny_policy_dir, xla_cache, **lora_run)
  assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), straight, resumed)))
  strip = lambda run: [{k: v for k, v in r.items() if not _timing(k)} for r in metrics.read(str(tmp_path / run /
                                                                                                  "metrics.jsonl"))]
  assert strip("straight") == strip("resumed") and all(r["train/updates"] == 2 for r in strip("straight"))
  # The adapters trained (B moved from 0); the export holds them in PEFT's format and the merged policy.
  adapted = hf.from_pretrained(tiny_policy_dir)
  lora.load_peft(adapted, str(tmp_path / "straight" / "export" / "adapter"))
  exported = nnx.state(adapted, nnx.LoRAParam)
  assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), exported, straight)))
  assert max(float(np.abs(b).max()) for b in jax.tree.leaves(straight)) > 1e-3
  merged = nnx.state(hf.from_pretrained(str(tmp_path / "straight" / "export" / "policy")))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), merged, nnx.state(lora.merged(adapted)))
  # Resuming with another rank, or on other base weights, is refused by name.
  c = tiny_rl_config(tmp_path / "straight", 2, xla_cache)
  c.policy.path = tiny_policy_dir
  with pytest.raises(ValueError, match=r"it holds LoRA adapters of rank 4; resume it with --config.policy.lora.rank=4"):
    Trainer(c, *bootstrap.load(c), devices=jax.devices()[:2])
  other = hf.from_pretrained(tiny_policy_dir)
  nnx.update(other, jax.tree.map(lambda x: x * 1.01, nnx.state(other)))
  hf.save_pretrained(other, str(tmp_path / "other"), tokenizer=hf.load_tokenizer(tiny_policy_dir))
  c.policy.path, c.policy.lora.rank = str(tmp_path / "other"), 4
  with pytest.raises(ValueError, match=r"its LoRA adapters were trained on other base weights: .* \(sha256 "
                     r"[0-9a-f]{12}\), not config.policy.path's \(sha256 [0-9a-f]{12}\)"):
    Trainer(c, *bootstrap.load(c), devices=jax.devices()[:2])


def test_the_rollouts_old_log_probs_update_as_the_recomputed_ones(tmp_path, tiny_policy_dir, xla_cache):
  """In float32 (`rl.old_logp="auto"`) the updates take the rollout's log-probs as the ratio's old ones,
  without a forward pass: they are the trainer's own up to float32 rounding (other kernels, batching and
  order of sums), so the updates are the recomputing run's up to rounding too."""
  runs = {}
  for old in ("auto", "recompute"):
    params = _run(tmp_path / old, 1, tiny_policy_dir, xla_cache, **{"rl.old_logp": old, "eval.every": 0})
    records = metrics.read(str(tmp_path / old / "metrics.jsonl"))
    runs[old] = params, records
  recomputed = runs["recompute"][1][0]
  print("float32 mismatch:", recomputed["mismatch/logp_abs_diff"], recomputed["mismatch/k3_kl"])
  assert recomputed["mismatch/logp_abs_diff"] < 1e-5 and abs(recomputed["mismatch/k3_kl"]) < 1e-9
  assert recomputed["train/updates"] == 2 and not any(k.startswith("mismatch/") for k in runs["auto"][1][0])
  stats = lambda run: (run[0], [{"loss": r["train/loss"], "grad_norm": r["train/grad_norm"]} for r in run[1]])
  initial = nnx.state(hf.from_pretrained(tiny_policy_dir))
  assert not float_order_mismatches(initial, stats(runs["recompute"]), stats(runs["auto"]))


def test_tlt_step_trains_the_drafter_on_idle_groups_and_checkpoints_it(tmp_path, tiny_policy_dir, xla_cache,
                                                                       monkeypatch):
  sampled = []
  sample = bootstrap.warmup.sample
  monkeypatch.setattr(bootstrap.warmup, "sample", lambda *a, **k: sampled.append((a, k)) or sample(*a, **k))
  policy_dir = tiny_policy_dir
  c = tiny_rl_config(tmp_path / "tlt", 2, xla_cache)
  c.policy.path = policy_dir
  c.rollout.speculative = True
  c.rollout.groups = 2
  c.rollout.strategies = ("2_1_3",)
  c.rollout.engine.sd_max_batch = 4
  c.drafter.path = str(tmp_path / "drafter")  # absent: distilled on the policy's own samples, then saved there
  c.drafter.distill.steps, c.drafter.distill.prompts = 4, 8
  c.drafter.distill.row_len = c.drafter.trainer.row_len = 64
  c.drafter.trainer.rows_per_device = 1
  c.drafter.trainer.warmup_steps = 1
  c.checkpoint.every = 1
  trainer = Trainer(c, *bootstrap.load(c), devices=jax.devices()[:2])
  try:
    records = trainer.run()
    version = trainer.rollout.drafter_trainer.version
    drafter = trainer.rollout.drafter_trainer.state_dict()[0]["params"]
  finally:
    trainer.close()
  # The warm-up sampled the policy's responses to the first 8 training prompts as the rollout samples.
  (args, kwargs), = sampled
  assert len(args[1]) == 8 and kwargs["temperature"] == c.rollout.sampling.temperature
  assert kwargs["max_new_tokens"] == c.rollout.sampling.max_new_tokens and kwargs["num_samples"] == 1
  assert version >= 1 and records[-1]["drafter/version"] == version
  assert all(r["spot/groups"] == 2 for r in records)
  # The first rollout compiles the group engines and the drafter trainer; the next one nothing.
  assert records[0]["rollout/compilations"] > 0 and records[1]["rollout/compilations"] == 0
  assert os.path.exists(tmp_path / "tlt" / "export" / "drafter" / "model.safetensors")
  # A restart restores the drafter and the bandits with the policy.
  c.steps = 2
  again = Trainer(c, *bootstrap.load(c), devices=jax.devices()[:2])
  try:
    assert again.step == 2 and again.rollout.drafter_trainer.version == version
    restored = again.rollout.drafter_trainer.state_dict()[0]["params"]
    same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), restored, drafter)
    assert all(jax.tree.leaves(same))
    assert all(e.bandit is not None for e in again.rollout.engines)
  finally:
    again.close()


def test_suffix_drafts_need_no_drafter_and_their_bandit_resumes(tmp_path, tiny_policy_dir, xla_cache):
  """rollout.drafter='suffix': no drafter is loaded or warmed up; the engine (data-parallel over 2
  devices) speculates in its tail with suffix arms a bandit picks, checkpointed and restored."""
  c = tiny_rl_config(tmp_path / "suffix", 1, xla_cache)
  c.policy.path = tiny_policy_dir
  c.rollout.speculative = True
  c.rollout.drafter = "suffix"
  c.rollout.strategies = ("2_1_3", "s3_2_5")  # the first reads as s2_1_3
  c.rollout.engine.sd_max_batch = 8  # every row: the random policy's rows all run to the budget, no tail
  c.rollout.engine.suffix_bank_len = 256
  c.checkpoint.every = 1
  c.eval.every = 0
  trainer = Trainer(c, *bootstrap.load(c), devices=jax.devices()[:2])
  try:
    assert trainer.rollout.drafter_model() is None
    assert [s.name for s in trainer.rollout.engines[0].config.strategies] == ["s2_1_3", "s3_2_5"]
    record = trainer.run()[-1]
    bandit = trainer.rollout.engines[0].bandit.state_dict()
  finally:
    trainer.close()
  assert not os.path.exists(tmp_path / "suffix" / "drafter")
  assert record["rollout/verify_passes"] > 0 and any("/arm_s" in key for key in record)
  again = Trainer(c, *bootstrap.load(c), devices=jax.devices()[:2])
  try:
    assert again.step == 1 and again.rollout.engines[0].bandit.state_dict() == bandit
  finally:
    again.close()


def test_non_finite_updates_are_skipped_then_stop_the_run(tmp_path, tiny_policy_dir, xla_cache, monkeypatch):
  """Poisoned advantages (NaN) make every loss NaN: each update is skipped (params unchanged) and
  logged, and rl.max_skipped_updates of them in a row stop the run with a message naming the key."""
  c = tiny_rl_config(tmp_path / "nan", 2, xla_cache)
  c.policy.path = tiny_policy_dir
  c.rl.max_skipped_updates = 3  # 2 updates a step: step 1 skips 2, step 2's first skip is the third
  trainer = Trainer(c, *bootstrap.load(c), devices=jax.devices()[:2])
  before = jax.tree.map(np.asarray, trainer.actor.params)
  monkeypatch.setattr(grpo, "advantages", lambda rewards, *args: np.full(rewards.shape, np.nan, np.float32))
  try:
    record = trainer.run_step()
    assert record["train/updates"] == 0 and record["train/skipped_updates"] == 2
    with pytest.raises(NonFiniteUpdates, match=r"3 policy updates in a row .*rl.max_skipped_updates=3"):
      trainer.run_step()
    same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), before, trainer.actor.params)
    assert all(jax.tree.leaves(same))
  finally:
    trainer.close()


# A verl user's and a TRL user's reward functions, as they write them: parameters reordered or left out,
# **kwargs, a batch function, an async one, None where a function does not apply.
VERL_REWARDS = """
def score(solution_str, ground_truth, **kwargs):
  right = solution_str.strip().endswith(ground_truth)
  return {"score": float(right), "gsm8k_row": float(kwargs["data_source"] == "openai/gsm8k")}

def lengths(solution_strs, extra_infos):
  return [min(len(s), 50) / 50 for s in solution_strs]
"""
TRL_REWARDS = """
import asyncio

def has_number(completions, **kwargs):
  texts = [c[0]["content"] for c in completions]
  kwargs["log_metric"]("batch", len(texts))
  kwargs["log_extra"]("digits", [sum(ch.isdigit() for ch in t) for t in texts])
  return [None if i % 2 else float(any(ch.isdigit() for ch in t)) for i, t in enumerate(texts)]

async def short(completion_ids, reward_model, **kwargs):
  await asyncio.sleep(0)
  return [float(len(ids) < 20) for ids in completion_ids]
"""


def test_a_task_of_your_own_in_verls_shape_with_verl_and_trl_rewards(tmp_path, tiny_policy_dir, xla_cache,
                                                                     monkeypatch):
  """configs/gsm8k_style.py:smoke on verl-shaped GSM8K files (chat prompts with verl's instruction, bare ground
  truths, data_source, extra_info; Parquet to train on, JSONL held out) with no data keys set, scored by
  functions in verl's, verl's batch and TRL's conventions, weighted: each function's mean is logged, the sum
  is the reward, the evaluation sets report pass@1, pass@k and their failed calls, and the summary lists them."""
  import json

  import pyarrow as pa
  import pyarrow.parquet as pq

  from configs import gsm8k_style
  from tlt_jax import report
  rows = [{"data_source": "openai/gsm8k",
           "prompt": [{"role": "user", "content": f"What is {a} + {b}? Let's think step by step and output the "
                                                 "final answer after \"####\"."}],
           "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
           "extra_info": {"split": "train", "index": 3 * a + b}} for a in range(1, 5) for b in range(1, 3)]
  train, test = tmp_path / "train.parquet", tmp_path / "test.jsonl"
  pq.write_table(pa.Table.from_pylist(rows), train)
  test.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
  (tmp_path / "verl_rewards.py").write_text(VERL_REWARDS)
  (tmp_path / "trl_rewards.py").write_text(TRL_REWARDS)
  c = gsm8k_style.get_config("smoke")
  c.workdir, c.policy.path, c.data.path, c.eval.path = str(tmp_path / "run"), tiny_policy_dir, str(train), str(test)
  c.data.reward = tuple(f"{tmp_path}/{spec}" for spec in ("verl_rewards.py:score", "verl_rewards.py:lengths",
                                                          "trl_rewards.py:has_number", "trl_rewards.py:short"))
  c.data.reward_weights = (1.0, 0.1, 0.2, 0.3)
  c.rollout.speculative = False  # the plain rollout: this test follows the task's data, not the drafter
  c.rollout.compilation_cache_dir = xla_cache
  bars = []

  class Bar(evaluation.tqdm):
    def close(self):
      if not self.disable:  # closed once (tqdm closes again when collected)
        bars.append((self.desc, self.n, self.total))
      super().close()

  monkeypatch.setattr(evaluation, "tqdm", Bar)
  trainer = Trainer(c, *bootstrap.load(c), devices=jax.devices()[:1])
  try:
    assert [e.ground_truth for e in trainer.prompts][:3] == ["2", "3", "3"]
    assert trainer.eval_sets[1].examples[0].reward.specs == c.data.reward  # the sets read data.reward
    records = trainer.run()
  finally:
    trainer.close()
  first = metrics.read(str(tmp_path / "run" / "metrics.jsonl"))[0]
  step = records[0]
  assert step["reward/failures"] == step["reward/timeouts"] == 0 and step["reward/batch"] == 8
  parts = {name: step[f"reward/{name}"] for name in ("score", "lengths", "has_number", "short")}
  assert all(0 <= v <= 1 for v in parts.values()) and step["reward/gsm8k_row"] == 1.0
  # The sum of the weighted means: every function applies to every sample but has_number (every other).
  assert step["reward/mean"] == pytest.approx(parts["score"] + 0.1 * parts["lengths"] + 0.3 * parts["short"]
                                              + 0.2 * parts["has_number"] / 2, abs=1e-5)
  for record in (first, step):
    assert {"eval/greedy/pass@1", "eval/pass8/pass@1", "eval/pass8/pass@2", "eval/pass@1"} <= set(record)
    assert record["eval/greedy/reward_failures"] == record["eval/reward_failures"] == 0
    assert len(record["eval/greedy/prompt_rewards"]) == 2  # the set's first 2 prompts
  summary = report.summary(metrics.read(str(tmp_path / "run" / "metrics.jsonl")), c.workdir)
  assert set(summary["eval_sets"]) == {"greedy", "pass8"} and "pass@2" in summary["eval_sets"]["pass8"]["last"]
  assert summary["training"]["reward_failures"] == 0 and "  pass8: reward " in report.text(summary)
  # Each evaluation's progress bar counted every response (2 evaluations of 3 sets).
  assert sorted(bars) == sorted(2 * [("evaluation held-out", 8, 8), ("evaluation greedy", 2, 2),
                                     ("evaluation pass8", 4, 4)])
  texts = metrics.read(str(tmp_path / "run" / "completions.jsonl"))  # log_extra's column beside each response
  assert texts and all(t["digits"] == sum(ch.isdigit() for ch in t["completion"]) for t in texts)


class ToolEveryTurn(Turns):
  """A tool turn after every turn the EOS ends ("<|tool|>42<|assistant|>", at once): a random policy writes
  no tool call."""

  max_turns = 3

  def __init__(self, tok):
    self.stop_token_id = tok.eos_token_id
    self.tokens = np.asarray(tok("<|tool|>42", add_special_tokens=False).input_ids + [tok.convert_tokens_to_ids(
        "<|assistant|>")], np.int32)

  def submit(self, turn):
    done = concurrent.futures.Future()
    done.set_result(Turn(self.tokens, [{"name": "calculator", "arguments": {"expression": "6*7"}, "result": "42",
                                        "error": None, "seconds": 0.0}]))
    return done

  def close(self):
    pass


def tool_calls(data_source, solution_str, ground_truth, extra_info):
  return len(extra_info["tool_calls"]) / 2


def test_tool_turns_train_the_models_tokens_only_and_resume_exactly(tmp_path, tiny_policy_dir, xla_cache,
                                                                    monkeypatch):
  """Multi-turn rollouts through the RL loop: the reward reads the trajectory's tool calls in `extra_info`,
  every call is a line of tool_calls.jsonl,
  the trainer's log-probs of the model's tokens are the rollout's (a tool token in the loss, whose rollout
  log-prob is 0, would show as a mismatch of ~4 nats), and 1 step + resume equals 2 steps straight."""
  tok = tokenizer_lib.build_tokenizer()
  model = hf.from_pretrained(tiny_policy_dir)
  embedding = model.model.embed_tokens.embedding
  embedding.value = embedding.value.at[tok.eos_token_id].multiply(6.0)  # turns end often (tied head)
  policy = str(tmp_path / "policy")
  hf.save_pretrained(model, policy, tokenizer=tok)
  (tmp_path / "reward.py").write_text(inspect.getsource(tool_calls))
  monkeypatch.setattr(builders, "tool_turns", lambda config, tok, workers=None: ToolEveryTurn(tok))
  overrides = {"rollout.tools": ("calculator",), "rl.old_logp": "recompute", "eval.every": 0,
               "data.reward": f"{tmp_path / 'reward.py'}:tool_calls"}
  straight = _run(tmp_path / "straight", 2, policy, xla_cache, **overrides)
  _run(tmp_path / "resumed", 1, policy, xla_cache, **overrides)
  resumed = _run(tmp_path / "resumed", 2, policy, xla_cache, **overrides)
  assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), straight, resumed)))
  a = metrics.read(str(tmp_path / "straight" / "metrics.jsonl"))
  b = metrics.read(str(tmp_path / "resumed" / "metrics.jsonl"))
  strip = lambda r: {k: v for k, v in r.items() if not _timing(k)}
  assert [strip(r) for r in a] == [strip(r) for r in b]
  calls = metrics.read(str(tmp_path / "straight" / "tool_calls.jsonl"))  # every call, resumed or not
  strip_time = lambda rs: [{k: v for k, v in r.items() if k != "seconds"} for r in rs]
  assert strip_time(calls) == strip_time(metrics.read(str(tmp_path / "resumed" / "tool_calls.jsonl")))
  assert {c["step"] for c in calls} == {1, 2} and all(c["result"] == "42" for c in calls)
  for r in a:
    assert sum(c["step"] == r["step"] for c in calls) == r["rollout/tool_calls"] > 0
    assert 0 < r["tools/calls_per_response"] < 2 and r["rollout/tool_turns"] > 0, r
    assert r["reward/mean"] == pytest.approx(r["tools/calls_per_response"] / 2, abs=1e-6)
    assert r["mismatch/logp_abs_diff"] < 1e-4 and r["train/updates"] > 0, r


def test_an_objective_and_a_rollout_correction_run_in_the_trainer(tmp_path, tiny_policy_dir, xla_cache):
  """GSPO-style CISPO with verl's geometric-mean rejection and token TIS, GDPO's advantages: "auto" old
  log-probs are recomputed
  (the correction weighs them against the rollout's), the updates apply, and verl's metrics are logged; in
  float32 the two agree, so nothing is rejected and every weight is 1 up to rounding."""
  _run(tmp_path / "run", 1, tiny_policy_dir, xla_cache, **{
      "eval.every": 0, "rl.loss.kind": "cispo", "rl.loss.importance_level": "sequence",
      "rl.rollout_correction.preset": "decoupled_geo_rs_token_tis", "rl.reward_aggregation": "normalize_then_sum"})
  record = metrics.read(str(tmp_path / "run" / "metrics.jsonl"))[0]
  assert record["train/updates"] == 2 and record["train/skipped_updates"] == 0
  assert record["mismatch/rs_masked_fraction"] == 0.0 and abs(record["mismatch/is_mean"] - 1) < 1e-5
  assert abs(record["mismatch/chi2_token"]) < 1e-5 and record["mismatch/training_ppl"] > 1
  phases = {"rollout", "rewards", "old_logp", "update", "push", "checkpoint"}  # each one's host peak memory
  assert {f"memory/{p}_gb" for p in phases} <= set(record) and all(record[f"memory/{p}_gb"] > 0.1 for p in phases)
