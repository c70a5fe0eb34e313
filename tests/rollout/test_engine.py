"""The rollout engine: parity with `transformers.generate`, seed invariance, compaction, no recompiles."""

import copy
import functools

import jax
import numpy as np
import pytest
import torch
from flax import nnx

from tests.conftest import FAMILIES, VOCAB
from tests.rollout.conftest import CONFIG, STOP, configured, prompts, with_sd
from tlt_jax.drafter.model import Drafter
from tlt_jax.models import CausalLM, ModelConfig, hf
from tlt_jax.rollout import profile, suffix
from tlt_jax.rollout.bandit import Bandit
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.speculative import Strategy
from tlt_jax.rollout.state import EngineConfig


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers_generate(family, models, hf_dirs):
  ref = hf_dirs[family][1]
  ps = prompts(5, seed=1)
  engine = Engine(models[family], CONFIG, SamplingParams(temperature=0, max_new_tokens=64, stop_token_ids=(STOP,)))
  rollout = engine.generate(ps)
  for s in rollout.samples:
    with torch.no_grad():
      out = ref.generate(torch.tensor([ps[s.prompt_index]]), max_new_tokens=64, do_sample=False,
                         eos_token_id=STOP, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    expected = out.sequences[0, len(ps[s.prompt_index]):].numpy()
    np.testing.assert_array_equal(s.tokens, expected)
    assert s.finish_reason == ("stop" if expected[-1] == STOP else "length")
    ref_logp = [torch.log_softmax(x[0], -1)[t].item() for x, t in zip(out.scores, expected)]
    np.testing.assert_allclose(s.logprobs, ref_logp, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen2_untied", "llama3"])
def test_bfloat16_greedy_leaves_transformers_bfloat16_only_at_near_ties(family, hf_dirs):
  """A bfloat16 engine (float32 masters cast, as the RL rollouts hold them) against transformers in
  bfloat16: the greedy tokens agree until both implementations' rounding may pick either of two
  near-tied tokens, i.e. every divergence is where transformers' own top-2 logits are within two
  bfloat16 steps (float32 stays exact: test_greedy_matches_transformers_generate). Two families:
  the GPU configs' (Qwen2, untied) and Llama's (bfloat16 matmuls are slow on a CPU; every family
  runs in float32 above)."""
  path, ref = hf_dirs[family]
  ref = copy.deepcopy(ref).to(torch.bfloat16)
  ps = prompts(5, seed=1)
  model = hf.from_pretrained(path, dtype="bfloat16", param_dtype="float32")
  engine = Engine(model, CONFIG, SamplingParams(temperature=0, max_new_tokens=64, stop_token_ids=(STOP,)))
  agreed, total = 0, 0
  for s in engine.generate(ps).samples:
    p = ps[s.prompt_index]
    with torch.no_grad():
      out = ref.generate(torch.tensor([p]), max_new_tokens=64, do_sample=False, eos_token_id=STOP, pad_token_id=0,
                         output_scores=True, return_dict_in_generate=True)
    expected = out.sequences[0, len(p):].numpy()
    n = min(len(expected), len(s.tokens))
    first = next((i for i in range(n) if expected[i] != s.tokens[i]), n)
    agreed, total = agreed + first, total + len(expected)
    if first < n:
      top2 = torch.topk(out.scores[first][0].float(), 2).values.tolist()
      step = 2.0 ** (np.floor(np.log2(abs(top2[0]))) - 7)  # bfloat16's spacing at that logit
      assert top2[0] - top2[1] <= 2 * step, (s.prompt_index, first, top2)
  print(f"{family}: {agreed / total:.0%} of transformers' bfloat16 greedy tokens before the first near-tie")


def test_captured_hidden_states_are_the_targets(models, hf_dirs):
  ref = hf_dirs["qwen3"][1]
  config = EngineConfig(**{**CONFIG.__dict__, "capture_hidden": True})
  engine = Engine(models["qwen3"], config, SamplingParams(temperature=0, max_new_tokens=12))
  p = prompts(1, seed=2)[0]
  s = engine.generate([p]).samples[0]
  with torch.no_grad():
    full = ref(torch.tensor([p + s.tokens.tolist()]), output_hidden_states=True).hidden_states[-1][0].numpy()
  # hidden[i] is the feature at the position whose logits produced token i.
  np.testing.assert_allclose(s.hidden, full[len(p) - 1:len(p) - 1 + len(s.tokens)], atol=1e-4)
  np.testing.assert_allclose(s.prompt_hidden, full[:len(p)], atol=1e-4)  # the prompt's own features


def sample_set(rollout):
  return {(s.prompt_index, s.sample_index): s.tokens.tolist() for s in rollout.samples}


# The params most tests share, so that their plain references share executables.
GREEDY = SamplingParams(temperature=0, max_new_tokens=48, stop_token_ids=(STOP, 7))
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=40, stop_token_ids=(STOP, 2, 3), seed=2)


@pytest.fixture(scope="module")
def plain():
  """`plain(model, params, prompts, **generate_args)`: the tokens (`sample_set`) of plain decoding on one
  device with a contiguous cache, the reference every faster path must give. Tokens depend on neither
  batch size nor compaction (test_samples_do_not_depend_on_batch_size_or_compaction), so one engine per
  (model, params), without compaction (it compiles the first bucket only), serves every test."""
  engines = {}

  def tokens(model, params, ps, **kwargs):
    key = (id(model), params)
    if key not in engines:
      engines[key] = (model, Engine(model, configured(CONFIG, compact=False), params))
    return sample_set(engines[key][1].generate(ps, **kwargs))
  return tokens


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.8, top_k=20, top_p=0.9)])
def test_samples_do_not_depend_on_batch_size_or_compaction(models, sampling):
  params = SamplingParams(max_new_tokens=40, stop_token_ids=(STOP, 2, 3), seed=3, **sampling)
  ps = prompts(4, seed=3)
  results = []
  for buckets, compact in [((1,), True), ((1, 2, 4), True), ((1, 2, 4, 8), True), ((1, 2, 4, 8), False)]:
    config = EngineConfig(**{**CONFIG.__dict__, "batch_buckets": buckets, "compact": compact})
    results.append(sample_set(Engine(models["llama3"], config, params).generate(ps, num_samples=2)))
  assert len(results[0]) == 8
  assert len({len(t) for t in results[0].values()}) > 1  # rows finish at different times
  for r in results[1:]:
    assert r == results[0]
  three = sample_set(Engine(models["llama3"], CONFIG, params).generate(ps[:3]))  # a batch of 3 rows
  assert three == {k: v for k, v in results[0].items() if k[0] < 3 and k[1] == 0}


