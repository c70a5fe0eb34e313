"""Rollout corrections against verl 0.9.1's own functions (its rollout_corr_helper.py and presets, loaded from the
installed wheel without its package's imports) on the same log-probs, and TRL 1.16's importance-sampling modes."""

import ast
import importlib
import importlib.metadata
import math
import sys
import types

import numpy as np
import pytest

from tlt_jax import fields, packing
from tlt_jax.rl import actor as actor_lib
from tlt_jax.rl import corrections

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def verl():
  """(rollout_corr_helper, RolloutCorrectionConfig) of the installed verl (pip install --no-deps verl==0.9.1):
  its own files, its package __init__s (Ray, its trainers) skipped; torch_functional's masked_sum / masked_mean
  are taken from its source alone (the rest of that module needs its GPU stack)."""
  try:
    dist = importlib.metadata.distribution("verl")
  except importlib.metadata.PackageNotFoundError:
    pytest.skip("verl is not installed (pip install --no-deps verl==0.9.1)")
  assert dist.version == "0.9.1"
  root = dist.locate_file("verl")
  saved = {k: v for k, v in sys.modules.items() if k == "verl" or k.startswith("verl.")}
  for name in ("verl", "verl.trainer", "verl.trainer.config", "verl.trainer.ppo", "verl.utils", "verl.workers",
               "verl.workers.config"):
    package = types.ModuleType(name)
    package.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
    sys.modules[name] = package
  functional = types.ModuleType("verl.utils.torch_functional")
  functional.torch = torch
  source = root.joinpath("utils", "torch_functional.py").read_text()
  body = [n for n in ast.parse(source).body
          if isinstance(n, ast.FunctionDef) and n.name in ("masked_sum", "masked_mean")]
  exec(compile(ast.Module(body, []), "verl/utils/torch_functional.py", "exec"), functional.__dict__)  # pylint: disable=exec-used
  protocol = types.ModuleType("verl.protocol")
  protocol.DataProto = type("DataProto", (), {"from_dict": staticmethod(lambda tensors: tensors)})
  actor = types.ModuleType("verl.workers.config.actor")
  actor.PolicyLossConfig = dict
  sys.modules.update({"verl.utils.torch_functional": functional, "verl.protocol": protocol,
                      "verl.workers.config.actor": actor})
  config = importlib.import_module("verl.trainer.config.algorithm").RolloutCorrectionConfig
  sys.modules["verl.trainer.config"].RolloutCorrectionConfig = config
  yield importlib.import_module("verl.trainer.ppo.rollout_corr_helper"), config
  for name in [k for k in sys.modules if k == "verl" or k.startswith("verl.")]:
    del sys.modules[name]
  sys.modules.update(saved)


def _ours(preset: dict) -> corrections.RolloutCorrection:
  return corrections.RolloutCorrection(**preset)


def _verls_name(key: str) -> str:
  """verl's name of our metric: mismatch/is_mean is rollout_corr/rollout_is_mean, mismatch/kl rollout_corr/kl."""
  name = key.removeprefix("mismatch/")
  return "rollout_corr/" + ("rollout_" + name if name.startswith(("is_", "rs_")) else name)


def _verls_preset(c) -> dict:
  """verl's RolloutCorrectionConfig as our keys."""
  out = {}
  if c.rollout_is:
    lower, _, upper = str(c.rollout_is_threshold).rpartition("_")
    out.update(is_level=c.rollout_is, is_max=float(upper))
    if lower:
      out.update(is_mode="mask", is_min=float(lower))
  if c.rollout_rs:
    out.update(rs=c.rollout_rs, rs_threshold=str(c.rollout_rs_threshold))
  return out


def test_the_presets_are_verls(verl):
  """Each of verl's decoupled presets (the trainer's old log-probs against the rollout's) is ours by its name."""
  _, config = verl
  names = sorted(n for n in vars(config) if n.startswith("decoupled_"))
  assert names == sorted(corrections.PRESETS)
  for name in names:
    assert _ours(corrections.PRESETS[name]) == _ours(_verls_preset(getattr(config, name)())), name


CASES = {
    "token TIS": dict(is_level="token", is_max=2.0),
    "sequence TIS": dict(is_level="sequence", is_max=2.0),
    "token IcePop": dict(is_level="token", is_mode="mask", is_min=0.8, is_max=1.1),
    "sequence mask": dict(is_level="sequence", is_mode="mask", is_min=0.7, is_max=1.3),
    "token TIS, batch mean 1": dict(is_level="token", is_max=1.1, is_batch_normalize=True),
    "sequence TIS, batch mean 1": dict(is_level="sequence", is_max=1.2, is_batch_normalize=True),
    **{option: dict(rs=option, rs_threshold=bound) for option, bound in zip(corrections.REJECTIONS, (
        "0.95_1.05", "0.004", "0.1", "0.95_1.05", "0.004", "0.6", "0.95_1.05", "0.004", "0.09", "0.004", "0.1"))},
    "seq_sum_k1, one bound": dict(rs="seq_sum_k1", rs_threshold="1.3"),
    "two options": dict(is_level="token", is_max=1.5, rs="token_k2,seq_mean_k3", rs_threshold="0.01,0.002"),
    **{name: preset for name, preset in corrections.PRESETS.items()},
}


