"""Dry run: the run's own constructors on abstract params, every executable compiled (for simulated CPU
devices, or deviceless for a GPU and a TPU by their own compilers), per-device memory, a fit check, the
roofline, and errors that name the executable and the keys to change."""

import json

import pytest

from configs import tiny
from tlt_jax import dry_run, targets


def _config(limit_gb=0.0, target="", devices=8):
  c = tiny.get_config()
  c.model.vocab_size = 103  # no policy directory: the shape comes from config.model
  c.mesh.target, c.mesh.dry_run_devices = target, devices
  c.mesh.data, c.mesh.fsdp = (2, 4) if devices == 8 else (1, devices)  # the trainer over every device
  c.mesh.device_memory_gb = limit_gb
  c.rollout.groups = devices // 2  # a rollout group = 2 devices
  c.rollout.engine.batch_buckets = (1, 2, 4, 8)
  c.rollout.engine.sd_max_batch = 2
  c.rollout.strategies = ("3_1_4",)
  c.rollout.sampling.max_new_tokens = 48
  c.data.max_prompt_len = 16  # one prompt bucket
  c.rl.row_len = 64
  c.rl.actor.attention_block = 32
  c.rl.actor.remat = True
  c.eval.size, c.eval.num_samples = 4, 2  # a held-out evaluation of 8 rows
  return c


@pytest.fixture(scope="module")
def report():
  return dry_run.run(_config(limit_gb=1.0))


def test_dry_run_compiles_and_sizes_every_part(report):
  assert report["model"] == "config.model" and report["fits"] and report["failed"] == []
  assert report["trainer_mesh"] == {"data": 2, "fsdp": 4, "tensor": 1}
  assert report["rollout_group_mesh"] == {"data": 1, "fsdp": 1, "tensor": 2}  # groups tensor-parallel, as TLT's
  ex = report["executables"]
  assert all(e["compiled"] for e in ex.values())
  # What a step runs: the actor's, each bucket's plain play (speculative where SD may run: buckets <= 2),
  # compaction, the refill's reset, prefill, the drafter trainer's, the held-out evaluation's and the warm-up's.
  assert {"train/logprobs", "train/gradient", "train/update", "rollout/reset/8", "rollout/halve/4/8",
          "rollout/speculate/2/3_1_4", "rollout/speculate/1/3_1_4", "drafter/grad/0", "drafter/apply",
          "drafter/eval", "eval/plain/8", "warmup/features", "warmup/step"} <= set(ex)
  assert {f"rollout/plain/{b}" for b in (1, 2, 4, 8)} <= set(ex) and "rollout/speculate/4/3_1_4" not in ex
  assert any(name.startswith("rollout/prefill/8/") for name in ex)
  assert ex["rollout/speculate/2/3_1_4"]["shaped_by"][0] == "rollout.strategies"
  # 32 prompts x 8 samples over 4 groups: 64 rows each through a bucket of 8, refilled.
  assert report["rollout_batches"] == {"rows_per_group": 64, "rows_in_flight": 8, "refill": True,
                                       "tails_with_waves": 8, "tails_with_refill": 1}
  # A paged cache: 64-slot pages (kv_block), 16-token prompts, 12-token mean responses (a quarter of 48).
  rows = report["cache_rows"]
  assert rows["mean_response_len"] == 12 and rows["page_size"] == 64 and rows["contiguous_rows"] == 8
  kv_bytes = 2 * (6 + 1) * 1 * 32 * 4  # k and v, 6 target layers + the drafter's, 1 KV head (not split), float32
  assert rows["kv_bytes_per_token"] == kv_bytes
  assert rows["contiguous_cache_gb"] == round(8 * 128 * kv_bytes / (1 << 30), 3)  # capacity 16 + 48 + 4 - 1, in pages
  assert rows["paged_rows_same_bytes"] == 8 * 2  # a mean row fills 16 + 12 tokens + a 16-step play: 1 page
  assert rows["paged_rows_device_memory"] > 1000  # 1 GB holds thousands of such rows
  # The trainer's float32 masters and AdamW moments (3 x the policy, the moments sharded like their params
  # over fsdp 4: left to XLA they came out replicated) stay resident during a rollout, and a group's copy
  # (tensor-parallel over its 2 devices: the MLP split, the 3 heads and 103-token vocabulary not, with the
  # drafter), the master drafter and the evaluation's copy (laid out alike) too.
  state = report["resident_gb"]
  assert 3 * report["policy_gb"] / 4 <= state["trainer"] < 1.05 * 3 * report["policy_gb"] / 4
  assert report["policy_gb"] / 2 < state["eval"] < report["policy_gb"]
  assert state["rollout"] == pytest.approx(state["eval"], abs=1e-5)
  assert 0 < state["rollout_drafter"] < state["drafter"]  # the drafter's master: + moments
  assert state["drafter"] > 0 and state["reference"] == 0  # no KL term: no reference policy
  assert ex["rollout/plain/8"]["beside_gb"] == pytest.approx(state["trainer"] + state["drafter"] + state["eval"],
                                                            abs=1e-5)
  # Compaction gathers the cache's values apart: the halving of the rest has them beside, their gather the halved keys.
  halve, values = ex["rollout/halve/4/8"], ex["rollout/take_rows/4/8"]
  assert halve["beside_gb"] == pytest.approx(ex["rollout/plain/8"]["beside_gb"] + values["argument_gb"], abs=1e-5)
  assert values["beside_gb"] == pytest.approx(ex["rollout/plain/8"]["beside_gb"] + values["output_gb"], abs=1e-5)
  # The trainer's passes run after the rollouts dropped their copies of the policy: the drafters' stay.
  assert ex["train/update"]["beside_gb"] == pytest.approx(state["drafter"] + state["rollout_drafter"], abs=1e-5)
  assert ex["train/update"]["resident_gb"] < 3 * report["policy_gb"]  # the params and moments split over fsdp
  assert ex["train/clip"]["beside_gb"] == pytest.approx(  # the gradient, in place, beside the trainer's state
      state["trainer"] + state["drafter"] + state["rollout_drafter"], abs=1e-5)
  name = report["max_per_device_executable"]
  assert report["max_per_device_gb"] == pytest.approx(ex[name]["resident_gb"] + ex[name]["beside_gb"], abs=1e-5)
  # The drafter buffer's share of a checkpoint: 32 x 8 samples of this step and the longest quarter
  # of the previous step's, up to 16 + 48 tokens each (62 pairs, 63 tokens, tool flags and 96-float features).
  entries = 256 + 64
  assert report["drafter_buffer_checkpoint_gb"] == round((entries * 63 * (96 * 4 + 5) + entries * 16) / (1 << 30), 6)