def test_compaction_and_no_compilation_after_warmup(models):
  params = SamplingParams(temperature=1.0, max_new_tokens=60, stop_token_ids=(STOP, 2, 3, 4, 5), seed=0)
  engine = Engine(models["qwen2_tied"], CONFIG, params)
  ps = prompts(8, seed=4)
  with profile.count_compilations() as compiled:
    engine.prepare(len(ps), [len(p) for p in ps])
  assert compiled
  with profile.count_compilations() as compiles:
    rollout = engine.generate(ps)
  assert not compiles, f"the rollout compiled {compiles}"
  buckets = rollout.metrics.buckets()
  assert buckets[0] == 8 and buckets[-1] < 8 and buckets == sorted(buckets, reverse=True)
  assert sum(len(s.tokens) for s in rollout.samples) == rollout.metrics.tokens
  stats = engine.pool.stats()
  assert stats["executables"] == len(engine.pool) > 0 and stats["compile_s"] > 0


def test_length_limits(models):
  engine = Engine(models["qwen2_untied"], CONFIG, SamplingParams(temperature=1.0, max_new_tokens=10))
  ps = [[5, 6, 7], [8] * 10]
  rollout = engine.generate(ps, max_total_len=[8, 100])
  lengths = {s.prompt_index: len(s.tokens) for s in rollout.samples}
  assert lengths == {0: 5, 1: 10}
  assert {s.finish_reason for s in rollout.samples} == {"length"}


def test_bad_prompts_are_named(models):
  engine = Engine(models["qwen2_untied"], CONFIG, SamplingParams(max_new_tokens=10))
  with pytest.raises(ValueError, match="prompt 1 has 0 tokens"):
    engine.generate([[3], []])
  with pytest.raises(ValueError, match="prompt 0 has 25 tokens"):
    engine.generate([[3] * 25])
  with pytest.raises(ValueError, match="prompt 0: 3 tokens leave no room"):
    engine.generate([[3, 4, 5]], max_total_len=3)
  with pytest.raises(ValueError, match="exceeds the engine's capacity"):
    Engine(models["qwen2_untied"], CONFIG, SamplingParams(max_new_tokens=65))


def test_set_params_swaps_weights_without_recompiling(models):
  a = models["qwen2_tied"]
  engine = Engine(a, CONFIG, SamplingParams(temperature=0, max_new_tokens=8))
  first = sample_set(engine.generate([[5, 6, 7]]))
  n = len(engine.pool)
  perturbed = jax.tree.map(lambda x: x * 1.5, nnx.state(a))
  engine.set_params(perturbed)
  second = sample_set(engine.generate([[5, 6, 7]]))
  assert len(engine.pool) == n and first != second


def test_the_engine_leaves_jax_settings_alone(models):
  """The persistent compilation cache is the process's start-up's to set (`config.setup_compilation_cache`)."""
  settings = lambda: (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
  before = settings()
  engine = Engine(models["qwen2_tied"], configured(CONFIG, batch_buckets=(1,)), SamplingParams(max_new_tokens=4))
  engine.generate([[5, 6]])
  assert settings() == before


def test_speculative_greedy_is_identical_for_any_drafter(models, plain):
  """Random drafters (full and reduced vocabulary), chain and tree strategies, 1 and 8 rows, stops and
  budgets inside steps. (A tree drafted by a full head is covered by the greedy tree cases below:
  test_bandit_picks_strategies_losslessly_without_compiling, test_refill_equals_rows_run_one_by_one_and_in_waves.)"""
  model, params = models["qwen3"], GREEDY
  full = Drafter(model.config, rngs=nnx.Rngs(1))
  reduced = Drafter(model.config, draft_vocab=tuple(range(1, VOCAB, 3)), rngs=nnx.Rngs(6))  # stop token 1 included
  engines = [Engine(model, with_sd(CONFIG, "3_1_4"), params, drafter=full),
             Engine(model, with_sd(CONFIG, "3_2_6"), params, drafter=reduced)]
  for rows in (8, 1):  # largest first: the smaller rollout reuses its segment executables
    ps = prompts(rows, seed=10 + rows)
    limits = [len(p) + 5 + 7 * i for i, p in enumerate(ps)]  # budgets end at odd places
    expected = plain(model, params, ps, max_total_len=limits)
    for engine in engines:
      rollout = engine.generate(ps, max_total_len=limits)
      assert sample_set(rollout) == expected, (rows, engine.config.strategies)
      assert rollout.metrics.verify_passes > 0


@pytest.mark.parametrize("strategy,budget", [(None, 48), ("3_2_6", 43)], ids=["plain", "speculative"])
def test_rows_fill_a_cache_of_exactly_their_slots(models, plain, strategy, budget):
  """Prompts of max_prompt_len and no stop: every row writes up to its last slot (capacity = prompt + budget +
  window - 1 = 64, no padding), and samples as a roomy cache does."""
  model = models["qwen2_untied"]
  config = configured(CONFIG, max_prompt_len=16, max_new_tokens=budget)
  config = with_sd(config, strategy) if strategy else config
  assert config.capacity == config.row_slots(16, budget) == 64
  params = SamplingParams(temperature=1.0, max_new_tokens=budget, seed=4)
  ps = [(p * 16)[:16] for p in prompts(2, seed=9)]
  drafter = Drafter(model.config, rngs=nnx.Rngs(3)) if strategy else None
  rollout = Engine(model, config, params, drafter=drafter).generate(ps)
  assert {len(s.tokens) for s in rollout.samples} == {budget}
  assert sample_set(rollout) == plain(model, params, ps)


def test_speculative_sampling_equals_plain_sampling_with_the_same_seed(models, plain):
  model = models["qwen2_untied"]
  drafter = Drafter(model.config, rngs=nnx.Rngs(2))
  params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=40, stop_token_ids=(STOP,), seed=5)
  ps = prompts(4, seed=6)
  rollout = Engine(model, with_sd(CONFIG, "3_2_6"), params, drafter=drafter).generate(ps, num_samples=2)
  assert sample_set(rollout) == plain(model, params, ps, num_samples=2)
  assert {s.strategy for s in rollout.metrics.segments} == {"3_2_6"}


