"""The actor: packed log-probs against transformers, chunking / remat invariance, micro-batch and
device-count invariance up to float rounding (and what a wrong gradient looks like beside it)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

from tests.conftest import VOCAB, float_order_mismatches
from tlt_jax import packing, sharding
from tlt_jax.models import hf, lora
from tlt_jax.rl import actor as actor_lib
from tlt_jax.rl import grpo

SEQS = [([3, 17, 9], [44, 2, 61, 8]), ([5, 6], [70, 71, 72, 73, 74, 75]), ([9, 9, 9, 4], [12, 1]),
        ([30], [31, 32, 33])]


def _torch_logprobs(torch_model, seq):
  with torch.no_grad():
    logits = torch_model(torch.tensor([seq])).logits[0].double()
  logp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
  return logp.numpy()


def test_packed_logprobs_match_transformers_per_sample(hf_dirs):
  path, torch_model = hf_dirs["qwen2_untied"]
  model = hf.from_pretrained(path)
  rows = packing.pack(SEQS, 16, index=True)
  for chunk in (1024, 5):  # one LM-head chunk, or several with padding
    logp, entropy = jax.jit(lambda r: actor_lib.token_logprobs(model, r[0], r[1], r[2], chunk=chunk))(rows)
    for i, (prompt, response) in enumerate(SEQS):
      r, slots = np.nonzero(rows[4] == i + 1)
      seq = prompt + response
      np.testing.assert_allclose(np.asarray(logp)[r[1:], slots[1:]], _torch_logprobs(torch_model, seq), atol=1e-4)
    assert np.all(np.asarray(entropy)[rows[3] > 0] > 0)


def _actor(model, micro_batch_rows, long_rows=False, loss=grpo.Objective()):
  """`long_rows`: the memory savers of long-sequence training (remat, attention by query blocks)."""
  return actor_lib.Actor(model, optax.sgd(0.1), micro_batch_rows=micro_batch_rows, loss=loss,
                         remat=long_rows, logits_chunk=4, attention_block=4 if long_rows else 0)


@pytest.mark.parametrize("loss", [grpo.Objective(), grpo.Objective(kind="cispo", importance_level="sequence",
                                                                    off_policy_mask=0.1, cispo_max=1.5)],
                         ids=["default", "sequence-level"])
def test_micro_batching_remat_and_query_blocks_do_not_change_the_update(hf_dirs, loss):
  """A sequence's ratio, mask and weight are its row's: micro-batches of rows leave every objective as it is."""
  path, _ = hf_dirs["qwen3"]
  rows = packing.pack(SEQS, 8, index=True)  # 4 rows of 8 tokens
  adv = np.array([1.0, -0.5, 0.25, -1.0], np.float32)
  runs = []
  for micro, long_rows in ((4, False), (1, True)):
    actor = _actor(hf.from_pretrained(path), micro, long_rows, loss)
    initial = jax.tree.map(np.array, actor.params)  # a copy: the update donates the buffers
    old = actor.logprobs(actor.params, rows) - 0.5  # ratio 1.65: positive advantages clip
    batch = actor_lib.training_batch(rows, adv, np.ones(4, bool), "sequence", old, None,
                                     rollout_logp=old + 0.8)  # the sampler 0.3 above: negative ones masked
    stats = actor.update(batch)
    runs.append((actor.params, [stats]))
  reference, other = runs  # the micro-batches' gradients are summed in another order
  assert not float_order_mismatches(initial, reference, other)
  for k in ("clip_frac", "entropy"):  # sums of non-negative terms: relative rounding ~1e-7
    np.testing.assert_allclose(other[1][0][k], reference[1][0][k], rtol=1e-5)
  assert reference[1][0]["grad_norm"] > 0 and 0 < reference[1][0]["clip_frac"] < 1
  if loss.off_policy_mask:
    assert 0 < reference[1][0]["masked"] < 1 and other[1][0]["masked"] == pytest.approx(reference[1][0]["masked"])


def test_every_objective_trains_through_the_actor(hf_dirs):
  """The loss kinds, aggregations and options the micro-batch test above leaves out, each through the jitted update
  on packed rows with a rollout and a reference policy apart from the trained one: a finite loss and gradient,
  and the weights move (the formulas equal TRL's and verl's own: test_grpo.py, test_corrections.py)."""
  path, _ = hf_dirs["qwen3"]
  rows = packing.pack(SEQS, 8, index=True)
  adv = np.array([1.0, -0.5, 0.25, -1.0], np.float32)
  for loss in (grpo.Objective(kind="sapo", aggregation="constant"),
               grpo.Objective(kind="vespo", importance_level="sequence", aggregation="sequence"),
               grpo.Objective(importance_level="sequence", aggregation="sequence_sum"),  # TRL's luspo
               grpo.Objective(dual_clip=3.0, off_policy_mask=0.1, top_entropy_quantile=0.5, kl_coef=0.1,
                              kl_is_correction=True)):
    actor = _actor(hf.from_pretrained(path), 2, loss=loss)
    before = jax.tree.map(np.array, actor.params)
    old = actor.logprobs(actor.params, rows) - 0.3
    batch = actor_lib.training_batch(rows, adv, np.ones(4, bool), loss.aggregation, old, old + 0.1,
                                     max_len=8, rollout_logp=old + 0.2)
    stats = actor.update(batch)
    assert not stats["skipped"] and all(np.isfinite(v) for v in stats.values()), (loss, stats)
    moved = max(float(np.abs(a - np.asarray(b)).max()) for a, b in zip(jax.tree.leaves(before),
                                                                          jax.tree.leaves(actor.params)))
    assert stats["grad_norm"] > 0 and moved > 0, loss


def _adam_updates(actor, batches, weights=None):
  """(params, stats) after one update of `actor` per (rows, advantages) batch, on-policy; `weights`
  [rows] scales each row's token weights (a wrong gradient)."""
  stats = []
  for rows, adv in batches:
    batch = actor_lib.training_batch(rows, adv, np.ones(len(adv), bool), "token", actor.logprobs(actor.params, rows),
                                     None)
    if weights is not None:
      batch["weights"] = batch["weights"] * weights[:, None].astype(np.float32)
    stats.append(actor.update(batch))
  return jax.tree.map(np.array, actor.params), stats


