"""The RL loop: a step trains, and 2 steps + stop + resume to 4 equals 4 steps straight."""

import os

import jax
import numpy as np
import pytest
from flax import nnx

from configs import tiny
from tlt_jax import metrics
from tlt_jax.models import hf
from tlt_jax.rl import tokenizer as tokenizer_lib
from tlt_jax.rl.trainer import Trainer
from tlt_jax import sft


def _timing(key: str) -> bool:
  """Timing figures differ between runs; everything else must not."""
  return key.endswith(("_s", "_share")) or key.startswith("time/")



def _config(workdir, steps, cache_dir):
  c = tiny.get_config()
  c.unlock()
  c.workdir = str(workdir)
  c.steps = steps
  c.model.hidden_size, c.model.num_layers, c.model.intermediate_size = 32, 2, 64
  c.data.size = 64
  c.data.max_prompt_len = 64
  c.rollout.speculative = False
  c.rollout.prompts_per_step = 2
  c.rollout.num_samples = 4
  c.rollout.max_new_tokens = 24
  c.rollout.batch_buckets = 8
  c.rollout.segment_steps = 8
  c.rollout.kv_block = 32
  c.rollout.compilation_cache_dir = str(cache_dir)
  c.rl.row_len = 96
  c.rl.micro_batch_rows = 4
  c.rl.learning_rate = 1e-2
  c.rl.dynamic_sampling = False
  # A random policy never answers right; the overlong penalty makes rewards differ within a group.
  c.rl.overlong_buffer = 24
  c.checkpoint.every = 2
  c.rollout.groups = 1
  c.rl.mini_batches = 2
  return c


def _tlt_config(workdir, steps, cache_dir, drafter_path):
  """TLT on 2 rollout groups; the drafter at `drafter_path` (warmed up on the tiny task if absent)."""
  c = _config(workdir, steps, cache_dir)
  c.rollout.speculative = True
  c.rollout.groups = 2
  c.rollout.strategies = "2_1_3"
  c.rollout.sd_max_batch = 4
  c.drafter.path = str(drafter_path)
  c.drafter.warmup_steps = 4
  c.drafter.row_len = 64
  c.drafter.online_rows_per_device = 1
  c.drafter.online_warmup_steps = 1
  c.checkpoint.every = 1
  return c


def _link_policy(workdir, policy_dir):
  """A random policy's drafter warm-up needs the tiny world's tokenizer: the policy goes where the
  trainer looks for the tiny one (config.policy.path stays empty)."""
  os.makedirs(workdir, exist_ok=True)
  os.symlink(policy_dir, os.path.join(workdir, "policy"))


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
  """A random tiny policy saved where the trainer looks for it (no SFT)."""
  c = _config("unused", 0, "unused")
  tok = tokenizer_lib.build_tokenizer(c.model.max_position_embeddings)
  path = tmp_path_factory.mktemp("policy")
  hf.save_pretrained(sft.build_policy(c, tok), str(path), tokenizer=tok)
  return str(path)


def _run(workdir, steps, policy_dir, cache_dir):
  c = _config(workdir, steps, cache_dir)
  c.policy.path = policy_dir
  trainer = Trainer(c, devices=jax.devices()[:2])  # the plain engine data-parallel over 2 devices
  try:
    trainer.run()
    return trainer.actor.params
  finally:
    trainer.close()


def test_resume_continues_exactly(tmp_path, policy_dir):
  cache = tmp_path / "xla_cache"
  straight = _run(tmp_path / "straight", 4, policy_dir, cache)
  _run(tmp_path / "resumed", 2, policy_dir, cache)
  resumed = _run(tmp_path / "resumed", 4, policy_dir, cache)

  same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), straight, resumed)
  assert all(jax.tree.leaves(same))
  a = metrics.read(str(tmp_path / "straight" / "metrics.jsonl"))
  b = metrics.read(str(tmp_path / "resumed" / "metrics.jsonl"))
  assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
  strip = lambda r: {k: v for k, v in r.items() if not _timing(k)}
  assert [strip(r) for r in a] == [strip(r) for r in b]
  # The policy did train: rewards varied in some groups, so there were gradients and the parameters moved.
  assert all(r["train/updates"] == 2 for r in a) and any(r["train/grad_norm"] > 0 for r in a)
  initial = nnx.state(hf.from_pretrained(policy_dir))
  moved = jax.tree.map(lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y)).max()), initial, straight)
  assert max(jax.tree.leaves(moved)) > 1e-3
  assert os.path.isdir(tmp_path / "straight" / "tensorboard")
  exported = nnx.state(hf.from_pretrained(str(tmp_path / "straight" / "export" / "policy")))
  assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), exported, straight)))


def test_tlt_step_trains_the_drafter_on_idle_groups_and_checkpoints_it(tmp_path, policy_dir):
  c = _tlt_config(tmp_path / "tlt", 2, tmp_path / "xla_cache", tmp_path / "drafter")
  _link_policy(tmp_path / "tlt", policy_dir)
  trainer = Trainer(c, devices=jax.devices()[:2])
  try:
    records = trainer.run()
    version = trainer.spot.version
    drafter = trainer.spot.state_dict()[0]["params"]
  finally:
    trainer.close()
  assert os.path.exists(tmp_path / "drafter" / "drafter_config.json")
  assert version >= 1 and records[-1]["drafter/version"] == version
  assert all(r["spot/groups"] == 2 for r in records)
  assert os.path.exists(tmp_path / "tlt" / "export" / "drafter" / "model.safetensors")
  # A restart restores the drafter and the bandits with the policy.
  c.steps = 2
  again = Trainer(c, devices=jax.devices()[:2])
  try:
    assert again.step == 2 and again.spot.version == version
    same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), again.spot.state_dict()[0]["params"], drafter)
    assert all(jax.tree.leaves(same))
    assert all(e.bandit is not None for e in again.engines)
  finally:
    again.close()