def test_a_bfloat16_target_speculates_with_a_float32_drafter(hf_dirs, plain):
  """The drafter's float32 output is kept at the target's dtype between iterations (a while_loop carry)."""
  model = hf.from_pretrained(hf_dirs["qwen2_tied"][0], dtype="bfloat16")
  params = SamplingParams(temperature=0, max_new_tokens=24, stop_token_ids=(STOP,))
  ps = prompts(2, seed=9)
  drafter = Drafter(model.config, rngs=nnx.Rngs(3))  # float32
  rollout = Engine(model, with_sd(CONFIG, "2_2_4"), params, drafter=drafter).generate(ps)
  assert rollout.metrics.verify_passes > 0
  assert sample_set(rollout) == plain(model, params, ps)


def test_speculation_only_in_the_tail(models):
  model = models["qwen3"]
  params = SamplingParams(temperature=1.0, max_new_tokens=48, stop_token_ids=(STOP, 2, 3, 4, 5, 6), seed=1)
  drafter = Drafter(model.config, rngs=nnx.Rngs(0))
  engine = Engine(model, with_sd(CONFIG, "2_2_4", sd_max_batch=2), params, drafter=drafter)
  rollout = engine.generate(prompts(8, seed=8))
  segments = rollout.metrics.segments
  assert all((s.strategy is not None) == (s.active_rows <= 2) for s in segments)
  assert {s.strategy for s in segments} == {None, "2_2_4"}


