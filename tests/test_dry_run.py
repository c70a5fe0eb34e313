"""Dry run: abstract model, AOT compilation for the meshes, per-device memory and a fit check."""

import pytest

from configs import tiny
from tlt_jax import dry_run


def _config(limit_gb):
  c = tiny.get_config()
  c.model.vocab_size = 103  # no policy directory: the shape comes from config.model
  c.mesh.data, c.mesh.fsdp = 2, 4  # the trainer over the 8 simulated devices
  c.mesh.device_memory_gb = limit_gb
  c.rollout.groups = 4  # a rollout group = 2 devices
  c.rollout.engine.batch_buckets = (1, 2, 4, 8)
  c.rollout.engine.sd_max_batch = 2
  c.rollout.strategies = ("3_1_4",)
  c.rollout.sampling.max_new_tokens = 64
  c.data.max_prompt_len = 64
  c.rl.row_len = 128
  c.rl.actor.attention_block = 64
  c.rl.actor.remat = True
  return c


@pytest.fixture(scope="module")
def report():
  return dry_run.run(_config(limit_gb=1.0))


def test_dry_run_compiles_and_sizes_every_part(report):
  assert report["model"] == "config.model" and report["fits"]
  assert report["trainer_mesh"] == {"data": 2, "fsdp": 4, "tensor": 1}
  assert report["rollout_group_mesh"]["tensor"] == 2
  names = set(report["executables"])
  assert {"train/gradient", "train/update"} <= names
  assert any(n.startswith("rollout/plain/8") for n in names)  # the largest bucket, plain
  assert any(n.startswith("rollout_tail/") for n in names)  # the speculative tail's bucket
  # 32 prompts x 8 samples over 4 groups: 64 rows each through a bucket of 8, refilled (its reset compiled).
  assert report["rollout_batches"] == {"rows_per_group": 64, "rows_in_flight": 8, "refill": True,
                                       "tails_with_waves": 8, "tails_with_refill": 1}
  assert "rollout/reset/8" in names
  # A paged cache: 64-slot pages (kv_block), 64-token prompts, 16-token mean responses (a quarter of 64).
  rows = report["cache_rows"]
  assert rows["mean_response_len"] == 16 and rows["page_size"] == 64 and rows["contiguous_rows"] == 8
  kv_bytes = 2 * (6 + 1) * 1 * 32 * 4  # k and v, 6 target layers + the drafter's, 1 KV head (not split), float32
  assert rows["kv_bytes_per_token"] == kv_bytes
  assert rows["contiguous_cache_gb"] == round(8 * 192 * kv_bytes / (1 << 30), 3)  # capacity 64 + 64 + 4, in pages
  # A mean row fills 64 + 16 tokens + a 16-step play: 2 pages (no full page to share before the
  # prompt's last token), against 3 per contiguous row.
  assert rows["paged_rows_same_bytes"] == 8 * 3 // 2
  assert rows["paged_rows_device_memory"] > 1000  # 1 GB holds thousands of such rows
  gradient = report["executables"]["train/gradient"]
  assert gradient["tflops"] > 0 and gradient["resident_gb"] > 0
  # Params are split over fsdp: the update's resident memory is well under the whole state's.
  assert report["executables"]["train/update"]["resident_gb"] < 3 * report["policy_gb"]
  # The trainer's float32 masters and AdamW moments (3 x the policy, the moments sharded like their
  # params over fsdp 4: left to XLA they came out replicated) stay resident during a rollout, and a
  # rollout group's copy (split over its 2 devices) during training: each executable's need counts
  # the other side's.
  state, copy = report["trainer_state_gb"], report["rollout_copy_gb"]
  assert 3 * report["policy_gb"] / 4 <= state < 1.05 * 3 * report["policy_gb"] / 4
  assert report["policy_gb"] / 2 <= copy
  assert report["coresident_gb"] == {"train/gradient": pytest.approx(state + copy), "train/update": copy,
                                     "rollout": state}
  name = report["max_per_device_executable"]
  beside = report["coresident_gb"].get(name, state)
  assert report["max_per_device_gb"] == pytest.approx(report["executables"][name]["resident_gb"] + beside, abs=1e-5)
  # The drafter buffer's share of a checkpoint: 32 x 8 samples of this step and the longest quarter
  # of the previous step's, up to 64 + 64 tokens each (126 pairs, 127 tokens, tool flags and 96-float features).
  entries = 256 + 64
  assert report["drafter_buffer_checkpoint_gb"] == round((entries * 127 * (96 * 4 + 5) + entries * 16) / (1 << 30), 6)


def test_dry_run_fails_naming_what_does_not_fit(report):
  executables = report["executables"]
  with pytest.raises(ValueError, match=r"train/update needs .* GB per device > config.mesh.device_memory_gb=1e-05"):
    dry_run.check_fit({"train/update": executables["train/update"]}, 1e-5, on_cpu=True)
  # On an accelerator the scratch memory counts too.
  fake = {"a": {"resident_gb": 1.0, "temp_gb": 5.0}, "b": {"resident_gb": 2.0, "temp_gb": 0.0}}
  assert dry_run.check_fit(fake, 3.0, on_cpu=True)["max_per_device_executable"] == "b"
  with pytest.raises(ValueError, match="^a needs 6.0 GB"):
    dry_run.check_fit(fake, 3.0, on_cpu=False)


def test_a_lora_dry_run_sizes_the_frozen_base_and_the_adapters(report):
  """With LoRA the trainer holds the base once (frozen, sharded) and masters and AdamW moments for the adapters
  alone; the rollout copy is the merged policy's, as large as without."""
  c = _config(limit_gb=1.0)
  c.policy.lora.rank = 4
  lora = dry_run.run(c)
  adapters_gb = lora["lora"]["parameters_m"] * 1e6 * 4 / (1 << 30)
  assert lora["lora"]["rank"] == 4 and lora["parameters_b"] == report["parameters_b"]
  base_gb = lora["policy_gb"] - adapters_gb
  assert base_gb == pytest.approx(report["policy_gb"], rel=1e-3)
  # The base and the adapters' masters and moments, split over fsdp 4.
  assert base_gb / 4 < lora["trainer_state_gb"] < (base_gb + 3 * adapters_gb) / 4 * 1.1 < report["trainer_state_gb"] / 2
  assert lora["executables"]["train/update"]["resident_gb"] < report["executables"]["train/update"]["resident_gb"] / 10
  assert lora["rollout_copy_gb"] == report["rollout_copy_gb"]
