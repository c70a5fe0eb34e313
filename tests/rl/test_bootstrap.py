"""The run's inputs: the tiny world's policy found in a workdir is the config's, or the run stops naming why."""

import shutil

import pytest

from tlt_jax import config as config_lib
from tlt_jax.rl import bootstrap


def test_a_smoke_variant_keeps_its_own_workdir():
  assert config_lib.get_config("smoke").workdir == "runs/tiny_smoke" != config_lib.get_config().workdir


def test_a_policy_another_config_trained_in_the_workdir_is_refused_by_name(tmp_path, tiny_policy_dir):
  """The smoke's 2-layer policy left in the workdir the full config then uses: one error naming the shape keys
  that differ, before anything trains on it."""
  shutil.copytree(tiny_policy_dir, tmp_path / "policy")
  c = config_lib.get_config()
  c.workdir = str(tmp_path)
  with pytest.raises(ValueError) as e:
    bootstrap.load_policy(c)
  assert str(e.value) == (
      f"config.workdir={str(tmp_path)!r}: its policy ({tmp_path / 'policy'}) has hidden_size=32, "
      "intermediate_size=64, num_layers=2; config.model asks for hidden_size=96, intermediate_size=384, "
      "num_layers=6 (another config trained it): set config.workdir to another directory or remove this one")
  c.model.hidden_size, c.model.num_layers, c.model.intermediate_size = 32, 2, 64  # its own shape: loads
  assert bootstrap.load_policy(c)[0].config.num_layers == 2


def _tools_smoke(tmp_path, monkeypatch):
  from configs import tools  # pylint: disable=import-outside-toplevel
  c = tools.get_config("smoke")
  c.workdir = str(tmp_path)
  monkeypatch.setattr(bootstrap.sft, "warm_start", lambda *a, **k: pytest.fail("the SFT warm start ran"))
  return c


def test_prompts_the_tool_schemas_push_past_max_prompt_len_name_the_key_and_a_length_that_would_do(
    tmp_path, monkeypatch):
  c = _tools_smoke(tmp_path, monkeypatch)
  c.data.max_prompt_len = 40
  with pytest.raises(ValueError) as e:
    bootstrap.load(c)
  message = str(e.value)
  assert message.startswith("0 prompts, fewer than config.rollout.prompts_per_step=1: 64 are longer than "
                            "config.data.max_prompt_len=40 tokens with rollout.tools' schemas; ")
  would_do = int(message.split("; ")[1].split()[0])
  c.data.max_prompt_len, c.rl.row_len = would_do, would_do + c.rollout.sampling.max_new_tokens
  assert len(bootstrap.load_prompts(c, bootstrap.load_tokenizer(c))) >= 1


def test_a_warm_up_row_too_short_for_the_prompts_stops_before_the_sft_warm_start(tmp_path, monkeypatch):
  c = _tools_smoke(tmp_path, monkeypatch)
  c.drafter.distill.row_len = 24
  with pytest.raises(ValueError, match=r"^config\.drafter\.distill\.row_len=24: holds none of the warm-up's \d+ "
                                       r"prompts and a response token \(the shortest prompt has \d+ tokens, "
                                       r"rollout\.tools' schemas included\); set it to data\.max_prompt_len \+ "):
    bootstrap.load(c)