def test_segments_end_on_the_device_once_a_smaller_bucket_fits(models):
  """A play runs `segment_steps` iterations unless the active rows drop to its stop point first (half
  its bucket; before the tail, `sd_max_batch`): then it stops on the device, mid-segment, and the
  host compacts or hands the tail to speculation at once."""
  model = models["qwen3"]
  params = SamplingParams(temperature=1.0, max_new_tokens=60, stop_token_ids=(STOP, 2, 3, 4), seed=3)
  config = with_sd(EngineConfig(**{**CONFIG.__dict__, "segment_steps": 16}), "2_2_4", sd_max_batch=3)
  segments = Engine(model, config, params, drafter=Drafter(model.config, rngs=nnx.Rngs(0))).generate(
      prompts(8, seed=9)).metrics.segments
  early = 0
  for seg, after in zip(segments, segments[1:]):
    stop_at = max(seg.bucket // 2, 0 if seg.tail else 3)
    assert seg.steps == 16 or after.active_rows <= stop_at, (seg, after)
    early += seg.steps < 16
  assert early >= 2 and any(s.strategy and s.steps > 1 for s in segments)


def test_speculation_needs_a_drafter(models):
  with pytest.raises(ValueError, match=r"\['2_2_4'\] need a drafter"):
    Engine(models["qwen3"], configured(CONFIG, strategies=(Strategy.parse("2_2_4"), Strategy.parse("s2_2_4"))),
           SamplingParams(max_new_tokens=8))


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_suffix_speculation_without_a_drafter_equals_plain_decoding(models, plain, params):
  """Suffix arms (a chain and a tree of bank matches; sampling, the tree, whose paths are chains too),
  no drafter at all: 1 to 8 rows of 2 samples each, budgets and stops inside steps, give plain
  decoding's tokens; greedy, the drafts pay."""
  model = models["qwen3"]
  arms = ("s4_1_5", "s3_3_7") if params.greedy else ("s3_3_7",)
  engines = [Engine(model, with_sd(CONFIG, s), params) for s in arms]
  for rows in (4, 1):
    ps = prompts(rows, seed=50 + rows)
    limits = [len(p) + 5 + 9 * i for i, p in enumerate(ps)]
    expected = plain(model, params, ps, num_samples=2, max_total_len=limits)
    for engine in engines:
      rollout = engine.generate(ps, num_samples=2, max_total_len=limits)
      assert sample_set(rollout) == expected, (rows, engine.config.strategies)
      assert rollout.metrics.verify_passes > 0
      if params.greedy and rows == 4:
        assert rollout.metrics.accept_len > 1.2, engine.config.strategies  # tiny models repeat themselves


def test_suffix_drafts_from_a_finished_sibling_in_a_refilled_slot(models):
  """One slot, three greedy samples of a prompt: sample 0 runs alone, then samples 1 and 2 refill its
  slot. The bank kept sample 0's tokens, so they draft its (identical) response: nearly every
  verify pass accepts the whole chain."""
  model = models["llama3"]
  params = SamplingParams(temperature=0, max_new_tokens=40)
  config = configured(with_sd(CONFIG, "s4_1_5", sd_max_batch=1), batch_buckets=(1,))
  rollout = Engine(model, config, params).generate([[5, 9, 13]], num_samples=3)
  assert len({tuple(t) for t in sample_set(rollout).values()}) == 1 and rollout.metrics.refills == 2
  passes = [sum(s.passes for s in rollout.metrics.segments if s.waiting == 2 - j) for j in range(3)]
  # Each later sample's 39 tokens after its first (the prefill's) in 8 passes of 5 at most: from the start.
  assert passes[1] == passes[2] == 8 < passes[0], passes


def test_suffix_drafts_from_an_earlier_epoch(models, plain):
  """The prompt's history holds its greedy response from an earlier rollout (`suffix.History`):
  the first sample of the next rollout drafts it from its first token on, as later siblings do
  from the bank; tokens are plain decoding's, also with a history that predicts nothing."""
  model = models["llama3"]
  params = SamplingParams(temperature=0, max_new_tokens=40)
  config = configured(with_sd(CONFIG, "s4_1_5", sd_max_batch=1), batch_buckets=(1,), suffix_history_len=96)
  engine, prompt = Engine(model, config, params), [5, 9, 13]
  first = engine.generate([prompt])
  history = suffix.History(config.suffix_history_len, config.suffix_ngram)
  history.add(prompt, [first.samples[0].tokens])
  again = engine.generate([prompt], history=[history.get(prompt)])
  assert sample_set(again) == sample_set(first)
  assert sum(s.passes for s in first.metrics.segments) > 8 == sum(s.passes for s in again.metrics.segments)
  noise = [np.random.default_rng(0).integers(0, 50, 90)]
  sampled = SamplingParams(temperature=1.0, max_new_tokens=40, seed=3)
  assert (sample_set(Engine(model, config, sampled).generate([prompt], num_samples=2, history=noise))
          == plain(model, sampled, [prompt], num_samples=2))
  with pytest.raises(ValueError, match="history has 2 entries for 1 prompts"):
    engine.generate([prompt], history=noise * 2)


def test_suffix_speculation_on_a_mesh(models, plain):
  """Rows split over two devices, the bank replicated: plain decoding's greedy tokens."""
  from tlt_jax import sharding
  model = models["qwen2_tied"]
  params = SamplingParams(temperature=0, max_new_tokens=24, stop_token_ids=(STOP,))
  config = configured(with_sd(CONFIG, "s3_2_5"), batch_buckets=(1, 2, 4))
  mesh = sharding.make_mesh({"data": 2}, jax.devices()[:2])
  engine = Engine(model, config, params, mesh=mesh)
  engine.set_params(jax.device_put(engine.params, sharding.param_shardings(engine.params, mesh)))
  ps = prompts(2, seed=70)
  rollout = engine.generate(ps, num_samples=2)
  assert rollout.metrics.verify_passes > 0
  assert sample_set(rollout) == plain(model, params, ps, num_samples=2)


def test_the_bank_follows_prompts_through_compaction(models):
  """Each row's bank region holds its tokens and its bank row its prompt (right-aligned), after plain
  and suffix segments; compaction drops finished rows but keeps their tokens in the bank."""
  model = models["qwen3"]
  config = configured(with_sd(CONFIG, "s3_2_5"), suffix_bank_len=64)  # regions of 20 slots: 19 tokens banked
  engine = Engine(model, config, SamplingParams(temperature=1.0, max_new_tokens=40, seed=1))
  ps = [p[:10] for p in prompts(2, seed=60)]
  rows = [(0, 0), (0, 1), (1, 0), (1, 1)]
  engine.prepare(4, [len(p) for p in ps])
  bank = engine._bank_rows(rows)
  slots = np.arange(4, dtype=np.int32)
  st = engine.pool[("init", 4)](engine._slot_rows(rows, slots, [6, 40], 0, bank), None)
  st = engine._prefill_slots(st, ps, rows, slots, None, np.zeros((4,), np.int32), None)
  params = engine.params, engine.drafter_params
  st = engine.pool[("plain", 4)](*params, st, np.int32(0), None, np.int32(8))

  def check(st, expected):
    host = jax.device_get(st)
    assert (host.bank_row == host.prompt_index).all()  # prompt i took bank row i: the first free one
    np.testing.assert_array_equal(host.bank_offset, 24 + 20 * host.sample_index)
    assert (host.bank_room == 19).all()
    for (i, j), tokens in expected.items():
      r = host.bank[i]
      np.testing.assert_array_equal(r[24 - len(ps[i]):24], ps[i])
      assert (r[:24 - len(ps[i])] == -1).all()
      region = r[24 + 20 * j:24 + 20 * (j + 1)]
      n = min(len(tokens), 19)
      np.testing.assert_array_equal(region[:n], tokens[:n])
      assert (region[n:] == -1).all()

  host = jax.device_get(st)
  tokens = {rows[r]: host.tokens[r, :host.num_generated[r]] for r in range(4)}
  assert host.done[:2].all() and not host.done[2:].any()  # prompt 0's budget of 6 is used up
  check(st, tokens)
  st = engine._halve(st, np.asarray([3, 2], np.int32), 4)  # prompt 1's rows, in reverse order  # pylint: disable=protected-access
  st = engine.pool[("speculate", 2, "s3_2_5")](*params, st, np.int32(0), None, np.int32(8))
  host = jax.device_get(st)
  assert host.sample_index.tolist() == [1, 0] and (host.num_generated > 12).all()
  tokens.update({rows[3 - r]: host.tokens[r, :host.num_generated[r]] for r in range(2)})
  check(st, tokens)


def tiny_vocab_model(dtype="float32"):
  """`dtype`: the compute dtype (its weights float32: a bfloat16 RL policy's rollout reads them cast)."""
  cfg = ModelConfig("Qwen3ForCausalLM", vocab_size=6, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                    num_kv_heads=1, head_dim=8, qk_norm=True, tie_word_embeddings=True)
  model = CausalLM(cfg, dtype=dtype, param_dtype="float32", rngs=nnx.Rngs(3))
  nnx.update(model, jax.tree.map(lambda x: x * 4, nnx.state(model, nnx.Param)))  # varied, context-dependent
  return model


FIRST_TOKENS = EngineConfig(batch_buckets=tuple(2**i for i in range(12)), max_prompt_len=4, max_new_tokens=3,
                            kv_block=16, segment_steps=4, compact=False)


@functools.cache
def plain_first_tokens(dtype, seed, n):
  """Plain sampling's first 3 tokens of n samples of `tiny_vocab_model(dtype)` (shared by the drafters' cases)."""
  params = SamplingParams(temperature=1.0, max_new_tokens=3, seed=seed)
  rollout = Engine(tiny_vocab_model(dtype), FIRST_TOKENS, params).generate([[1, 2, 3]], num_samples=n)
  return np.asarray([s.tokens for s in rollout.samples])


@pytest.mark.parametrize("drafter_kind", ["random", "distilled", "reduced", "bfloat16 target"])
def test_speculative_first_three_tokens_follow_plain_sampling(drafter_kind):
  """Independent seeds: the two-sample chi-square of marginals and the 2-token joint, against plain
  sampling of the same target (a bfloat16 one: its own distribution, rounding included)."""
  from scipy import stats
  from tlt_jax.drafter import train
  dtype = "bfloat16" if drafter_kind == "bfloat16 target" else "float32"
  model = tiny_vocab_model(dtype)
  n = 20_480
  plain = plain_first_tokens(dtype, seed=1, n=n)
  # "reduced": a random drafter whose head drafts only tokens 0, 2 and 5 of the 6.
  drafter = Drafter(model.config, draft_vocab=(0, 2, 5) if drafter_kind == "reduced" else (), rngs=nnx.Rngs(4))
  if drafter_kind == "distilled":  # trained on the target's own samples: it proposes likely tokens
    samples = plain_first_tokens(dtype, seed=3, n=256)
    result = train.distill(model, drafter, [([1, 2, 3], s.tolist()) for s in samples], steps=30, batch_rows=8,
                           row_len=64, lr=1e-2)
    assert result.losses[-1] < result.losses[0]
  spec_engine = Engine(model, with_sd(FIRST_TOKENS, "2_2_4", sd_max_batch=2048), SamplingParams(temperature=1.0,
                       max_new_tokens=3, seed=2), drafter=drafter)
  rollout = spec_engine.generate([[1, 2, 3]], num_samples=n)
  spec = np.asarray([s.tokens for s in rollout.samples])
  if drafter_kind == "distilled":
    assert rollout.metrics.accept_len > 1.3  # at most 2 here: the first token comes from the prefill
    # With plain decoding's seed the accepted runs (cut by the 3-token budget) are the plain samples.
    np.testing.assert_array_equal(spec, plain_first_tokens(dtype, seed=2, n=n))
  vocab = model.config.vocab_size

  def two_sample(a, b, cells):
    table = np.stack([np.bincount(a, minlength=cells), np.bincount(b, minlength=cells)])
    table = table[:, table.sum(0) > 0]
    return stats.chi2_contingency(table).pvalue

  for j in range(3):
    assert two_sample(plain[:, j], spec[:, j], vocab) > 1e-3, f"token {j}"
  assert two_sample(plain[:, 0] * vocab + plain[:, 1], spec[:, 0] * vocab + spec[:, 1], vocab**2) > 1e-3
  assert len(np.unique(plain[:, 1])) > 2  # the distributions are not degenerate


def test_bandit_picks_strategies_losslessly_without_compiling(models, plain):
  """One segment executable per (bucket, arm); the bandit plays every arm (EAGLE, suffix, SD off),
  exploring in short plays, outputs equal plain greedy ones, nothing compiles inside the rollouts."""
  model = models["qwen3"]
  strategies = (Strategy.parse("3_1_3"), Strategy.parse("2_2_3"), Strategy.parse("s3_2_4"))
  config = EngineConfig(**{**CONFIG.__dict__, "strategies": strategies, "sd_max_batch": 4})
  params = GREEDY
  bandit = Bandit(strategies, epsilon=0.1)
  engine = Engine(model, config, params, drafter=Drafter(model.config, rngs=nnx.Rngs(5)), bandit=bandit)
  ps = prompts(4, seed=12)
  engine.prepare(len(ps), [len(p) for p in ps])
  kinds = [k[0] for k in engine.pool.keys()]
  assert {k for k in engine.pool.keys() if k[0] == "speculate"} == {
      ("speculate", b, s.name) for b in (1, 2, 4) for s in strategies}
  assert {k for k in engine.pool.keys() if k[0] == "plain"} == {("plain", b) for b in (1, 2, 4)}
  stats = engine.pool.stats()
  assert stats["executables"] == len(kinds) and stats["compile_s"] > 0 and stats["memory_bytes"] > 0
  with profile.count_compilations() as compiles:
    rollouts = [engine.generate(ps) for _ in range(2)]  # the bandit persists across rollouts
  assert not compiles, f"the rollout compiled {compiles}"
  expected = plain(model, params, ps)
  assert all(sample_set(r) == expected for r in rollouts)
  plays = {arm: sum(b[arm]["plays"] for b in bandit.stats().values()) for arm in ("off", "3_1_3", "2_2_3", "s3_2_4")}
  assert all(n > 0 for n in plays.values())  # every arm, SD off included, was tried
  probes = [s for r in rollouts for s in r.metrics.segments if s.probe]
  assert len(probes) >= 4 and all(s.tail for s in probes)  # each arm's first play explores
  summaries = [r.metrics.summary() for r in rollouts]
  assert summaries[0]["rollout/sd_s"] > 0 and summaries[0]["rollout/probe_s"] > 0  # unseen arms first: explored
  segments = [s for r in rollouts for s in r.metrics.segments]
  assert sum(v for s in summaries for k, v in s.items() if k.startswith("bandit/")) == sum(s.tail for s in segments)
  # An executable's first run (XLA's one-time setup) is no reward; every later tail play is one.
  assert [(s.bucket, s.strategy) for s in segments if s.first_run] == list(dict.fromkeys(
      (s.bucket, s.strategy) for s in segments))
  assert sum(plays.values()) == sum(s.tail and not s.first_run for s in segments)
  # Each rewarded play reaches the bandit with its tokens per row, decode steps and seconds.
  rewarded = [(s.tokens / s.active_rows, s.steps, s.seconds) for s in segments if s.tail and not s.first_run]
  window = [tuple(p[1:]) for w in bandit.state_dict()["plays_window"] for p in w]
  assert sorted(window) == sorted(rewarded)
  for r, summary in zip(rollouts, summaries):
    m = r.metrics
    assert summary["rollout/tokens"] == sum(len(s.tokens) for s in r.samples)
    assert summary["rollout/sd_s"] + summary["rollout/plain_s"] == pytest.approx(m.decode_s)
    assert 0 <= summary["rollout/sd_share"] < 1
    assert summary["rollout/probe_s"] == pytest.approx(sum(s.seconds for s in m.segments if s.probe))
    assert summary["rollout/probe_share"] == pytest.approx(summary["rollout/probe_s"] / m.wall_s)
    assert summary["rollout/accept_len"] >= 1 or summary["rollout/sd_s"] == 0
    # A play is one segment of up to segment_steps iterations; its steps are its longest row's. An
    # exploring play (an arm measured) runs a quarter of that.
    assert all(1 <= s.steps <= CONFIG.segment_steps and s.steps <= s.passes for s in m.segments)
    assert all(s.steps <= CONFIG.probe_steps < CONFIG.segment_steps for s in m.segments if s.probe)
    assert sum(v for k, v in summary.items() if k.startswith("rollout/steps/")) == sum(s.steps for s in m.segments)
    assert all(isinstance(v, (int, float)) for v in summary.values())
  with pytest.raises(ValueError, match="need a bandit"):
    Engine(model, config, params, drafter=Drafter(model.config, rngs=nnx.Rngs(5)))


def test_pallas_kernels_give_the_greedy_tokens_of_transformers(models, hf_dirs):
  """Plain and speculative steps (verify trees, the drafter's window) with each Pallas kernel,
  interpreted on CPU, give transformers' greedy tokens, like the XLA path
  (test_greedy_matches_transformers_generate, test_speculative_greedy_is_identical_for_any_drafter)."""
  model = models["qwen3"]  # head dim 16: the smallest the GPU kernel takes
  drafter = Drafter(model.config, rngs=nnx.Rngs(1))
  params = SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=(STOP,))
  config = with_sd(EngineConfig(batch_buckets=(1, 2), max_prompt_len=16, max_new_tokens=8, kv_block=16,
                                segment_steps=2), "2_2_4", sd_max_batch=1)
  ps = prompts(2, seed=21)
  limits = [len(p) + 3 + 5 * i for i, p in enumerate(ps)]  # one row ends early: the other speculates
  expected = []
  for p, limit in zip(ps, limits):
    with torch.no_grad():
      out = hf_dirs["qwen3"][1].generate(torch.tensor([p]), max_new_tokens=limit - len(p), do_sample=False,
                                         eos_token_id=STOP, pad_token_id=0)
    expected.append(out[0, len(p):].tolist())
  # Over a paged cache: the kernels read a contiguous one as the table of one page per row (the
  # kernel tests check both against brute force).
  for attention, page_size in (("pallas_tpu", 16), ("pallas_gpu", 16)):
    engine = Engine(model, configured(config, attention=attention, page_size=page_size), params, drafter=drafter)
    rollout = engine.generate(ps, max_total_len=limits)
    assert {s.strategy for s in rollout.metrics.segments} == {None, "2_2_4"}, attention
    assert [s.tokens.tolist() for s in rollout.samples] == expected, (attention, page_size)


