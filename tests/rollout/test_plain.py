"""PlainRollout: one engine over a 2-device mesh samples what the engine alone samples (prompt
indices counted within the call), takes new policy params (without a copy where they are laid out so
already), and checkpoints its bandit."""

import jax
from flax import nnx

from tlt_jax import sharding
from tlt_jax.models import CausalLM, ModelConfig
from tlt_jax.rollout import profile
from tlt_jax.rollout.bandit import Bandit
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.state import EngineConfig
from tlt_jax.rollout.plain import PlainRollout
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.speculative import Strategy

CFG = ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                  num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, tie_word_embeddings=True)
ENGINE = EngineConfig(batch_buckets=(1, 2, 4), max_prompt_len=16, max_new_tokens=12, kv_block=16, segment_steps=4,
                      compact=False)
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=12, seed=7)
PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]


def tokens(samples):
  return [(s.prompt_index, s.sample_index, s.tokens.tolist()) for s in samples]


def test_plain_rollout_samples_as_its_engine_takes_params_and_checkpoints_its_bandit():
  policy = CausalLM(CFG, rngs=nnx.Rngs(0))
  mesh = sharding.make_mesh({"data": 2}, jax.devices()[:2])
  rollout = PlainRollout(policy, ENGINE, SAMPLING, mesh, bandit=Bandit((), seed=1))
  engine = Engine(policy, ENGINE, SAMPLING)
  samples, metrics = rollout.generate(PROMPTS, 2, prompt_offset=5)
  reference = engine.generate(PROMPTS, 2, prompt_offset=5).samples
  assert [i for i, _, _ in tokens(samples)] == [0, 0, 1, 1, 2, 2]
  assert [t for _, _, t in tokens(samples)] == [t for _, _, t in tokens(reference)]
  assert metrics["rollout/tokens"] == sum(len(s.tokens) for s in samples)

  other = CausalLM(CFG, rngs=nnx.Rngs(1))
  rollout.set_policy_params(nnx.state(other))
  engine.set_params(nnx.state(other))
  again, _ = rollout.generate(PROMPTS, 2, prompt_offset=5)
  expected = engine.generate(PROMPTS, 2, prompt_offset=5).samples
  assert [t for _, _, t in tokens(again)] == [t for _, _, t in tokens(expected)]
  assert tokens(again) != tokens(samples)
  # Params laid out as the engine needs them are taken as they are: no second copy of the policy.
  placed = sharding.place(nnx.state(other), sharding.param_shardings(nnx.state(other), mesh))
  rollout.set_policy_params(placed)
  buffers = lambda tree: [s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(tree) for s in x.addressable_shards]
  assert buffers(rollout.engine.params) == buffers(placed)

  arrays, meta = rollout.state_dict()
  assert arrays == {} and rollout.abstract_state(meta) == {} and meta["bandits"] == [rollout.engine.bandit.state_dict()]
  rollout.engine.bandit = Bandit((), seed=2)
  rollout.load_state_dict({}, meta)
  assert rollout.engine.bandit.state_dict() == meta["bandits"][0] and rollout.drafter_model() is None


def test_a_later_rollout_compiles_nothing_whatever_its_prompt_lengths():
  """The RL loop's rollouts prepare every prompt length's prefill before the first: a later step whose
  prompts are longer than any before (another padded length) compiles nothing."""
  rollout = PlainRollout(CausalLM(CFG, rngs=nnx.Rngs(0)), EngineConfig(**{**ENGINE.__dict__, "max_prompt_len": 40}),
                         SAMPLING)
  rollout.generate(PROMPTS, 2)
  with profile.count_compilations() as compiled:
    rollout.generate([list(range(2, 38)), [5, 6]], 2)  # 36 tokens: padded to 40, the first rollout's to 16
  assert compiled == []


def test_history_banks_earlier_responses_and_survives_a_checkpoint():
  """With suffix strategies and `suffix_history_len`, each call's responses join their prompt's
  history (the next call drafts from them: fewer verify passes, the same samples as without), and
  the history goes through state_dict / abstract_state / load_state_dict."""
  policy = CausalLM(CFG, rngs=nnx.Rngs(0))
  greedy = SamplingParams(temperature=0, max_new_tokens=12)
  config = EngineConfig(**{**ENGINE.__dict__, "strategies": (Strategy.parse("s4_1_5"),), "sd_max_batch": 4,
                           "suffix_bank_len": 128, "suffix_history_len": 64})
  rollout, plain = PlainRollout(policy, config, greedy), PlainRollout(policy, ENGINE, greedy)
  first, m1 = rollout.generate(PROMPTS, 1)
  again, m2 = rollout.generate(PROMPTS, 1)
  expected, _ = plain.generate(PROMPTS, 1)
  assert tokens(first) == tokens(again) == tokens(expected)
  assert m1["rollout/history_prompts"] == m2["rollout/history_prompts"] == 3
  assert m2["rollout/verify_passes"] < m1["rollout/verify_passes"]
  assert rollout.history.get(PROMPTS[0]).tolist()[:3 + 12] == PROMPTS[0] + first[0].tokens.tolist()

  arrays, meta = rollout.state_dict()
  restored = PlainRollout(policy, config, greedy)
  shapes = restored.abstract_state(meta)
  assert jax.tree.map(lambda x: x.shape, shapes) == jax.tree.map(lambda x: x.shape, arrays)
  restored.load_state_dict(arrays, meta)
  for p in PROMPTS:
    assert restored.history.get(p).tolist() == rollout.history.get(p).tolist()