def test_dry_run_fails_naming_what_does_not_fit(report):
  executables = report["executables"]
  small = dry_run.check({"train/update": executables["train/update"]}, 1e-5, on_cpu=True)
  assert not small["fits"] and small["max_per_device_executable"] == "train/update"
  # On an accelerator the scratch memory counts too.
  fake = {"a": {"compiled": True, "resident_gb": 1.0, "temp_gb": 5.0, "code_gb": 0.0},
          "b": {"compiled": True, "resident_gb": 2.0, "temp_gb": 0.0, "code_gb": 0.0},
          "c": {"compiled": False, "error": "RESOURCE_EXHAUSTED: ..."}}
  assert dry_run.check(fake, 3.0, on_cpu=True)["max_per_device_executable"] == "b"
  assert dry_run.check(fake, 3.0, on_cpu=False) == {"checked": "resident + temp memory", "failed": ["c"],
                                                    "max_per_device_gb": 6.0, "max_per_device_executable": "a",
                                                    "fits": False}
  assert dry_run.shaped_by("rollout/init/8")[0] == "rollout.engine.batch_buckets"
  assert dry_run.shaped_by("train/gradient")[0] == "rl.actor.micro_batch_rows"


def test_a_lora_dry_run_sizes_the_frozen_base_and_the_adapters(report):
  """With LoRA the trainer holds the base once (frozen, sharded) and masters and AdamW moments for the adapters
  alone; the rollout copy is the merged policy's, as large as without."""
  c = _config(limit_gb=1.0)
  c.policy.lora.rank = 4
  c.eval.every = 0
  lora = dry_run.run(c)
  adapters_gb = lora["lora"]["parameters_m"] * 1e6 * 4 / (1 << 30)
  assert lora["lora"]["rank"] == 4 and lora["parameters_b"] == report["parameters_b"]
  base_gb = lora["policy_gb"] - adapters_gb
  assert base_gb == pytest.approx(report["policy_gb"], rel=1e-3)
  # The base and the adapters' masters and moments, split over fsdp 4.
  state = lora["resident_gb"]["trainer"]
  assert base_gb / 4 < state < (base_gb + 3 * adapters_gb) / 4 * 1.1 < report["resident_gb"]["trainer"] / 2
  ex = lora["executables"]
  assert ex["train/update"]["resident_gb"] < report["executables"]["train/update"]["resident_gb"] / 10
  assert ex["train/rollout_params"]["compiled"]  # the rollouts' merged copy
  assert lora["resident_gb"]["rollout"] == report["resident_gb"]["rollout"] and "eval/plain/8" not in ex


def _target_config(target, devices=2):
  """Seconds-sized shapes for a target's compiler: 2 rollout groups of one device, buckets 1 and 2."""
  c = _config(target=target, devices=devices)
  c.policy.dtype = "bfloat16"  # what the GPU / TPU configs run
  c.rollout.groups, c.rollout.prompts_per_step, c.rollout.num_samples = devices, devices, 2
  c.rollout.engine.batch_buckets = (1, 2)
  c.eval.every = c.drafter.distill.steps = 0  # the evaluation's and the warm-up's: the CPU run's
  return c