def test_nan_drafter_turns_speculation_off_losslessly(models, caplog):
  """A drafter with NaN params: the guard sees it at the prefill's feed, the rollout decodes plain,
  greedy outputs equal the finite drafter's (which equal plain decoding, tested above), and a
  warning and the metric say so. One bucket, one prompt bucket: few executables to compile."""
  model = models["qwen3"]
  config = EngineConfig(**{**with_sd(CONFIG, "2_1_2", sd_max_batch=4).__dict__, "compact": False})
  params = SamplingParams(temperature=0, max_new_tokens=16, stop_token_ids=(STOP,))
  engine = Engine(model, config, params, drafter=Drafter(model.config, rngs=nnx.Rngs(3)))
  ps = [p[:12] for p in prompts(3, seed=21)]
  good = engine.generate(ps)
  assert not good.metrics.drafter_nonfinite and good.metrics.verify_passes > 0
  engine.set_drafter_params(jax.tree.map(lambda x: np.full(x.shape, np.nan, x.dtype), engine.drafter_params))
  with caplog.at_level("WARNING"):
    bad = engine.generate(ps)
  assert sample_set(bad) == sample_set(good)
  assert bad.metrics.drafter_nonfinite and bad.metrics.summary()["rollout/drafter_nonfinite"] == 1
  assert not any(s.strategy for s in bad.metrics.segments)
  assert "its strategies are off for the rest of this rollout" in caplog.text