def test_updates_on_8_devices_match_one_device_and_a_wrong_gradient_does_not(hf_dirs):
  """4 updates of the trainer's Adam without warm-up (the first is a sign step at the full learning
  rate: rounding's largest effect) of 8-row micro-batches, one row per device of an FSDP mesh vs all
  on one device: only rounding differs (tests/conftest.py `float_order_mismatches`). The bounds
  catch what a multi-process bug would do: one row's gradient lost (a shard dropped from the
  all-reduce) or the first 4 rows' doubled (one of 2 processes' gradient x2)."""
  path, _ = hf_dirs["qwen2_untied"]  # untied head, q/k/v biases: the family rounding moves the most
  rng = np.random.RandomState(0)
  batches = []
  for _ in range(4):
    # 13-22 tokens a sample: one per 24-token row, 8 rows.
    seqs = [(rng.randint(2, VOCAB, rng.randint(6, 12)).tolist(), rng.randint(2, VOCAB, rng.randint(7, 12)).tolist())
            for _ in range(8)]
    batches.append((packing.pack(seqs, 24, index=True), rng.randn(8).astype(np.float32)))
  assert all(rows.shape[1] == 8 for rows, _ in batches)
  new = lambda mesh: actor_lib.Actor(hf.from_pretrained(path, mesh=mesh), actor_lib.make_optimizer(1e-2, 0, 0.0),
                                     micro_batch_rows=8, max_grad_norm=1.0, mesh=mesh)
  one = new(None)
  initial = jax.tree.map(np.array, one.params)  # a copy: updates donate the buffers
  reference = _adam_updates(one, batches)
  assert all(s["grad_norm"] > 0 for s in reference[1])
  assert not float_order_mismatches(initial, reference, _adam_updates(new(sharding.make_mesh({"fsdp": 8})), batches))
  for weights in (np.r_[0, np.ones(7)], np.r_[2 * np.ones(4), np.ones(4)]):
    one.params = jax.tree.map(jnp.array, initial)  # fresh buffers: an update donates its inputs
    one.opt_state = one.optimizer.init(one.params)
    wrong = float_order_mismatches(initial, reference, _adam_updates(one, batches, weights))
    assert set(wrong) == {"update", "loss", "grad_norm"}, wrong


def _one_batch(actor):
  rows = packing.pack(SEQS, 8, index=True)
  return actor_lib.training_batch(rows, np.array([1.0, -1.0, 0.5, -0.5]), np.ones(4, bool), "token",
                                  actor.logprobs(actor.params, rows), None)


