"""DataBuffer: pairing of captured features, segment isolation of packed rows, bounds, offset rule,
state round trip (what a resumed run trains on) and its size bound."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from tlt_jax.drafter import train
from tlt_jax.drafter.buffer import BufferConfig, DataBuffer
from tlt_jax.drafter.model import Drafter
from tlt_jax.models import CausalLM, ModelConfig

H = 16


PROMPTS = [[5]]  # prompt 0: one token, so every slot of a sample is a response pair


@dataclasses.dataclass
class FakeSample:  # the fields of rollout.engine.Sample the buffer reads
  prompt_index: int
  sample_index: int
  tokens: np.ndarray
  hidden: np.ndarray
  prompt_hidden: np.ndarray


def sample(n, tag=0, seed=0, prompt_len=1, prompt_index=0):
  """A response of n tokens; token values carry `tag` so batches show where they came from."""
  rng = np.random.default_rng(seed)
  return FakeSample(prompt_index, 0, np.full(n, tag, np.int32), rng.normal(size=(n, H)).astype(np.float32),
                    rng.normal(size=(prompt_len, H)).astype(np.float32))


def test_pairs_are_feature_t_token_t_plus_1_and_windows_cover_the_response():
  buf = DataBuffer(BufferConfig(eval_every=0))
  s = sample(11, seed=1)
  s.tokens = np.arange(11, dtype=np.int32)
  buf.add(0, [s], PROMPTS)
  pairs = buf.batch(np.random.default_rng(0), rows=2, row_len=6)  # 10 pairs: windows of 6 and 4
  real = pairs.segments > 0
  assert real.sum() == 10 and pairs.weights.sum() == 10
  got = {int(t): (h, nh) for t, h, nh in zip(pairs.tokens[real], pairs.hidden[real], pairs.next_hidden[real])}
  for i in range(10):  # slot with token x_i holds hidden[i] and predicts hidden[i + 1]
    np.testing.assert_array_equal(got[i][0], s.hidden[i])
    np.testing.assert_array_equal(got[i][1], s.hidden[i + 1])
  assert sorted(pairs.positions[real].tolist()) == sorted(list(range(6)) + list(range(4)))
  assert not pairs.hidden[~real].any() and not pairs.next_hidden[~real].any()


def test_packed_loss_is_the_pair_weighted_mean_of_per_sample_losses():
  cfg = ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=32, hidden_size=H, intermediate_size=32,
                    num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, qk_norm=True, tie_word_embeddings=True)
  target = CausalLM(cfg, rngs=nnx.Rngs(0))
  drafter = Drafter(cfg, rngs=nnx.Rngs(1))
  evaluate = train.make_eval_step(drafter, target)
  dp, tp = nnx.state(drafter), nnx.state(target)
  prompts = [[3, 4, 5], [6], [7, 8]]  # prompt slots are context: attended to, never trained on
  samples = [sample(n, seed=n, prompt_len=len(p), prompt_index=i) for i, (n, p) in enumerate(zip((5, 9, 4), prompts))]
  for i, s in enumerate(samples):
    s.tokens = np.random.default_rng(i).integers(0, 32, len(s.tokens)).astype(np.int32)
  metrics = lambda batch: {k: float(v) for k, v in evaluate(dp, tp, batch).items()}

  def alone(s):
    buf = DataBuffer(BufferConfig(eval_every=0))
    buf.add(0, [s], prompts)
    return metrics(buf.batch(np.random.default_rng(0), rows=1, row_len=24))

  buf = DataBuffer(BufferConfig(eval_every=0))
  buf.add(0, samples, prompts)
  batch = buf.batch(np.random.default_rng(0), rows=1, row_len=24)
  assert len(np.unique(batch.segments[0])) == 4  # three samples and padding share the row
  packed = metrics(batch)
  singles = [alone(s) for s in samples]
  counts = np.asarray([m["pairs"] for m in singles])
  assert packed["pairs"] == counts.sum() == 4 + 8 + 3  # response pairs only
  for key in ("loss", "feature_loss", "logit_loss", "top1"):
    np.testing.assert_allclose(packed[key], np.dot(counts, [m[key] for m in singles]) / counts.sum(), rtol=1e-5)


def test_packed_holds_every_training_pair_once():
  buf = DataBuffer(BufferConfig(eval_every=0))
  with pytest.raises(ValueError, match="no training samples"):
    buf.packed(row_len=8)
  buf.add(0, [sample(n, tag=n, seed=n) for n in (3, 9, 20)], PROMPTS)
  pairs = buf.packed(row_len=8)
  real = pairs.segments > 0
  assert pairs.tokens.shape == (4, 8) and pairs.weights.sum() == 2 + 8 + 19  # windows 2 + 3 | 8 | 8 | 8
  assert sorted(pairs.tokens[real].tolist()) == [3] * 2 + [9] * 8 + [20] * 19


def test_bound_evicts_oldest_first():
  buf = DataBuffer(BufferConfig(max_pairs=30, eval_every=0, long_fraction=1.0))
  for step in range(3):
    for k in range(4):
      buf.add(step, [sample(9, tag=10 * step + k)], PROMPTS)  # 8 pairs each
      assert buf.num_pairs <= 30
  assert [int(e.tokens[0]) for e in buf.entries] == [21, 22, 23]
  with pytest.raises(ValueError, match="cannot add samples of the earlier step 1"):
    buf.add(1, [sample(3)], PROMPTS)


def test_offset_rule_mixes_this_step_with_the_previous_steps_long_samples():
  buf = DataBuffer(BufferConfig(long_fraction=0.25, eval_every=0))
  buf.add(0, [sample(40, tag=1)], PROMPTS)  # step 0: gone two steps later
  buf.add(1, [sample(n, tag=n) for n in (3, 5, 30, 4, 6, 7, 25, 8)], PROMPTS)  # the longest quarter: 30 and 25
  buf.add(2, [sample(4, tag=99)], PROMPTS)
  assert sorted(len(e.tokens) for e in buf.entries if e.step == 1) == [25, 30]
  seen = set()
  for seed in range(20):
    batch = buf.batch(np.random.default_rng(seed), rows=1, row_len=40)
    seen |= set(batch.tokens[batch.segments > 0].tolist())
  assert seen == {99, 30, 25}
  assert buf.metadata() == {"step": 2, "entries": 3, "pairs": 3 + 29 + 24, "added": 10}


def test_held_out_samples_are_not_trained_on():
  buf = DataBuffer(BufferConfig(eval_every=3))
  buf.add(0, [sample(5, tag=k) for k in range(1, 7)], PROMPTS)
  assert [int(e.tokens[0]) for e in buf.held_out_entries()] == [3, 6]
  batch = buf.batch(np.random.default_rng(0), rows=2, row_len=16)
  assert set(batch.tokens[batch.segments > 0].tolist()) == {1, 2, 4, 5}
  held = buf.eval_batch(rows=1, row_len=16)
  assert set(held.tokens[held.segments > 0].tolist()) == {3, 6}
  with pytest.raises(ValueError, match=r"sample \(prompt 0, sample 0\) has no hidden states"):
    buf.add(0, [FakeSample(0, 0, np.zeros(3, np.int32), None, None)], PROMPTS)


def test_prompt_slots_are_weightless_context_and_the_pairing_crosses_into_the_response():
  buf = DataBuffer(BufferConfig(eval_every=0))
  s = sample(4, seed=2, prompt_len=3)
  s.tokens = np.asarray([20, 21, 22, 23], np.int32)
  buf.add(0, [s], [[10, 11, 12]])
  pairs = buf.batch(np.random.default_rng(0), rows=1, row_len=8)
  n = 5  # slots t = 0..4 of x_0..x_6: (f_t, x_{t+1}) -> f_{t+1}; f_0..f_2 from the prompt, f_2 = hidden[0]
  f = np.concatenate([s.prompt_hidden[:2], s.hidden])
  np.testing.assert_array_equal(pairs.tokens[0, :n], [11, 12, 20, 21, 22])
  np.testing.assert_array_equal(pairs.hidden[0, :n], f[:n])
  np.testing.assert_array_equal(pairs.next_hidden[0, :n], f[1:n + 1])
  np.testing.assert_array_equal(pairs.weights[0], [0, 0, 1, 1, 1, 0, 0, 0])
  np.testing.assert_array_equal(pairs.positions[0, :n], np.arange(n))
  short = buf.batch(np.random.default_rng(0), rows=4, row_len=2)  # the first window is all context: dropped
  assert short.weights.sum() == 3 and (short.segments > 0).sum() == 3
  with pytest.raises(ValueError, match=r"3 prompt and 4 response tokens but 2 and 4 hidden states"):
    buf.add(0, [dataclasses.replace(s, prompt_hidden=s.prompt_hidden[:2])], [[10, 11, 12]])



def test_slots_that_predict_tool_tokens_are_weightless_and_survive_a_checkpoint():
  """A tool turn's tokens (`Sample.tool_mask`) are context: the slots whose prediction is of one weigh 0."""
  buf = DataBuffer(BufferConfig(eval_every=0))
  s = sample(6, seed=3, prompt_len=3)
  s.tokens = np.asarray([20, 21, 22, 23, 24, 25], np.int32)
  s.tool_mask = np.asarray([False, False, True, True, False, False])
  buf.add(0, [s], [[10, 11, 12]])
  weights = [0, 0, 1, 0, 0, 1, 1, 0]  # slot t predicts x_{t+2}: prompt, 20, 21, [22, 23], 24, 25; padding
  np.testing.assert_array_equal(buf.batch(np.random.default_rng(0), rows=1, row_len=8).weights[0], weights)
  again = DataBuffer(BufferConfig(eval_every=0))
  again.load_state_dict(*buf.state_dict())
  np.testing.assert_array_equal(again.batch(np.random.default_rng(0), rows=1, row_len=8).weights[0], weights)