def test_nan_drafter_leaves_suffix_arms_on(models, plain):
  """With an EAGLE and a suffix arm under a bandit, a NaN drafter turns the EAGLE arm off; the
  bandit plays SD off and the suffix arm, and the tokens are plain decoding's."""
  model = models["qwen3"]
  strategies = (Strategy.parse("2_1_2"), Strategy.parse("s3_1_4"))
  config = EngineConfig(**{**CONFIG.__dict__, "strategies": strategies, "sd_max_batch": 8, "compact": False,
                            "segment_steps": 4})
  params = GREEDY
  bandit = Bandit(strategies, epsilon=0.0)
  engine = Engine(model, config, params, drafter=Drafter(model.config, rngs=nnx.Rngs(3)), bandit=bandit)
  engine.set_drafter_params(jax.tree.map(lambda x: np.full(x.shape, np.nan, x.dtype), engine.drafter_params))
  ps = [p[:12] for p in prompts(3, seed=22)]
  bad = engine.generate(ps, num_samples=2)
  assert bad.metrics.drafter_nonfinite
  assert {s.strategy for s in bad.metrics.segments} == {None, "s3_1_4"}
  assert sample_set(bad) == plain(model, params, ps, num_samples=2)


@pytest.mark.parametrize("sampling,strategy", [(dict(temperature=0), None), (dict(temperature=1.0, top_p=0.9), None),
                                               (dict(temperature=0), "3_2_6"), (dict(temperature=1.0), "2_1_3")])