def test_a_non_finite_gradient_leaves_params_and_optimizer_state_alone(hf_dirs, monkeypatch):
  """The update step itself (a NaN loss is skipped before it: tests/rl/test_trainer.py): a gradient with an
  infinite element but a finite loss."""
  actor = actor_lib.Actor(hf.from_pretrained(hf_dirs["qwen3"][0]), optax.adam(0.1), micro_batch_rows=4,
                          max_grad_norm=1.0)
  batch = _one_batch(actor)
  before = jax.tree.map(np.array, (actor.params, actor.opt_state))
  grads = actor._grads
  infinite = lambda *args: (lambda g, stats: (jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.inf), g), stats))(
      *grads(*args))
  monkeypatch.setattr(actor, "_grads", infinite)
  stats = actor.update(batch)
  assert stats["skipped"] == 1.0 and not np.isfinite(stats["grad_norm"]) and np.isfinite(stats["loss"])
  after = jax.tree.map(np.asarray, (actor.params, actor.opt_state))
  assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), before, after)))
  monkeypatch.setattr(actor, "_grads", grads)
  stats = actor.update(batch)
  assert stats["skipped"] == 0.0 and not np.array_equal(jax.tree.leaves(actor.params)[0], jax.tree.leaves(before[0])[0])


@pytest.mark.parametrize("max_grad_norm", [1e-3, 1e3])
def test_the_clipped_update_equals_optax_clip_then_adamw_and_holds_no_copy(hf_dirs, max_grad_norm):
  """The actor clips the gradient in place before AdamW: the same params and moments as optax's own
  clip_by_global_norm chained before the same AdamW on that gradient (clipping at 1e-3, not at 1e3), and the
  update's executable holds no params-sized scratch (optax's chain in one step made XLA hold a clipped copy)."""
  actor = actor_lib.Actor(hf.from_pretrained(hf_dirs["qwen3"][0]), actor_lib.make_optimizer(1e-2, 0, 0.1),
                          micro_batch_rows=4, max_grad_norm=max_grad_norm)
  batch = _one_batch(actor)
  grads = actor._zeros(actor.params)
  for mb in actor._micro_batches(batch):
    grads, _ = actor._grads(actor.params, actor.frozen, mb, grads)
  grads = jax.tree.map(np.array, grads)
  reference = optax.chain(optax.clip_by_global_norm(max_grad_norm), actor_lib.make_optimizer(1e-2, 0, 0.1))
  ref_state = reference.init(actor.params)
  updates, ref_state = reference.update(grads, ref_state, actor.params)
  ref_params = optax.apply_updates(actor.params, updates)
  assert optax.tree.norm(grads) > 1e-3
  stats = actor.update(batch)
  np.testing.assert_allclose(stats["grad_norm"], optax.tree.norm(grads), rtol=1e-6)
  for ours, theirs in ((actor.params, ref_params), (actor.opt_state, ref_state[1])):
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
  shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  params, opt_state = jax.tree.map(shape, (actor.params, actor.opt_state))
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  for fn, args in ((actor._clip, (params,)), (actor._apply, (params, opt_state, params))):
    assert fn.lower(*args).compile().memory_analysis().temp_size_in_bytes < 0.25 * param_bytes


def test_grpo_updates_raise_the_reward_they_are_given():
  """Sample -> reward -> group advantages -> update, ten times: a random policy learns to emit a
  rewarded token (1/32 of its mass at the start). The sign and wiring of the whole update path."""
  from tlt_jax.models import CausalLM, ModelConfig
  from tlt_jax.rl import grpo
  from tlt_jax.rollout.engine import Engine
  from tlt_jax.rollout.sampling import SamplingParams
  from tlt_jax.rollout.state import EngineConfig
  cfg = ModelConfig("Qwen3ForCausalLM", vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                    num_kv_heads=1, head_dim=16, qk_norm=True, tie_word_embeddings=True)
  model = CausalLM(cfg, rngs=nnx.Rngs(0))
  target, g = 5, 8
  prompts = [[3 + i, 7, 9] for i in range(8)]
  actor = actor_lib.Actor(model, actor_lib.make_optimizer(1e-2, 0, 0.0), micro_batch_rows=8, max_grad_norm=1.0)
  engine = Engine(model, EngineConfig(batch_buckets=(1, 2, 4, 8, 16, 32, 64), max_prompt_len=8, max_new_tokens=4,
                                      kv_block=16, compact=False), SamplingParams(temperature=1.0, max_new_tokens=4))
  means = []
  for step in range(10):
    engine.set_params(actor.params)
    samples = engine.generate(prompts, num_samples=g, prompt_offset=100 * step).samples
    reward = np.asarray([np.mean(s.tokens == target) for s in samples])
    means.append(reward.mean())
    keep = np.flatnonzero(grpo.trained_samples(reward.reshape(-1, g), np.zeros((8, g), bool), True, False))
    rows = packing.pack([(prompts[samples[i].prompt_index - 100 * step], samples[i].tokens.tolist()) for i in keep],
                        16, index=True)
    adv = grpo.advantages(reward.reshape(-1, g)).reshape(-1)[keep]
    actor.update(actor_lib.training_batch(rows, adv, np.ones(len(keep), bool), "token",
                                          actor.logprobs(actor.params, rows), None))
  assert means[0] < 0.06 and np.mean(means[-3:]) > 0.2, means


