"""The SFT policy and warmed-up drafter an experiment starts from: a workdir's, else built into its --out."""

from __future__ import annotations

import os
import shutil

from absl import logging

from tlt_jax.drafter import checkpoint
from tlt_jax.models import hf
from tlt_jax.rl import bootstrap


def fresh_workdir(path: str) -> str:
  """A measuring trainer's workdir, emptied first: a trainer resumes the checkpoints it finds, so a
  re-run would otherwise continue the previous run instead of measuring from the start."""
  if os.path.exists(path):
    logging.info("removing the previous run's %s", path)
    shutil.rmtree(path)
  return path


def policy_and_drafter(config, out: str) -> tuple[str, str]:
  """(policy dir, drafter dir): `policy.path` / `drafter.path` when set, else the config's workdir's
  when its policy is there, else built into <out>/init as the trainer builds them (SFT warm start of
  the tiny policy, drafter warm-up on its data)."""
  c = config.copy_and_resolve_references()
  if not c.policy.path and not os.path.exists(os.path.join(c.workdir, "policy", "config.json")):
    c.workdir = os.path.join(out, "init")
  policy_dir = c.policy.path or os.path.join(c.workdir, "policy")
  drafter_dir = c.drafter.path or os.path.join(c.workdir, "drafter")
  if not (os.path.exists(os.path.join(policy_dir, "config.json")) and os.path.exists(drafter_dir)):
    policy, tok = bootstrap.load_policy(c)
    bootstrap.load_drafter(c, policy, tok)
  return policy_dir, drafter_dir


def load(config, out: str):
  """(policy dir, drafter dir, policy, tokenizer, drafter) of `policy_and_drafter`."""
  policy_dir, drafter_dir = policy_and_drafter(config, out)
  model = hf.from_pretrained(policy_dir)
  return policy_dir, drafter_dir, model, hf.load_tokenizer(policy_dir), checkpoint.load_drafter(drafter_dir,
                                                                                                model.config)
