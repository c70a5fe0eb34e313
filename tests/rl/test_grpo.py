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


def test_normalize_then_sum_is_trls_gdpo_and_the_batch_std_its_scale_rewards():
  """TRL 1.16's multi_objective_aggregation="normalize_then_sum" and scale_rewards="batch", as its
  _generate_and_score_completions computes them (with its nanstd), on the same per-function rewards."""
  torch = pytest.importorskip("torch")
  from trl.trainer.utils import nanstd  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(3)
  g, n, k = 3, 4, 2
  values = rng.integers(0, 3, (k, g * n)).astype(np.float64)
  values[1, 5] = np.nan  # the second function does not apply to one sample
  values[:, 9] = np.nan  # no function applies to another
  weights = np.array([1.0, 0.5])
  per_func = torch.tensor(values.T)  # TRL's rewards_per_func: [samples, functions]
  grouped = per_func.view(-1, n, k)
  reward_k = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (nanstd(grouped, dim=1, keepdim=True) + 1e-4)
  rewards = (reward_k.view(-1, k) * torch.tensor(weights)[None]).nansum(dim=1)
  rewards[torch.isnan(per_func).all(dim=1)] = torch.nan
  trl = torch.nan_to_num((rewards - torch.nanmean(rewards)) / (nanstd(rewards) + 1e-4), nan=0.0)
  np.testing.assert_allclose(grpo.normalize_then_sum(values, weights, n, 1e-4), trl.numpy(), atol=1e-6)
  summed = torch.tensor(np.nansum(weights[:, None] * values, axis=0))
  summed[9] = torch.nan
  by_batch = (summed - torch.nanmean(summed.view(-1, n), dim=1).repeat_interleave(n)) / (nanstd(summed) + 1e-4)
  np.testing.assert_allclose(grpo.advantages(summed.numpy().reshape(g, n), "batch", 1e-4).reshape(-1),
                             torch.nan_to_num(by_batch, nan=0.0).numpy(), atol=1e-6)


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
  loss, stats = grpo.policy_loss(logp, old, adv, w, grpo.Objective(clip_low=0.2, clip_high=0.28))
  r_hi, r_lo = np.exp(0.5), np.exp(-0.5)
  per_token = [-1.28, r_hi, -r_lo, 0.8, -2.0]  # -min(r A, clip(r) A)
  np.testing.assert_allclose(loss, 0.2 * sum(per_token), rtol=1e-6)
  np.testing.assert_allclose(stats["clip_frac"], 0.4, rtol=1e-6)  # tokens 0 and 3 clipped
  # Truncated importance sampling weighs each token's policy-gradient term (not the KL).
  is_w = jnp.array([[2.0, 1.0, 0.5, 1.0, 0.0]])
  weighted, _ = grpo.policy_loss(logp, old, adv, w, grpo.Objective(clip_low=0.2, clip_high=0.28), is_weights_BxT=is_w)
  np.testing.assert_allclose(weighted, 0.2 * np.dot(per_token, is_w[0]), rtol=1e-6)


def test_low_variance_kl():
  logp = jnp.array([[-1.0, -2.0]])
  ref = jnp.array([[-1.5, -2.0]])
  w = jnp.array([[0.5, 0.5]])
  loss, stats = grpo.policy_loss(logp, logp, jnp.zeros((1, 2)), w, grpo.Objective(kl_coef=0.1), ref_logp_BxT=ref)
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