def _same_batches(a: DataBuffer, b: DataBuffer):
  same = lambda x, y: jax.tree.map(np.testing.assert_array_equal, x, y)
  for seed in range(3):
    rng = lambda: np.random.default_rng(seed)
    same(a.batch(rng(), rows=2, row_len=8), b.batch(rng(), rows=2, row_len=8))
  assert a.eval_batch(rows=2, row_len=8) is not None
  same(a.eval_batch(rows=2, row_len=8), b.eval_batch(rows=2, row_len=8))


@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
def test_state_round_trip_draws_the_same_batches_now_and_after_the_next_step(dtype):
  """A buffer rebuilt from `state_dict` (as a resumed run's is) holds the same entries: the same
  batches and held-out batch now, and after the next step's samples the same offset entries
  (the previous step's long ones) and held-out choice (the count of samples goes on)."""
  config = BufferConfig(eval_every=3, long_fraction=0.5)
  cast = lambda s: dataclasses.replace(s, hidden=s.hidden.astype(dtype), prompt_hidden=s.prompt_hidden.astype(dtype))
  prompts = [[5], [6, 7, 8]]
  step = lambda k: [cast(sample(n, tag=10 * k + n, seed=10 * k + n, prompt_len=len(prompts[n % 2]),
                                prompt_index=n % 2)) for n in (3, 9, 5, 12, 4)]
  empty = DataBuffer(config)
  arrays, meta = DataBuffer(config).state_dict()
  assert arrays["hidden"].shape == (0, 0)
  empty.load_state_dict(arrays, meta)  # an empty buffer's state round-trips too
  assert empty.entries == [] and empty.metadata() == DataBuffer(config).metadata()

  original = DataBuffer(config)
  for k in range(2):
    original.add(k, step(k), prompts)
  arrays, meta = original.state_dict()
  assert arrays["hidden"].dtype == np.dtype(dtype) and arrays["hidden"].shape == (len(arrays["tokens"]), H)
  assert json.loads(json.dumps(meta)) == meta
  resumed = DataBuffer(config)
  resumed.load_state_dict({k: v.copy() for k, v in arrays.items()}, meta)
  assert resumed.metadata() == original.metadata() and {e.step for e in resumed.entries} == {0, 1}
  _same_batches(original, resumed)
  saved = [e.tokens.tolist() for e in original.entries]
  for buf in (original, resumed):
    buf.add(2, step(2), prompts)
  assert resumed.metadata() == original.metadata()
  assert [e.tokens.tolist() for e in resumed.entries] == [e.tokens.tolist() for e in original.entries]
  assert [e.held_out for e in resumed.entries] == [e.held_out for e in original.entries]
  _same_batches(original, resumed)

  # A smaller bound in the resumed run's config applies (oldest out first); a state whose arrays
  # disagree is refused.
  small = DataBuffer(BufferConfig(max_pairs=12))
  small.load_state_dict(arrays, meta)
  kept = [e.tokens.tolist() for e in small.entries]
  assert 0 < small.num_pairs <= 12 and kept == saved[-len(kept):]
  with pytest.raises(ValueError, match=r"its entries hold \d+ tokens but it has \d+ tokens"):
    DataBuffer(config).load_state_dict({**arrays, "tokens": arrays["tokens"][1:]}, meta)


def test_state_bytes_bound_what_a_step_stores():
  """`BufferConfig.state_bytes` bounds `state_dict()`'s bytes (exactly, for samples of the longest
  length with no pair bound in reach), also when the pair bound evicts."""
  nbytes = lambda buf: sum(x.nbytes for x in buf.state_dict()[0].values())
  prompts, n = [[1, 2, 3]], 8
  longest = [sample(9, seed=k, prompt_len=3) for k in range(n)]  # 3 + 9 = 12 tokens: 10 pairs each
  for config in (BufferConfig(eval_every=0), BufferConfig(eval_every=0, max_pairs=25)):
    buf = DataBuffer(config)
    for k in range(3):
      buf.add(k, longest, prompts)
      assert nbytes(buf) <= config.state_bytes(n, 12, H, 4)
  # This step's 8 entries and the previous step's longest 2, 11 tokens and features each.
  unbounded = DataBuffer(BufferConfig(eval_every=0))
  for k in range(2):
    unbounded.add(k, longest, prompts)
  assert nbytes(unbounded) == 10 * 11 * (H * 4 + 4 + 1) + 10 * 4 * 4 == BufferConfig().state_bytes(n, 12, H, 4)
