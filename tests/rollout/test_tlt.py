"""The TLT rollout on 8 simulated devices in 4 groups with skewed lengths: who trains, when it stops,
one merged drafter, versions, losslessness, async selective checkpoints, non-finite drafters, and a
drafter state reloaded from `state_dict` that trains on as before."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax.drafter.buffer import BufferConfig, DataBuffer
from tlt_jax.drafter.model import Drafter
from tlt_jax.drafter.trainer import DrafterTrainerConfig
from tlt_jax.models import CausalLM, ModelConfig
from tlt_jax.rollout import profile
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.state import EngineConfig
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.tlt import TLTConfig, TLTRollout

CFG = ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                  num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, tie_word_embeddings=True)
ENGINE = EngineConfig(batch_buckets=(1, 2, 4), max_prompt_len=24, max_new_tokens=96, kv_block=16, segment_steps=4,
                      compact=False, capture_hidden=True)  # no speculation: every group compiles its own engine
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=96, seed=7)


def prompts_and_limits(seed):
  rng = np.random.default_rng(seed)
  # Later steps' prompts run longer than step 0's: to another padded length (24 tokens, not 16).
  prompts = [rng.integers(2, 64, rng.integers(3, 10) + 10 * (seed > 0)).tolist() for _ in range(8)]
  # Groups 0-2 (prompts 0-5) stop after 6 tokens; group 3 runs the long tail.
  return prompts, [len(p) + (6 if i < 6 else 96) for i, p in enumerate(prompts)]


def tokens(samples):
  return [(s.prompt_index, s.sample_index, s.tokens.tolist()) for s in samples]


@pytest.fixture(scope="module")
def policy():
  return CausalLM(CFG, rngs=nnx.Rngs(0))


def test_idle_groups_train_one_drafter_losslessly(policy, tmp_path):
  drafter = Drafter(CFG, rngs=nnx.Rngs(1))
  initial = jax.tree.map(np.asarray, nnx.state(drafter))
  rollout = TLTRollout(policy, drafter, ENGINE, SAMPLING, jax.devices(), 4, DataBuffer(BufferConfig(eval_every=4)),
                       TLTConfig(timeout_s=300),
                       DrafterTrainerConfig(learning_rate=1e-2, rows_per_device=1, row_len=32, eval_rows=2,
                                            draft_steps=2, checkpoint_dir=str(tmp_path / "ckpt")))
  trainer = rollout.drafter_trainer
  plain = Engine(policy, EngineConfig(**{**ENGINE.__dict__, "capture_hidden": False}), SAMPLING)
  for step in range(2):
    prompts, limits = prompts_and_limits(step)
    with profile.count_compilations() as compiled:
      samples, metrics = rollout.generate(prompts, 2, limits)
    assert bool(compiled) == (step == 0)  # the first rollout compiles every prompt length's prefill
    # Lossless: exactly what one plain engine samples, whatever the drafter and the sharding.
    assert tokens(samples) == tokens(plain.generate(prompts, 2, limits).samples)
    finished, end, rounds = rollout.last["finished"], rollout.last["end"], rollout.last["rounds"]
    assert end == finished[3] == max(finished)  # the skewed group is the tail
    assert rounds, "no drafter step ran in the tail"
    for r in rounds:  # only groups that had finished train, and no round starts after the rollout ended
      assert all(finished[g] <= r.start for g in r.groups) and 3 not in r.groups and r.start < end
    assert metrics["drafter/steps"] == len(rounds) == metrics["spot/train_rounds"]
    assert metrics["drafter/version"] == step + 1 and metrics["drafter/version_used"] == step
    assert 0 < metrics["spot/harvested_device_s"] <= metrics["spot/idle_device_s"]
    assert np.isfinite(metrics["drafter/loss"])
    assert 0 <= metrics["drafter/top1"] <= 1 and metrics["spot/checkpoint_s"] > 0
    assert 0 <= metrics["drafter/top1_2"] <= 1 and 0 <= metrics["drafter/top1_3"] <= 1  # later draft steps
    assert metrics["rollout/refills"] >= 0 and metrics["rollout/preemptions"] == 0  # contiguous caches
    assert 0 < metrics["rollout/peak_rows"] <= 8 and metrics["rollout/peak_pages"] == 0
    assert 0 <= metrics["rollout/tail_share"] <= 1 and 0 <= metrics["rollout/idle_slot_fraction"] <= 1
    assert 0 <= metrics["rollout/sd_share"] <= 1
    assert metrics["rollout/tokens_per_s"] == pytest.approx(metrics["rollout/tokens"] / (end - rollout.last["start"]))
    # One merged drafter, pushed to every group's engine.
    master = jax.tree.map(np.asarray, trainer.params)
    pointer = lambda x: x.addressable_shards[0].data.unsafe_buffer_pointer()
    for engine in rollout.engines:
      jax.tree.map(np.testing.assert_array_equal, master, jax.tree.map(np.asarray, engine.drafter_params))
      # The engines hold copies: the next update donates the master's buffers.
      assert not set(map(pointer, jax.tree.leaves(engine.drafter_params))) & set(map(pointer,
                                                                                    jax.tree.leaves(trainer.params)))
    assert rollout.engine_versions == [step + 1] * 4
  moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), initial, master)
  assert all(jax.tree.leaves(moved))

  # Async selective checkpoint of the last version: params + optimizer state only.
  trainer.wait_for_checkpoints()
  tree, meta = trainer.state_dict()
  ckpt = trainer._checkpointer
  assert ckpt.latest_version() == 2
  params, opt_state, saved_meta = ckpt.restore(tree["params"], tree["opt_state"])
  assert saved_meta == trainer.metadata() and meta["version"] == 2 and meta["rl_step"] == 1
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, params), master)
  jax.tree.map(np.testing.assert_array_equal, *(jax.tree.map(np.asarray, x) for x in (opt_state, tree["opt_state"])))
  trainer.load_state_dict(tree, {**meta, "version": 5})
  assert rollout.engine_versions == [5] * 4
  with pytest.raises(KeyError, match="'opt_state'"):
    trainer.load_state_dict({"params": tree["params"]}, meta)


def test_one_group_trains_in_the_gap_a_non_finite_drafter_is_restored_and_a_reloaded_state_trains_on_alike(
    policy, caplog):
  rollout = TLTRollout(policy, Drafter(CFG, rngs=nnx.Rngs(1)), ENGINE, SAMPLING, jax.devices()[:2], 1,
                       DataBuffer(BufferConfig(eval_every=0)), TLTConfig(solo_steps=3),
                       DrafterTrainerConfig(rows_per_device=1, row_len=32))
  trainer = rollout.drafter_trainer
  prompts, limits = prompts_and_limits(0)
  prompts, limits = prompts[:2], [len(p) + 10 for p in prompts[:2]]
  first, metrics = rollout.generate(prompts, 1, limits)
  assert metrics["drafter/steps"] == 3 and metrics["spot/train_rounds"] == 0 and metrics["spot/gap_s"] > 0
  assert metrics["spot/idle_device_s"] == 0 and metrics["drafter/version"] == 1
  assert metrics["drafter/restored"] == 0
  with pytest.raises(ValueError, match="8 devices do not split into groups=3"):
    TLTRollout(policy, Drafter(CFG, rngs=nnx.Rngs(1)), ENGINE, SAMPLING, jax.devices(), 3, DataBuffer())

  # NaN drafter params in the engine: the rollout goes on without the drafter (same samples), then
  # the last finite drafter (version 1) is restored and pushed; a checkpoint with NaN is refused.
  good = jax.tree.map(np.asarray, trainer.params)
  nan = lambda tree: jax.tree.map(lambda x: np.full(x.shape, np.nan, x.dtype), tree)
  rollout.engines[0].set_drafter_params(nan(rollout.engines[0].drafter_params))
  with caplog.at_level("WARNING"):
    again, metrics = rollout.generate(prompts, 1, limits)
  assert tokens(again) == tokens(first)
  assert metrics["drafter/restored"] == 1 and metrics["drafter/version"] == 1
  assert "restored its last finite state (version 1)" in caplog.text
  for tree in (trainer.params, rollout.engines[0].drafter_params):
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, tree), good)
  tree, meta = trainer.state_dict()
  trainer.load_state_dict({"params": nan(tree["params"]), "opt_state": tree["opt_state"]}, {**meta, "version": 9})
  assert trainer.version == 1
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, rollout.engines[0].drafter_params), good)

  # What a resumed run rebuilds: `state_dict()` (data buffer with the previous step's long samples,
  # optimizer, version, RL step; the metadata through JSON as a checkpoint stores it) loaded back
  # gives the same drafter updates and metrics in the next rollouts.
  tree, meta = trainer.state_dict()
  saved = jax.tree.map(jnp.copy, tree), json.loads(json.dumps(meta))  # the next update donates the params
  step_prompts = [prompts_and_limits(step)[0][:2] for step in (1, 2)]
  runs = []
  for _ in range(2):
    trainer.load_state_dict(*saved)
    metrics = [rollout.generate(p, 1, [len(x) + 10 for x in p])[1] for p in step_prompts]
    runs.append(([{k: v for k, v in m.items() if not k.endswith("_s")} for m in metrics],
                 jax.tree.map(np.asarray, trainer.params)))
  (a, params_a), (b, params_b) = runs
  assert a == b and [m["drafter/steps"] for m in a] == [3, 3] and a[-1]["drafter/version"] == 3
  jax.tree.map(np.testing.assert_array_equal, params_a, params_b)
