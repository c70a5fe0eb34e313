"""GRPO / DAPO pieces against values worked out by hand."""

import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.rl import grpo


def test_advantages_are_group_normalised():
  r = np.array([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
  a = grpo.advantages(r)  # the sample std, as verl and TRL: sqrt(1/3) for 1, 0, 0, 1
  np.testing.assert_allclose(a[0], np.array([1, -1, -1, 1]) * 0.5 / np.sqrt(1 / 3), atol=1e-5)
  np.testing.assert_array_equal(a[1], 0)
  np.testing.assert_allclose(grpo.advantages(r, "population")[0], [1, -1, -1, 1], atol=1e-5)  # std 0.5
  np.testing.assert_allclose(grpo.advantages(r, "none")[0], [0.5, -0.5, -0.5, 0.5])  # Dr. GRPO
  np.testing.assert_allclose(grpo.advantages(r, eps=0.5)[0], np.array([1, -1, -1, 1]) * 0.5 / (np.sqrt(1 / 3) + 0.5),
                             atol=1e-5)
  np.testing.assert_array_equal(grpo.advantages(np.array([[3.0]])), [[0.0]])  # a group of one: no spread
  with pytest.raises(ValueError, match="advantage std must be one of"):
    grpo.advantages(r, "unbiased")


def test_an_unscorable_reward_is_left_out_of_its_group_as_trl_leaves_it():
  """NaN (every reward function returned None): out of the group's mean and std, advantage 0: TRL 1.16's
  GRPOTrainer formula with its own nanstd, on the same rewards."""
  torch = pytest.importorskip("torch")
  from trl.trainer.utils import nanstd  # pylint: disable=import-outside-toplevel
  r = np.array([[1.0, np.nan, 0.0, 1.0], [np.nan] * 4, [0.5, np.nan, np.nan, np.nan], [2.0, 0.0, 1.0, 3.0]])
  t = torch.tensor(r)
  trl = torch.nan_to_num((t - torch.nanmean(t, dim=1, keepdim=True)) / (nanstd(t, dim=1, keepdim=True) + 1e-4), nan=0.0)
  np.testing.assert_allclose(grpo.advantages(r, eps=1e-4), trl.numpy(), atol=1e-6)
  np.testing.assert_array_equal(grpo.keep_groups(r), [True, False, False, True])


def test_dynamic_sampling_keeps_groups_with_signal():
  r = np.array([[1, 0, 1], [1, 1, 1], [0, 0, 0], [0.5, 0.5, 0.2]])
  np.testing.assert_array_equal(grpo.keep_groups(r), [True, False, False, True])


def test_overlong_penalty_is_linear_in_the_buffer():
  # max 100, buffer 20: free up to 80, -0.5 at 90, -1 at 100 and beyond.
  np.testing.assert_allclose(grpo.overlong_penalty([10, 80, 90, 100, 130], 100, 20), [0, 0, -0.5, -1, -1])
  np.testing.assert_array_equal(grpo.overlong_penalty([10, 100], 100, 0), [0, 0])


def test_token_weights_token_sequence_and_constant_aggregation():
  # One row: sample 1 has 1 response token, sample 2 has 3, sample 3 is padding-free but dropped.
  sample = np.array([[1, 1, 2, 2, 2, 2, 3, 3, 0]])
  mask = np.array([[0, 1, 0, 1, 1, 1, 0, 1, 0]])
  keep = np.array([True, True, False])
  tok = grpo.token_weights(sample, mask, keep, "token")
  np.testing.assert_allclose(tok, [[0, 1 / 4, 0, 1 / 4, 1 / 4, 1 / 4, 0, 0, 0]])
  seq = grpo.token_weights(sample, mask, keep, "sequence")
  np.testing.assert_allclose(seq, [[0, 1 / 2, 0, 1 / 6, 1 / 6, 1 / 6, 0, 0, 0]])
  const = grpo.token_weights(sample, mask, keep, "constant", max_len=5)  # Dr. GRPO: 1 / (2 samples x 5)
  np.testing.assert_allclose(const, [[0, 1 / 10, 0, 1 / 10, 1 / 10, 1 / 10, 0, 0, 0]])
  with pytest.raises(ValueError, match="needs the response budget"):
    grpo.token_weights(sample, mask, keep, "constant")
  assert not grpo.token_weights(sample, mask, np.zeros(3, bool), "token").any()
  with pytest.raises(ValueError, match="'mean'"):
    grpo.token_weights(sample, mask, keep, "mean")


def test_policy_loss_clips_per_sign_of_the_advantage():
  # Ratios e^0.5 = 1.65 and e^-0.5 = 0.61, clip range [0.8, 1.28] (DAPO clip-higher).
  logp = jnp.array([[0.5, 0.5, -0.5, -0.5, 0.0]])
  old = jnp.zeros((1, 5))
  adv = jnp.array([[1.0, -1.0, 1.0, -1.0, 2.0]])
  w = jnp.full((1, 5), 0.2)
  loss, stats = grpo.policy_loss(logp, old, adv, w, clip_low=0.2, clip_high=0.28)
  r_hi, r_lo = np.exp(0.5), np.exp(-0.5)
  per_token = [-1.28, r_hi, -r_lo, 0.8, -2.0]  # -min(r A, clip(r) A)
  np.testing.assert_allclose(loss, 0.2 * sum(per_token), rtol=1e-6)
  np.testing.assert_allclose(stats["clip_frac"], 0.4, rtol=1e-6)  # tokens 0 and 3 clipped
  # Truncated importance sampling weighs each token's policy-gradient term (not the KL).
  is_w = jnp.array([[2.0, 1.0, 0.5, 1.0, 0.0]])
  weighted, _ = grpo.policy_loss(logp, old, adv, w, clip_low=0.2, clip_high=0.28, is_weights_BxT=is_w)
  np.testing.assert_allclose(weighted, 0.2 * np.dot(per_token, is_w[0]), rtol=1e-6)


def test_low_variance_kl():
  logp = jnp.array([[-1.0, -2.0]])
  ref = jnp.array([[-1.5, -2.0]])
  w = jnp.array([[0.5, 0.5]])
  loss, stats = grpo.policy_loss(logp, logp, jnp.zeros((1, 2)), w, 0.2, 0.2, ref_logp_BxT=ref, kl_coef=0.1)
  kl = 0.5 * (np.exp(-0.5) + 0.5 - 1.0)
  np.testing.assert_allclose(stats["kl"], kl, rtol=1e-6)
  np.testing.assert_allclose(loss, 0.1 * kl, rtol=1e-6)


def test_trained_samples_dynamic_sampling_and_overlong_filter():
  rewards = np.array([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
  truncated = np.array([[False, True, False], [False, False, False], [True, False, False]])
  np.testing.assert_array_equal(grpo.trained_samples(rewards, truncated, False, False), np.ones(9, bool))
  np.testing.assert_array_equal(grpo.trained_samples(rewards, truncated, True, False),
                                [1, 1, 1, 0, 0, 0, 1, 1, 1])
  np.testing.assert_array_equal(grpo.trained_samples(rewards, truncated, True, True),
                                [1, 0, 1, 0, 0, 0, 0, 1, 1])
  np.testing.assert_array_equal(grpo.trained_samples(rewards, truncated, False, True),
                                [1, 0, 1, 1, 1, 1, 0, 1, 1])


# TRL's GRPOTrainer._compute_loss on the same model, sequences, advantages and old / reference log-probs,
# by loss type: ours, by the aggregation and KL that match it.
TRL_CASES = [("grpo", "sequence", 0.0), ("dapo", "token", 0.0), ("dr_grpo", "constant", 0.04)]


def test_the_loss_and_its_gradient_equal_trls_grpo_trainer(hf_dirs, tmp_path):
  """TRL's own loss (GRPO, DAPO token-level, Dr. GRPO with the k3 KL: TRL's bias correction off, float32,
  evaluation mode: no gradient accumulation) against `policy_loss` over our packed rows and log-probs:
  the values and the LM head's gradients agree to float32 rounding."""
  torch = pytest.importorskip("torch")
  trl = pytest.importorskip("trl")
  hf_datasets = pytest.importorskip("datasets")
  import jax
  from flax import nnx

  from tlt_jax import packing
  from tlt_jax.models import hf
  from tlt_jax.rl import actor as actor_lib
  from tlt_jax.rl import tokenizer as tokenizer_lib
  path, torch_model = hf_dirs["qwen2_untied"]
  rng = np.random.default_rng(0)
  b, p, t, lengths = 4, 3, 6, [6, 4, 5, 2]
  prompts = rng.integers(2, 96, (b, p))  # one length: TRL left-pads prompts, and positions would shift
  completions = np.zeros((b, t), np.int64)
  mask = np.arange(t)[None] < np.asarray(lengths)[:, None]
  completions[mask] = rng.integers(2, 96, mask.sum())
  advantages = rng.standard_normal(b).astype(np.float32)
  with torch.no_grad():
    logits = torch_model(torch.tensor(np.concatenate([prompts, completions], 1))).logits[:, p - 1:-1].float()
    current = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completions)[..., None])[..., 0].numpy()
  old = np.where(mask, current + rng.uniform(-0.3, 0.3, (b, t)), 0.0).astype(np.float32)  # some ratios clip
  ref = np.where(mask, current + rng.uniform(-0.5, 0.5, (b, t)), 0.0).astype(np.float32)
  rows = packing.pack([(prompts[i].tolist(), completions[i, :n].tolist()) for i, n in enumerate(lengths)], 16,
                      index=True)
  plane = lambda x: actor_lib.response_plane(rows, [x[i, :n] for i, n in enumerate(lengths)])
  graphdef, params = nnx.split(hf.from_pretrained(path))
  for loss_type, aggregation, beta in TRL_CASES:
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=b, num_generations=b,
                          max_completion_length=t, loss_type=loss_type, epsilon=0.2, epsilon_high=0.28, beta=beta,
                          use_bias_correction_kl=False, bf16=False, use_cpu=True, report_to="none")
    trainer = trl.GRPOTrainer(model=path, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                              train_dataset=hf_datasets.Dataset.from_dict({"prompt": ["a"] * b}),
                              processing_class=tokenizer_lib.build_tokenizer())
    trainer.model.eval()
    inputs = dict(prompt_ids=torch.tensor(prompts), prompt_mask=torch.ones(b, p, dtype=torch.long),
                  completion_ids=torch.tensor(completions), completion_mask=torch.tensor(mask.astype(np.int64)),
                  advantages=torch.tensor(advantages), old_per_token_logps=torch.tensor(old),
                  ref_per_token_logps=torch.tensor(ref), num_items_in_batch=torch.tensor(float(mask.sum())))
    theirs = trainer._compute_loss(trainer.model, inputs)  # pylint: disable=protected-access
    theirs.backward()
    batch = actor_lib.training_batch(rows, advantages, np.ones(b, bool), aggregation, plane(old),
                                     plane(ref) if beta else None, max_len=t)

    def loss(params):
      logp, _ = actor_lib.token_logprobs(nnx.merge(graphdef, params), batch["tokens"], batch["positions"],
                                         batch["segments"])
      return grpo.policy_loss(logp, batch["old_logp"], batch["advantages"], batch["weights"], 0.2, 0.28,
                              ref_logp_BxT=batch["ref_logp"] if beta else None, kl_coef=beta)[0]

    ours, grads = jax.value_and_grad(loss)(params)
    assert float(ours) == pytest.approx(theirs.item(), rel=1e-6), loss_type
    np.testing.assert_allclose(np.asarray(grads["lm_head"]["kernel"]), trainer.model.lm_head.weight.grad.numpy().T,
                               atol=1e-6, rtol=0, err_msg=loss_type)