# TRL 1.16's GRPOTrainer._compute_loss against ours on the same model, sequences, advantages and log-probs: (TRL's
# GRPOConfig keywords, TRL's extra inputs, our Objective's keywords). is: the rollout correction's weights as TRL's
# importance_sampling_ratio; sampled: the rollout's log-probs as TRL's sampling_per_token_logps.
TRL_CASES = {
    "grpo": (dict(loss_type="grpo"), (), dict(aggregation="sequence")),
    "dapo": (dict(loss_type="dapo"), (), dict(aggregation="token")),
    "bnpo": (dict(loss_type="bnpo"), (), dict(aggregation="token")),
    "dr_grpo+kl": (dict(loss_type="dr_grpo", beta=0.04), (), dict(aggregation="constant", kl_coef=0.04)),
    "gspo": (dict(loss_type="dapo", importance_sampling_level="sequence"), (), dict(importance_level="sequence")),
    "gspo-grpo": (dict(loss_type="grpo", importance_sampling_level="sequence"), (),
                  dict(aggregation="sequence", importance_level="sequence")),
    "luspo": (dict(loss_type="luspo", importance_sampling_level="sequence"), (),
              dict(aggregation="sequence_sum", importance_level="sequence")),
    "cispo": (dict(loss_type="cispo", epsilon_high=1.1), (), dict(kind="cispo", cispo_max=1.1)),
    "cispo-sequence": (dict(loss_type="cispo", epsilon_high=1.1, importance_sampling_level="sequence"), (),
                       dict(kind="cispo", cispo_max=1.1, importance_level="sequence")),
    "sapo": (dict(loss_type="sapo"), (), dict(kind="sapo", aggregation="sequence")),
    "sapo-temperatures": (dict(loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0), (),
                          dict(kind="sapo", aggregation="sequence", sapo_temperatures=(0.5, 2.0))),
    "vespo+is": (dict(loss_type="vespo"), ("is",), dict(kind="vespo")),
    "vespo-params": (dict(loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_pos=0.5, vespo_k_neg=4.0,
                          vespo_lambda_neg=1.0), (), dict(kind="vespo", vespo=(1.0, 0.5, 4.0, 1.0))),
    "delta": (dict(loss_type="dapo", epsilon_high=0.1, delta=1.15), (), dict(clip_high=0.1, dual_clip=1.15)),
    "off-policy mask": (dict(loss_type="dapo", off_policy_mask_threshold=0.02), ("sampled",),
                        dict(off_policy_mask=0.02)),
    "top entropy": (dict(loss_type="dapo", top_entropy_quantile=0.2), (), dict(top_entropy_quantile=0.2)),
    "grpo+is": (dict(loss_type="grpo"), ("is",), dict(aggregation="sequence")),
    "gspo+is+kl bias": (dict(loss_type="dapo", importance_sampling_level="sequence", beta=0.04,
                             use_bias_correction_kl=True), ("is",),
                        dict(importance_level="sequence", kl_coef=0.04, kl_is_correction=True)),
}


@pytest.fixture(scope="module")
def trl_batch(hf_dirs):
  """The sequences, as TRL holds them and packed as ours, and their current (TRL's float32 model's),
  old, reference and rollout log-probs, advantages of both signs and rollout-correction weights."""
  torch = pytest.importorskip("torch")
  from tlt_jax import packing
  from tlt_jax.rl import actor as actor_lib
  path, torch_model = hf_dirs["qwen2_untied"]
  rng = np.random.default_rng(0)
  b, p, t, lengths = 6, 3, 6, [6, 4, 5, 2, 6, 3]
  prompts = rng.integers(2, 96, (b, p))  # one length: TRL left-pads prompts, and positions would shift
  completions = np.zeros((b, t), np.int64)
  mask = np.arange(t)[None] < np.asarray(lengths)[:, None]
  completions[mask] = rng.integers(2, 96, mask.sum())
  with torch.no_grad():
    logits = torch_model(torch.tensor(np.concatenate([prompts, completions], 1))).logits[:, p - 1:-1].float()
    current = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completions)[..., None])[..., 0].numpy()
  near = lambda spread: np.where(mask, current + rng.uniform(-spread, spread, (b, t)), 0.0).astype(np.float32)
  old, ref, sampled = near(0.3), near(0.5), near(0.4)  # some ratios clip, some sequences drift
  is_weights = np.where(mask, np.clip(np.exp(old - sampled), 0.0, 1.3), 1.0).astype(np.float32)
  rows = packing.pack([(prompts[i].tolist(), completions[i, :n].tolist()) for i, n in enumerate(lengths)], 32,
                      index=True)
  plane = lambda x: actor_lib.response_plane(rows, [x[i, :n] for i, n in enumerate(lengths)])
  return dict(path=path, prompts=prompts, completions=completions, mask=mask, lengths=lengths, rows=rows, plane=plane,
              advantages=np.array([1.2, -0.7, 0.4, -1.5, 0.9, -0.2], np.float32), old=old, ref=ref, sampled=sampled,
              is_weights=is_weights)