@pytest.fixture(scope="module", params=["h100", "tpu-v5e"])
def on_target(request):
  return request.param, dry_run.run(_target_config(request.param))


def test_dry_run_compiles_for_a_gpu_and_a_tpu(on_target):
  """Every executable compiled by the target's own compiler, with no device here, its temporaries counted, and
  the roofline: decode and verify steps at the target's peak."""
  target, report = on_target
  kind = {"h100": "NVIDIA H100 80GB HBM3", "tpu-v5e": "TPU v5 lite"}[target]
  assert report["devices"] == f"2 x {kind}" and report["failed"] == [] and report["fits"]
  # An H100's 79.1 GiB less what JAX leaves (XLA_PYTHON_CLIENT_MEM_FRACTION: 0.95 by default); a TPU's whole 16.
  assert report["device_memory_gb"] == pytest.approx({"h100": 0.95 * 79.109, "tpu-v5e": 16.0}[target], abs=1e-3)
  assert report["checked"] == "resident + temp memory" and dry_run.failure(report) is None
  assert report["arrays_gb"] == 0  # the actor, engines and drafter trainer built on shapes alone
  ex = report["executables"]
  assert {"train/logprobs", "train/gradient", "train/update", "rollout/plain/2", "rollout/speculate/2/3_1_4",
          "rollout/prefill/2/2/16", "drafter/grad/0", "drafter/apply", "drafter/eval"} <= set(ex)
  assert all(e["compiled"] and e["need_gb"] >= e["resident_gb"] + e["temp_gb"] - 1e-5 for e in ex.values())
  roof = report["roofline"]
  assert set(roof["steps"]) == {"1/1", "1/4", "2/1", "2/4"}  # batch 1 and the largest (speculative) bucket 2
  assert all(s["tflops"] > 0 and s["gbytes"] > 0 and s["ms"] > 0 for s in roof["steps"].values())
  assert roof["steps"]["2/4"]["tflops"] > 3 * roof["steps"]["2/1"]["tflops"]  # four tokens' FLOPs a row
  # The bytes a step moves: the weights (bfloat16) and the cache (2 rows x 28 slots x 6 layers x 2 x 32, bfloat16).
  weights = report["policy_gb"] * (1 << 30) / 2 / 1e9
  assert weights < roof["steps"]["2/1"]["gbytes"] < weights + 0.001
  assert set(roof["verify_over_decode"]) == {"1", "2"} and roof["verify_over_decode"]["1"]["4"] >= 1


def test_an_executable_that_does_not_fit_its_target_is_named(on_target):
  """One line naming the executable that needs the most and the keys that lower it."""
  target, report = on_target
  small = {**report, **dry_run.check(report["executables"], 1e-4, on_cpu=False)}
  small["device_memory_gb"] = 1e-4
  name = small["max_per_device_executable"]
  assert dry_run.failure(small) == (
      f"{name} needs {small['max_per_device_gb']:.4g} GB per device > 0.0001 GB ({targets.load(target).name}): "
      + dry_run._REMEDIES[name.split("/")[0]])  # pylint: disable=protected-access


def test_the_cli_fails_in_one_line_and_writes_the_report(tmp_path):
  """An executable the device cannot hold: one line naming it, exit 1, and the report written anyway."""
  from tlt_jax import main  # pylint: disable=import-outside-toplevel
  c = _config(limit_gb=0.005)
  c.workdir = str(tmp_path)
  c.eval.every = 0
  with pytest.raises(SystemExit) as e:
    main._dry_run(c)  # pylint: disable=protected-access
  error = str(e.value.code)
  assert error.startswith("error: dry run: ") and "\n" not in error
  assert " GB per device > 0.005 GB (config.mesh.device_memory_gb): lower " in error
  report = json.loads((tmp_path / "dry_run.json").read_text())
  assert not report["fits"] and error.split("dry run: ")[1].startswith(report["max_per_device_executable"])
  assert error.endswith(f"(report: {tmp_path / 'dry_run.json'})")


def test_a_kernel_the_gpu_cannot_hold_is_named():
  """A Pallas attention kernel whose tiles overflow an L4's 99 KB of shared memory per block: the executables that
  run it do not compile, and the error names the first one with the compiler's message."""
  c = _target_config("l4", devices=1)
  c.rl.actor.micro_batch_rows, c.rollout.speculative, c.rollout.engine.batch_buckets = 1, False, (1,)
  c.model.num_heads, c.model.head_dim = 4, 1024  # bfloat16 [64 x 1024] key and value tiles: 128 KB each
  with pytest.raises(dry_run.DryRunError) as e:
    dry_run.run(c)
  message = str(e.value)
  assert message.startswith("rollout/") and " does not compile for l4 (shaped by config." in message
  assert "Shared memory size limit exceeded" in message
  report = e.value.report
  assert report["executables"]["train/update"]["compiled"]  # no attention kernel there