def _weights_moved(path, dtype, weight_dtype, learning_rate=1e-6, updates=5):
  """Mean |dw| over every weight after `updates` GRPO updates on one batch with the project's optimizer."""
  actor = actor_lib.Actor(hf.from_pretrained(path, dtype=dtype, param_dtype=weight_dtype),
                          actor_lib.make_optimizer(learning_rate, 0, 0.0), micro_batch_rows=4, max_grad_norm=1.0)
  flat = lambda p: np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(p)])
  initial, rows = flat(actor.params), packing.pack(SEQS, 8, index=True)
  for _ in range(updates):
    old = actor.logprobs(actor.params, rows)
    actor.update(actor_lib.training_batch(rows, np.array([1.0, -0.5, 0.25, -1.0], np.float32), np.ones(4, bool),
                                          "token", old, None))
  return float(np.abs(flat(actor.params) - initial).mean())


def test_bfloat16_policies_learn_at_the_papers_learning_rate(hf_dirs):
  """At lr 1e-6 a bfloat16 weight of ~0.02 (spacing ~1e-4) would round its update away. With float32
  masters (the default) bfloat16 compute moves the weights as float32 does; pure bfloat16 weights
  (`policy.weight_dtype=bfloat16`) move them as much on average, by stochastic rounding."""
  path = hf_dirs["qwen2_untied"][0]
  full = _weights_moved(path, "float32", "float32")
  assert full > 1e-6
  assert _weights_moved(path, "bfloat16", "float32") == pytest.approx(full, rel=0.02)
  assert _weights_moved(path, "bfloat16", "bfloat16") == pytest.approx(full, rel=0.25)


def test_stochastic_rounding_is_unbiased():
  step = 2.0**-7  # bfloat16's spacing at 1
  for x in (1.0 + 0.3 * step, -(1.0 + 0.9 * step), 0.02 + 1e-6):
    down = float(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16))  # round to nearest: one neighbour
    draws = np.asarray(jax.vmap(lambda k: actor_lib.stochastic_round(jnp.float32(x), k))(
        jax.random.split(jax.random.key(0), 20_000)), np.float64)
    assert len(np.unique(draws)) <= 2 and down in draws
    gap = np.ptp(draws) or step
    assert abs(draws.mean() - x) < 4 * gap * 0.5 / np.sqrt(len(draws)), (x, draws.mean())
  exact = jnp.asarray([1.0, -0.5, 3.0], jnp.float32)  # bfloat16 values stay as they are
  np.testing.assert_array_equal(actor_lib.stochastic_round(exact, jax.random.key(1)), exact)


def test_the_rollouts_log_probs_land_on_their_response_slots():
  rows = packing.pack(SEQS, 8, index=True)
  values = [np.arange(len(r), dtype=np.float32) + 10 * i for i, (_, r) in enumerate(SEQS)]
  plane = actor_lib.response_plane(rows, values)
  for i, (_, response) in enumerate(SEQS):
    np.testing.assert_array_equal(plane[(rows[4] == i + 1) & (rows[3] > 0)], values[i][:len(response)])
  assert not plane[rows[3] == 0].any()


