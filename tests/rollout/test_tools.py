"""Tool turns in the engine: a row pauses at a turn that calls tools, the turn's tokens are appended with
its cache kept, and decoding goes on; lossless whatever the batch, the cache or the speculation."""

import concurrent.futures
import time

import numpy as np
import pytest
from flax import nnx

from tests.conftest import VOCAB
from tests.rollout.conftest import CONFIG, STOP, configured, prompts, with_sd
from tlt_jax.drafter.model import Drafter
from tlt_jax.rollout import profile
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.tools import Turn, Turns

STOPS = (STOP, *range(4, VOCAB, 4))  # a quarter of the vocabulary ends a turn, so that greedy rows do
CALLS = range(8, VOCAB, 8)  # a turn that ends with one of these calls the tool
GREEDY = SamplingParams(temperature=0, max_new_tokens=64, stop_token_ids=STOPS)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=64, stop_token_ids=STOPS, seed=4)


class Echo(Turns):
  """A tool whose tokens (2-13 of them, no stop token) are a function of the turn; it answers after a
  delay that also depends on the turn, in a thread, so rows come back out of order."""

  def __init__(self, max_turns=3, delay_s=0.0):
    self.max_turns, self.delay_s, self.turns = max_turns, delay_s, []
    self.pool = concurrent.futures.ThreadPoolExecutor(4)

  @staticmethod
  def answer(turn: np.ndarray) -> Turn:
    n = 2 + int(turn.sum()) % 12
    tokens = (np.arange(n) * 7 + int(turn[0])) % (VOCAB - 12) + 12
    return Turn(tokens.astype(np.int32), [{"name": "echo", "tokens": n}])

  def submit(self, turn):
    self.turns.append(turn.tolist())
    if turn[-1] not in CALLS:
      return None

    def run():
      time.sleep(self.delay_s * (int(turn.sum()) % 3))
      return self.answer(turn)
    return self.pool.submit(run)


def with_tools(samples):
  return {(s.prompt_index, s.sample_index): (s.tokens.tolist(), s.tool_mask.tolist(), s.finish_reason)
          for s in samples}


def reference(model, params, ps, budget, max_turns):
  """Turn by turn with a plain engine: each turn a new rollout from the prompt, the turns so far and
  the tool's tokens (prefilled, not appended), greedy."""
  engine = Engine(model, configured(CONFIG, max_prompt_len=24 + budget, compact=False), params)
  out = {}
  for i, p in enumerate(ps):
    tokens, mask, finish = [], [], "stop"
    for t in range(max_turns):
      s = engine.generate([p + tokens], max_total_len=len(p) + budget).samples[0]
      tokens, mask, finish = tokens + s.tokens.tolist(), mask + [False] * len(s.tokens), s.finish_reason
      if finish != "stop" or s.tokens[-1] not in CALLS or t == max_turns - 1:
        break
      turn = Echo.answer(s.tokens).tokens.tolist()
      if len(tokens) + len(turn) >= budget:
        finish = "length"
        break
      tokens, mask = tokens + turn, mask + [True] * len(turn)
    out[(i, 0)] = tokens, mask, finish
  return out


@pytest.fixture(scope="module")
def greedy_reference(models):
  ps = prompts(8, seed=21)
  return ps, reference(models["qwen3"], GREEDY, ps, 56, 3)