@pytest.fixture(scope="module")
def logprobs():
  """Eight sequences of 3-9 trained tokens (the rollout's log-probs and the trainer's, a few % apart, and one
  sequence far off), packed as the trainer packs them, and as verl holds them ([B, T], right-padded)."""
  rng = np.random.default_rng(1)
  lengths = [5, 9, 3, 7, 8, 4, 6, 9]
  rollout = [-rng.exponential(1.0, n) for n in lengths]
  trainer = [r + rng.normal(0, 0.05, len(r)) for r in rollout]
  trainer[3] = trainer[3] + 0.4
  rollout, trainer = ([v.astype(np.float32) for v in x] for x in (rollout, trainer))  # as the planes hold them
  rows = packing.pack([(rng.integers(2, 50, 3).tolist(), rng.integers(2, 50, n).tolist()) for n in lengths], 16,
                      index=True)
  plane = lambda values: actor_lib.response_plane(rows, values).astype(np.float64)
  t = max(lengths)
  padded = lambda values: torch.tensor(np.stack([np.pad(v, (0, t - len(v))) for v in values]))
  mask = torch.tensor(np.arange(t)[None] < np.array(lengths)[:, None], dtype=torch.float64)
  return dict(rows=rows, ours=(plane(trainer), plane(rollout)), theirs=(padded(trainer), padded(rollout), mask),
              lengths=lengths)


@pytest.mark.parametrize("case", CASES)
def test_weights_rejections_and_metrics_equal_verls(verl, logprobs, case):
  """verl's compute_rollout_correction_and_rejection_mask on the same numbers: the same IS weights on every trained
  token, the same tokens rejected, and our mismatch/* metrics equal to its rollout_corr/* ones."""
  helper, _ = verl
  ours = corrections.RolloutCorrection(**CASES[case])
  weights, loss_mask, metrics = ours.apply(*logprobs["ours"], logprobs["rows"])
  threshold = f"{ours.is_min}_{ours.is_max}" if ours.is_mode == "mask" else ours.is_max
  their_weights, their_mask, theirs = helper.compute_rollout_correction_and_rejection_mask(
      *logprobs["theirs"], rollout_is=ours.is_level or None, rollout_is_threshold=threshold,
      rollout_is_batch_normalize=ours.is_batch_normalize, rollout_rs=ours.rs or None,
      rollout_rs_threshold=ours.rs_threshold or None)
  rows = logprobs["rows"]
  at = lambda plane, i, n: plane[(rows[4] == i + 1) & (rows[3] > 0)][:n]
  for i, n in enumerate(logprobs["lengths"]):
    assert (at(loss_mask, i, n) > 0).tolist() == (their_mask[i, :n] > 0).tolist(), (case, i)
    if ours.is_level:
      np.testing.assert_allclose(at(weights, i, n), their_weights["rollout_is_weights"][i, :n].numpy(), rtol=1e-6,
                                 err_msg=f"{case}: sequence {i}")
  assert (weights is None) == (not ours.is_level)
  compared = [k for k in metrics if k != "mismatch/logp_abs_diff"]  # ours alone
  assert len(compared) >= 14
  for key in compared:
    assert metrics[key] == pytest.approx(theirs[_verls_name(key)], rel=1e-6, abs=1e-9), (case, key)
  assert (rows[3] > 0).sum() - (loss_mask > 0).sum() == pytest.approx(
      theirs.get("rollout_corr/rollout_rs_masked_fraction", 0.0) * sum(logprobs["lengths"]))


def test_trls_truncate_mode_clips_both_ways(logprobs):
  """TRL's token_truncate / sequence_truncate with a lower bound (vllm_importance_sampling_clip_min): the ratio
  clamped to [min, max]; its *_mask modes zero it outside, as verl's IcePop (above)."""
  trainer, rollout = logprobs["ours"]
  rows = logprobs["rows"]
  trained = (rows[3] > 0) & (rows[4] > 0)
  ratio = np.exp(trainer - rollout)[trained]
  token = corrections.RolloutCorrection(is_level="token", is_min=0.97, is_max=1.02)
  weights, _, _ = token.apply(trainer, rollout, rows)
  np.testing.assert_allclose(weights[trained], np.clip(ratio, 0.97, 1.02), rtol=1e-6)
  assert (weights[trained] == 0.97).any() and (weights[trained] == 1.02).any()
  seq, _, _ = corrections.RolloutCorrection(is_level="sequence", is_min=0.9, is_max=1.1).apply(trainer, rollout, rows)
  for i in range(len(logprobs["lengths"])):
    slots = trained & (rows[4] == i + 1)
    expected = np.clip(np.exp((trainer - rollout)[slots].sum()), 0.9, 1.1)
    np.testing.assert_allclose(seq[slots], expected, rtol=1e-6)
  assert (weights[~trained] == 1).all()


def test_bad_settings_name_their_field():
  with pytest.raises(fields.FieldError, match="rs must name options"):
    corrections.RolloutCorrection(rs="token_k4")
  with pytest.raises(fields.FieldError, match="rs_threshold .*seq_mean_k3 takes one upper bound"):
    corrections.RolloutCorrection(rs="seq_mean_k3", rs_threshold="0.1_0.2")
  with pytest.raises(fields.FieldError, match="rs_threshold must give one bound, or one per option"):
    corrections.RolloutCorrection(rs="token_k2,token_k3", rs_threshold="1,2,3")
  with pytest.raises(fields.FieldError, match="is_min must be in"):
    corrections.RolloutCorrection(is_level="token", is_min=3.0, is_max=2.0)
  assert not corrections.RolloutCorrection().enabled and math.isfinite(corrections.SAFETY)
