"""What the engine's and the step functions' tests share: a small engine config, random prompts and
the tiny models of every family."""

import numpy as np
import pytest

from tests.conftest import FAMILIES, VOCAB
from tlt_jax.models import hf
from tlt_jax.rollout.speculative import Strategy
from tlt_jax.rollout.state import EngineConfig

STOP = 1
CONFIG = EngineConfig(batch_buckets=(1, 2, 4, 8), max_prompt_len=24, max_new_tokens=64, kv_block=16, segment_steps=8)


def prompts(n, seed=0):
  rng = np.random.RandomState(seed)
  return [rng.randint(2, VOCAB, rng.randint(1, 20)).tolist() for _ in range(n)]


def configured(config, **changes):
  return EngineConfig(**{**config.__dict__, **changes})


def with_sd(config, strategy, sd_max_batch=8):
  return configured(config, strategies=(Strategy.parse(strategy),), sd_max_batch=sd_max_batch)


@pytest.fixture(scope="module")
def models(hf_dirs):
  return {f: hf.from_pretrained(hf_dirs[f][0]) for f in FAMILIES}