def test_refill_equals_rows_run_one_by_one_and_in_waves(models, sampling, strategy):
  """18 rows through a largest bucket of 8: refilled, in waves, and each row alone (a bucket of one)
  give every row the same tokens; with a drafter, the tail after the last refill speculates."""
  model = models["qwen3"]
  params = SamplingParams(max_new_tokens=40, stop_token_ids=(STOP, 2, 3, 4), seed=7, **sampling)
  drafter = Drafter(model.config, rngs=nnx.Rngs(1)) if strategy else None
  config = with_sd(CONFIG, strategy, sd_max_batch=2) if strategy else CONFIG
  ps = prompts(6, seed=40)
  limits = [len(p) + 6 + 7 * i for i, p in enumerate(ps)]  # budgets end at different places
  engine = Engine(model, config, params, drafter=drafter)
  engine.prepare(18, [len(p) for p in ps])
  with profile.count_compilations() as compiles:
    refilled = engine.generate(ps, num_samples=3, max_total_len=limits)
  assert not compiles, f"the refilled rollout compiled {compiles}"
  m = refilled.metrics
  assert m.refills > 0 and max(m.buckets()) == 8 and ("reset", 8) in engine.pool.keys()
  # A refill of a chunk of 2 slots prefills 2 prompts per call (one prompt's samples: 1), not a full call's 8.
  assert {k[2] for k in engine.pool.keys() if k[:2] == ("prefill", 8)} == {1, 2, 8}
  assert sorted(m.started) == [(i, j) for i in range(6) for j in range(3)]
  assert m.tokens == sum(len(s.tokens) for s in refilled.samples)
  assert sum(s.tokens for s in m.segments) + len(refilled.samples) == m.tokens  # each row's first token: its prefill
  assert all(s.waiting == 0 or s.bucket == 8 for s in m.segments)  # the batch stays full while rows wait
  if strategy:
    assert any(s.strategy for s in m.segments) and all(s.active_rows <= 2 for s in m.segments if s.strategy)
  alone = Engine(model, configured(CONFIG, batch_buckets=(1,), refill=False), params).generate(
      ps, num_samples=3, max_total_len=limits)
  assert sample_set(refilled) == sample_set(alone)
  if not strategy:  # waves are the path the speculative tests above cover
    engine = Engine(model, configured(config, refill=False), params)
    engine.prepare(18, [len(p) for p in ps])  # the last wave's bucket (2 rows) included
    with profile.count_compilations() as compiles:
      waves = engine.generate(ps, num_samples=3, max_total_len=limits)
    assert not compiles, f"the rollout in waves compiled {compiles}"
    assert waves.metrics.refills == 0 and waves.metrics.buckets().count(8) < len(waves.metrics.buckets())
    assert sample_set(waves) == sample_set(alone)
    # One tail instead of one per wave: fewer decode steps (batch forward passes) for the same tokens.
    steps = lambda metrics: sum(s.steps for s in metrics.segments)
    assert steps(m) < steps(waves.metrics), (steps(m), steps(waves.metrics))
  assert len({len(t) for t in sample_set(alone).values()}) > 4  # rows finish at many different times


@pytest.fixture(scope="module")
def refill_engine(models):
  """Sampling with early stops through a largest bucket of 4: 9 or 18 rows are refilled."""
  params = SamplingParams(temperature=1.0, max_new_tokens=30, stop_token_ids=(STOP, 2, 3), seed=11)
  engine = Engine(models["llama3"], configured(CONFIG, batch_buckets=(1, 2, 4)), params)
  engine.prepare(18, [len(p) for p in prompts(6, seed=41)])
  return engine


def test_refilled_shards_sample_what_one_engine_samples(refill_engine):
  """Data-parallel rollout groups each run a shard of the prompts at its `prompt_offset` (as
  tlt_jax.rollout.tlt does); refilled shards sample what one refilled rollout does, compiling nothing."""
  ps = prompts(6, seed=41)
  with profile.count_compilations() as compiles:
    whole = refill_engine.generate(ps, num_samples=3)
    shards = [refill_engine.generate(ps[a:a + 3], num_samples=3, prompt_offset=a) for a in (0, 3)]
  assert not compiles, f"a refilled rollout compiled {compiles}"
  assert all(r.metrics.refills > 0 for r in [whole, *shards])
  assert sample_set(whole) == {**sample_set(shards[0]), **sample_set(shards[1])}


def test_longest_expected_first_changes_the_order_not_the_tokens(refill_engine):
  ps = prompts(6, seed=41)
  in_order = refill_engine.generate(ps, num_samples=3)
  rows = [(i, j) for i in range(6) for j in range(3)]
  assert in_order.metrics.started == rows
  # Expected lengths from an earlier epoch: here the mean response length of the rollout above.
  expected = [np.mean([len(s.tokens) for s in in_order.samples if s.prompt_index == i]) for i in range(6)]
  longest = refill_engine.generate(ps, num_samples=3, expected_lengths=expected)
  assert longest.metrics.started == sorted(rows, key=lambda r: -expected[r[0]])
  assert longest.metrics.started[4:8] != in_order.metrics.started[4:8]  # the first refills take other rows
  assert sample_set(longest) == sample_set(in_order)
  with pytest.raises(ValueError, match="expected_lengths has 5 entries for 6 prompts"):
    refill_engine.generate(ps, expected_lengths=expected[:5])


