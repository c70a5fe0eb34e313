"""DrafterTrainer without a rollout: a new version only after training, the last finite state back
(and published) when training or a fault makes the drafter non-finite, a refused incomplete state.
Rounds, checkpoints and resumes run inside the TLT rollout (tests/rollout/test_tlt.py)."""

import jax
import numpy as np
import pytest
from flax import nnx

from tlt_jax import sharding
from tlt_jax.drafter.buffer import DataBuffer
from tlt_jax.drafter.model import Drafter
from tlt_jax.drafter.trainer import DrafterTrainer, DrafterTrainerConfig
from tlt_jax.models import CausalLM, ModelConfig

CFG = ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                  num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, tie_word_embeddings=True)


def test_versions_and_the_last_finite_state(caplog):
  meshes = [sharding.make_mesh({"data": 1}, [d]) for d in jax.devices()[:2]]
  published = []
  trainer = DrafterTrainer(CausalLM(CFG, rngs=nnx.Rngs(0)), Drafter(CFG, rngs=nnx.Rngs(1)), meshes, [0, 1],
                           DataBuffer(), DrafterTrainerConfig(), publish=lambda: published.append(trainer.version))
  good = jax.tree.map(np.asarray, trainer.params)
  assert trainer.home == 0 and trainer.finite() and not trainer.trainable()
  assert trainer.end_step(trained=False) == (False, 0.0) and trainer.version == 0 and published == []
  assert trainer.end_step(trained=True) == (False, 0.0) and trainer.version == 1 and published == [1]
  assert trainer.next_step() == 0 and trainer.metadata()["rl_step"] == 0

  trainer.params = jax.tree.map(lambda x: x * np.nan, trainer.params)  # what a diverged round leaves
  with caplog.at_level("WARNING"):
    restored, _ = trainer.end_step(trained=True)
  assert restored and trainer.version == 1 and published == [1, 1] and trainer.finite()
  assert "training made its params non-finite; restored its last finite state (version 1)" in caplog.text
  assert trainer.end_step(trained=False, fault="an engine's drafter outputs were NaN")[0] and published == [1, 1, 1]
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, trainer.params), good)
  model = trainer.model()
  assert isinstance(model, Drafter)
  with pytest.raises(KeyError, match="'opt_state'"):
    trainer.load_state_dict({"params": trainer.params}, trainer.metadata())