@pytest.mark.parametrize("case", TRL_CASES)
def test_the_loss_and_its_gradient_equal_trls_grpo_trainer(trl_batch, case, tmp_path):
  """TRL 1.16's own loss (float32, evaluation mode: no gradient accumulation; TRL's KL bias correction off unless
  asked) against `policy_loss` over our packed rows and log-probs, for each loss type, importance-sampling level
  and mask or clip option: the values and the LM head's gradients agree to float32 rounding."""
  torch = pytest.importorskip("torch")
  trl = pytest.importorskip("trl")
  hf_datasets = pytest.importorskip("datasets")
  import jax
  from flax import nnx

  from tlt_jax.models import hf
  from tlt_jax.rl import actor as actor_lib
  from tlt_jax.rl import tokenizer as tokenizer_lib
  d = trl_batch
  theirs_args, extra, ours_args = TRL_CASES[case]
  b, p = d["prompts"].shape
  t = d["completions"].shape[1]
  args = trl.GRPOConfig(**{"epsilon": 0.2, "epsilon_high": 0.28, "beta": 0.0, "use_bias_correction_kl": False,
                           **theirs_args}, output_dir=str(tmp_path), per_device_train_batch_size=b,
                        num_generations=b, max_completion_length=t, bf16=False, use_cpu=True, report_to="none")
  trainer = trl.GRPOTrainer(model=d["path"], reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                            train_dataset=hf_datasets.Dataset.from_dict({"prompt": ["a"] * b}),
                            processing_class=tokenizer_lib.build_tokenizer())
  trainer.model.eval()
  inputs = dict(prompt_ids=torch.tensor(d["prompts"]), prompt_mask=torch.ones(b, p, dtype=torch.long),
                completion_ids=torch.tensor(d["completions"]),
                completion_mask=torch.tensor(d["mask"].astype(np.int64)), advantages=torch.tensor(d["advantages"]),
                old_per_token_logps=torch.tensor(d["old"]), ref_per_token_logps=torch.tensor(d["ref"]),
                num_items_in_batch=torch.tensor(float(d["mask"].sum())))
  if "is" in extra:  # TRL weighs by it where vLLM generated (its ratio is computed while generating)
    inputs["importance_sampling_ratio"] = torch.tensor(d["is_weights"])
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
  if "sampled" in extra:
    inputs["sampling_per_token_logps"] = torch.tensor(d["sampled"])
  theirs = trainer._compute_loss(trainer.model, inputs)  # pylint: disable=protected-access
  theirs.backward()

  objective = grpo.Objective(**{"clip_low": 0.2, "clip_high": 0.28, **ours_args})
  plane = d["plane"]
  batch = actor_lib.training_batch(d["rows"], d["advantages"], np.ones(b, bool), objective.aggregation,
                                   plane(d["old"]), plane(d["ref"]),
                                   plane(d["is_weights"]) + (d["rows"][3] == 0) if "is" in extra else None, t,
                                   plane(d["sampled"]) if "sampled" in extra else None)
  graphdef, params = nnx.split(hf.from_pretrained(d["path"]))

  def loss(params):
    logp, entropy = actor_lib.token_logprobs(nnx.merge(graphdef, params), batch["tokens"], batch["positions"],
                                             batch["segments"])
    return grpo.policy_loss(logp, batch["old_logp"], batch["advantages"], batch["weights"], objective,
                            segments_BxT=batch["segments"], ref_logp_BxT=batch["ref_logp"],
                            is_weights_BxT=batch["is_weights"], rollout_logp_BxT=batch["rollout_logp"],
                            entropy_BxT=entropy)[0]

  ours, grads = jax.value_and_grad(loss)(params)
  assert float(ours) == pytest.approx(theirs.item(), rel=2e-6, abs=1e-7), case
  np.testing.assert_allclose(np.asarray(grads["lm_head"]["kernel"]), trainer.model.lm_head.weight.grad.numpy().T,
                             atol=2e-6, rtol=0, err_msg=case)