def test_lora_trains_the_adapters_alone_by_the_merged_weights_gradient(hf_dirs):
  """With adapters the actor's parameters are theirs alone (the base frozen, no optimizer state for it),
  and their gradient is the chain rule through the merged kernel W' = W + s A B: dA = s dW' B^T, dB = s A^T dW',
  dW' from the full fine-tuning path on the merged model."""
  model = hf.from_pretrained(hf_dirs["qwen3"][0])
  lora.attach(model, lora.Spec(4, 8.0, "all-linear"))
  for _, variable in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):  # B non-zero: A's gradient too
    variable.set_value(variable.get_value() + 0.05 * jax.random.normal(jax.random.key(1), variable.get_value().shape))
  full, adapted = _actor(lora.merged(model), 4), actor_lib.Actor(model, optax.adam(1e-2), micro_batch_rows=4)
  rows = packing.pack(SEQS, 8, index=True)
  batch = actor_lib.training_batch(rows, np.array([1.0, -0.5, 0.25, -1.0], np.float32), np.ones(4, bool), "sequence",
                                   full.logprobs(full.params, rows) - 0.5, None)
  mb = adapted._micro_batches(batch)[0]
  grads = lambda a: nnx.to_pure_dict(a._grads(a.params, a.frozen, mb, a._zeros(a.params))[0])
  dw, ab, g = grads(full)["model"]["layers"], nnx.to_pure_dict(adapted.params)["model"]["layers"], \
      grads(adapted)["model"]["layers"]
  for block, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj",
                                                                                         "down_proj"))):
    for name in names:
      (a, b), d = (ab[block][name]["lora"][k] for k in ("lora_a", "lora_b")), dw[block][name]["kernel"]
      close = lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6, rtol=1e-4)
      close(g[block][name]["lora"]["lora_a"], 2.0 * d @ np.swapaxes(b, -1, -2))
      close(g[block][name]["lora"]["lora_b"], 2.0 * np.swapaxes(a, -1, -2) @ d)
  frozen = jax.tree.map(np.array, adapted.frozen)
  assert len(jax.tree.leaves(adapted.opt_state)) == 1 + 2 * len(jax.tree.leaves(adapted.params)) == 1 + 2 * 14
  before = jax.tree.map(np.array, adapted.params)
  assert adapted.update(batch)["grad_norm"] > 0
  assert all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), frozen, adapted.frozen)))
  assert all(jax.tree.leaves(jax.tree.map(lambda x, y: not np.array_equal(x, y), before, adapted.params)))


def test_lora_on_a_bfloat16_base_trains_float32_adapters(hf_dirs):
  """The GPU configs' LoRA: the base frozen in bfloat16 (`policy.dtype`), the adapters and their moments in
  float32 (`policy.weight_dtype`): no stochastic rounding, and the rollouts' copy merged in bfloat16."""
  model = hf.from_pretrained(hf_dirs["qwen3"][0], dtype="bfloat16", param_dtype="bfloat16")
  lora.attach(model, lora.Spec(4, 8.0, "all-linear"), param_dtype=jnp.float32)
  actor = actor_lib.Actor(model, optax.adam(1e-2), micro_batch_rows=4)
  dtypes = lambda tree: {x.dtype for x in jax.tree.leaves(tree)}
  assert not actor.rounding and dtypes(actor.params) == dtypes(actor.opt_state[0].mu) == {jnp.dtype(jnp.float32)}
  assert dtypes(actor.frozen) == {jnp.dtype(jnp.bfloat16)}
  rows = packing.pack(SEQS, 8, index=True)
  frozen = jax.tree.map(np.array, actor.frozen)
  for _ in range(2):  # the second update moves A too (its gradient is 0 while B is)
    batch = actor_lib.training_batch(rows, np.array([1.0, -0.5, 0.25, -1.0], np.float32), np.ones(4, bool), "sequence",
                                     actor.logprobs(actor.params, rows), None)
    assert np.isfinite(actor.update(batch)["grad_norm"])
  assert all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), frozen, actor.frozen)))
  rollout = actor.rollout_params(jnp.bfloat16)
  assert dtypes(rollout) == {jnp.dtype(jnp.bfloat16)}
  merged = nnx.state(lora.merged(actor.model()))
  kernel = lambda s: np.asarray(nnx.to_pure_dict(s)["model"]["layers"]["mlp"]["up_proj"]["kernel"], np.float32)
  assert np.abs(kernel(merged) - kernel(frozen)).max() > 0
  np.testing.assert_allclose(kernel(rollout), kernel(merged), rtol=1e-2, atol=1e-3)
  # The rollouts' merged bfloat16 policy gives the trainer's log-probs up to bfloat16 rounding.
  plain = actor_lib.Actor(nnx.merge(nnx.graphdef(lora.merged(actor.model())), rollout), optax.sgd(0.0),
                          micro_batch_rows=4)
  mask = rows[3] > 0
  np.testing.assert_allclose(plain.logprobs(plain.params, rows)[mask], actor.logprobs(actor.params, rows)[mask],
                             atol=0.05)