def test_greedy_turns_equal_turn_by_turn_decoding(models, greedy_reference):
  """Rows that call the tool (some twice, some past their budget), rows that do not, tools that answer
  late and out of order: every row's tokens and mask are those of decoding turn by turn, with the
  tool's tokens in the prompt, for plain decoding in a paged cache and EAGLE and suffix speculation,
  with refill and compaction."""
  model = models["qwen3"]
  ps, expected = greedy_reference
  assert sum(m.count(True) > 0 for m in (v[1] for v in expected.values())) >= 3, expected
  assert any(v[2] == "length" for v in expected.values()), expected
  drafter = Drafter(model.config, rngs=nnx.Rngs(1))
  small = configured(CONFIG, batch_buckets=(1, 2, 4))  # 8 rows: refilled, then compacted
  cases = [(configured(small, page_size=16), None), (with_sd(small, "3_1_4", sd_max_batch=4), drafter),
           (with_sd(small, "s4_1_5", sd_max_batch=4), None)]  # plain decoding: in the paged pool
  for config, d in cases:
    echo = Echo(delay_s=0.02)
    engine = Engine(model, config, GREEDY, drafter=d, turns=echo)
    engine.prepare(len(ps), [len(p) for p in ps])
    with profile.count_compilations() as compiles:
      rollout = engine.generate(ps, max_total_len=[len(p) + 56 for p in ps])
    assert not compiles, compiles
    assert with_tools(rollout.samples) == expected, config
    m = rollout.metrics
    assert m.tool_calls == sum(len(s.tool_calls) for s in rollout.samples) >= m.tool_turns
    assert m.tool_turns == sum(s.turns - 1 for s in rollout.samples) > 0
    assert m.tool_tokens == sum(int(s.tool_mask.sum()) for s in rollout.samples)
    assert m.tokens == sum(len(s.tokens) for s in rollout.samples) - m.tool_tokens
    if d is not None or config.strategies:
      assert m.verify_passes > 0
    assert (rollout.samples[0].logprobs[rollout.samples[0].tool_mask] == 0).all()


def test_sampled_turns_do_not_depend_on_batch_cache_or_speculation(models):
  """Sampled rows with tool turns: the same tokens with one row at a time, a batch with compaction and
  refill in a paged pool short enough to preempt, and EAGLE speculation (keys follow positions)."""
  model = models["llama3"]
  ps = prompts(4, seed=33)
  drafter = Drafter(model.config, rngs=nnx.Rngs(2))
  results = []
  for config, d in [(configured(CONFIG, batch_buckets=(1,)), None),
                    (configured(CONFIG, batch_buckets=(1, 2, 4), page_size=16, num_pages=12), None),
                    (with_sd(configured(CONFIG, batch_buckets=(1, 2, 4)), "3_2_6", sd_max_batch=4), drafter)]:
    rollout = Engine(model, config, SAMPLED, drafter=d, turns=Echo(delay_s=0.01)).generate(ps, num_samples=2)
    results.append(with_tools(rollout.samples))
  assert sum(True in m for _, m, _ in results[0].values()) >= 3, results[0]
  for r in results[1:]:
    assert r == results[0]


def test_max_turns_and_the_turns_submitted(models):
  """A row makes at most `max_turns` turns: the last one's tool is never called; each turn handed to
  `submit` is the row's tokens since its previous turn, ending with its stop token."""
  model = models["qwen3"]
  ps = prompts(8, seed=21)
  echo = Echo(max_turns=1)
  one = Engine(model, CONFIG, GREEDY, turns=echo).generate(ps, max_total_len=[len(p) + 56 for p in ps])
  assert all(not s.tool_mask.any() and not s.tool_calls for s in one.samples)
  assert echo.turns == []  # a first turn that is also the last is not handed over
  echo = Echo(max_turns=3)
  three = Engine(model, CONFIG, GREEDY, turns=echo).generate(ps, max_total_len=[len(p) + 56 for p in ps])
  for s in three.samples:
    starts = [0] + [i + 1 for i in np.flatnonzero(s.tool_mask[:-1] & ~s.tool_mask[1:])]
    ends = [i for i in np.flatnonzero(~s.tool_mask[:-1] & s.tool_mask[1:]) + 1]
    for a, b in zip(starts, ends):
      assert s.tokens[a:b].tolist() in echo.turns
      assert s.tokens[b - 1] in CALLS
    assert s.turns == len(starts) <= 3