# ---- paged KV caches ----
def long_prompts(n, seed):
  """Prompts of 17-24 tokens: with 16-slot pages, each has a full page its samples share."""
  rng = np.random.RandomState(seed)
  return [rng.randint(2, VOCAB, rng.randint(17, 25)).tolist() for _ in range(n)]


@pytest.mark.parametrize("params,strategy", [(SAMPLED, None), (GREEDY, "3_2_6")], ids=["sampled", "greedy-3_2_6"])
def test_a_paged_cache_gives_the_contiguous_tokens(models, plain, params, strategy):
  """18 rows (6 prompts x 3 samples sharing their prompt's first page) through a bucket of 8 with
  16-slot pages: a pool as large as the contiguous cache (sampled), and one of 8 pages (one row's
  worth and a bit) that forces rows to wait for pages and preempts some (resumed with their tokens;
  sampled, and greedy while speculating), give every row plain decoding's tokens on a contiguous
  cache, compiling nothing in the rollout; the small pool still has more rows in flight than the one
  its bytes hold as a contiguous row."""
  model = models["qwen3"]
  drafter = Drafter(model.config, rngs=nnx.Rngs(3)) if strategy and not strategy.startswith("s") else None
  config = with_sd(CONFIG, strategy, sd_max_batch=4) if strategy else CONFIG
  ps = long_prompts(6, seed=80)
  limits = [len(p) + 6 + 7 * i for i, p in enumerate(ps)]
  expected = plain(model, params, ps, num_samples=3, max_total_len=limits)
  for num_pages in (8,) if strategy else (0, 8):
    engine = Engine(model, configured(config, page_size=16, num_pages=num_pages), params, drafter=drafter)
    engine.prepare(18, [len(p) for p in ps])
    with profile.count_compilations() as compiles:
      rollout = engine.generate(ps, num_samples=3, max_total_len=limits)
    assert not compiles, f"the paged rollout compiled {compiles}"
    assert sample_set(rollout) == expected, num_pages
    m = rollout.metrics
    assert m.tokens == sum(len(s.tokens) for s in rollout.samples)
    assert m.peak_pages <= engine.config.pool_pages
    if num_pages:
      assert m.preemptions > 0 and m.peak_rows > num_pages // engine.config.pages_per_row, m
      assert m.resumed_tokens >= m.preemptions  # preempted rows came back with their tokens
    else:
      assert m.preemptions == 0 and m.peak_rows == 8
    if strategy:
      assert m.verify_passes > 0


def test_a_paged_cache_on_a_mesh(models, plain):
  """Rows over two devices with a pool split like them (page tables of global page indices), sampled
  and speculating with suffix drafts: plain decoding's tokens on one device with a contiguous cache."""
  from tlt_jax import sharding
  model = models["qwen2_tied"]
  params = SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=(STOP,), seed=2)
  config = configured(with_sd(CONFIG, "s3_2_5"), batch_buckets=(1, 2, 4), page_size=16, num_pages=16)
  mesh = sharding.make_mesh({"data": 2}, jax.devices()[:2])
  engine = Engine(model, config, params, mesh=mesh)
  engine.set_params(jax.device_put(engine.params, sharding.param_shardings(engine.params, mesh)))
  ps = long_prompts(3, seed=81)
  rollout = engine.generate(ps, num_samples=2)
  assert sample_set(rollout) == plain(model, params, ps, num_samples=2)


def test_pallas_kernels_over_a_paged_cache_on_a_mesh(models, plain):
  """Rows over two devices, each holding its rows' pages in its range of the pool (the kernels run per
  device, interpreted here), refilled, preempting and speculating with the drafter: plain decoding's
  greedy tokens on one device with a contiguous cache."""
  from tlt_jax import sharding
  model = models["qwen3"]  # head dim 16: the smallest the GPU kernel takes
  drafter = Drafter(model.config, rngs=nnx.Rngs(1))
  params = SamplingParams(temperature=0, max_new_tokens=16, stop_token_ids=(STOP,))
  config = with_sd(EngineConfig(batch_buckets=(1, 2, 4), max_prompt_len=24, max_new_tokens=16, kv_block=16,
                                segment_steps=4, attention="pallas_gpu", page_size=16, num_pages=8), "2_2_4",
                   sd_max_batch=4)
  mesh = sharding.make_mesh({"data": 2}, jax.devices()[:2])
  engine = Engine(model, config, params, mesh=mesh, drafter=drafter)
  assert engine.page_shards == 2  # so bucket 1 is not used: a row per device at least
  engine.set_params(jax.device_put(engine.params, sharding.param_shardings(engine.params, mesh)))
  engine.set_drafter_params(jax.device_put(engine.drafter_params, sharding.param_shardings(engine.drafter_params,
                                                                                          mesh)))
  ps = long_prompts(3, seed=84)
  # The first budgets leave the last two rows on one device (compaction waits: moving a row to
  # the other device would leave its pages behind); the second let the tail compact.
  for budgets, buckets in (((16, 16, 4), {4}), ((16, 12, 4), {2, 4})):
    limits = [len(p) + n for p, n in zip(ps, budgets)]
    rollout = engine.generate(ps, num_samples=2, max_total_len=limits)
    assert sample_set(rollout) == plain(model, params, ps, num_samples=2, max_total_len=limits)
    assert rollout.metrics.preemptions > 0 and rollout.metrics.verify_passes > 0, rollout.metrics
    assert set(rollout.metrics.buckets()) == buckets  # never below a row per device
  with pytest.raises(ValueError, match="num_pages=9 must split into 2 equal ranges"):
    Engine(model, configured(config, num_pages=9), params, mesh=mesh, drafter=drafter)
