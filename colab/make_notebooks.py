"""Writes colab/*.ipynb (without outputs) from the cells below: `python colab/make_notebooks.py`.

The notebooks are generated so that their code stays reviewable here; they only call tlt_jax's
public API (configs, `tlt_jax.rl.bootstrap` and `tlt_jax.rl.trainer`, the CLIs). Each has a cell
tagged "parameters" whose `SMOKE = False` the test suite flips (tests/test_notebooks.py).
"""

from __future__ import annotations

import os

import nbformat
from nbformat import v4

HERE = os.path.dirname(os.path.abspath(__file__))

SETUP = '''\
# On Colab: clone and install tlt_jax, unless it is importable already (a local checkout or install).
import importlib.util
import os
import sys

if importlib.util.find_spec("tlt_jax") is None:
  if not REPO_URL:
    raise RuntimeError("tlt_jax is not installed: set REPO_URL (parameters cell) to the repository's git URL")
  !git clone --depth 1 {REPO_URL} /content/tlt_jax
  !{sys.executable} -m pip install -q -e /content/tlt_jax
  sys.path.insert(0, "/content/tlt_jax")
import jax
import tlt_jax

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(tlt_jax.__file__)))
sys.path.insert(0, REPO_DIR)  # the configs/ directory
print("tlt_jax from", REPO_DIR, "| JAX", jax.__version__)'''

PLOT = '''\
from IPython.display import Image, display
from tlt_jax import report

# Reward (training, and held-out where evaluated), response length, rollout time and acceptance per step.
figure = report.figure(records, os.path.join(WORKDIR, "run.png"))
if figure:
  display(Image(figure))'''


def tiny_notebook():
  return [
      v4.new_markdown_cell(
          "# TLT on the tiny world\n\n"
          "RL (GRPO/DAPO) of a 0.8M-parameter Qwen3-architecture policy on procedural arithmetic, with and "
          "without TLT: an SFT warm start, the drafter's warm-up, then RL steps whose rollouts decode the "
          "long tail speculatively (a bandit picks the strategy per batch size) while finished rollout "
          "groups train the drafter. Runs on a CPU, GPU or TPU runtime; no downloads. On a 2-core CPU the "
          "whole notebook takes ~15 minutes (SFT ~4, drafter warm-up ~1, 8 steps per arm)."),
      v4.new_code_cell(
          'SMOKE = False  # True: seconds-sized shapes, one RL step per arm (what the test suite runs)\n'
          'STEPS = 8  # RL steps per arm\n'
          'WORKDIR = "runs/colab_tiny"\n'
          'REPO_URL = ""  # git URL of the tlt_jax repository, cloned and installed when tlt_jax is not importable',
          metadata={"tags": ["parameters"]}),
      v4.new_code_cell(SETUP),
      v4.new_markdown_cell(
          "The config is `configs/tiny.py` (every key and its default: `tlt_jax/config.py`). On an accelerator "
          "runtime the rollout groups are as many as the devices allow."),
      v4.new_code_cell(
          'import math\n\n'
          'from configs import tiny\n'
          'from tlt_jax import config as config_lib\n'
          'from tlt_jax import metrics\n'
          'from tlt_jax.rl import bootstrap\n'
          'from tlt_jax.rl.trainer import Trainer\n\n'
          'config = tiny.get_config("smoke" if SMOKE else "")\n'
          'config.unlock()\n'
          'config.workdir = WORKDIR\n'
          'config.steps = 1 if SMOKE else STEPS\n'
          'config_lib.setup_devices(config)  # simulated CPU devices on a CPU runtime; before any computation\n'
          'config.rollout.groups = math.gcd(config.rollout.groups, jax.device_count())\n'
          'print(jax.devices())'),
      v4.new_markdown_cell(
          "## SFT warm start and drafter warm-up\n\n"
          "Both land in the workdir and are reused when they are there: the policy learns worked solutions "
          "of the task, and an EAGLE drafter is distilled from it on the same data."),
      v4.new_code_cell(
          'policy, tok = bootstrap.load_policy(config)  # SFT into WORKDIR/policy\n'
          'drafter = bootstrap.load_drafter(config, policy, tok)  # distillation into WORKDIR/drafter\n'
          'print(policy.config)'),
      v4.new_markdown_cell(
          "## RL: TLT vs plain rollouts\n\n"
          "Two trainers from the same SFT policy and drafter; the baseline sets `rollout.speculative=False`. "
          "Speculative decoding is lossless, so both sample the same tokens and their reward curves coincide; "
          "only the step time differs. `experiments/end_to_end.py` runs the same comparison with a third arm "
          "(SD with a frozen drafter), stepping the arms alternately."),
      v4.new_code_cell(
          'records = {}\n'
          'for arm, speculative in (("TLT", True), ("baseline", False)):\n'
          '  c = config.copy_and_resolve_references()\n'
          '  c.rollout.speculative = speculative\n'
          '  c.policy.path = os.path.join(WORKDIR, "policy")\n'
          '  c.drafter.path = os.path.join(WORKDIR, "drafter")\n'
          '  c.workdir = os.path.join(WORKDIR, arm)\n'
          '  trainer = Trainer(c, *bootstrap.load(c))\n'
          '  try:\n'
          '    trainer.run()\n'
          '  finally:\n'
          '    trainer.close()\n'
          '  records[arm] = metrics.read(os.path.join(c.workdir, "metrics.jsonl"))'),
      v4.new_code_cell(PLOT),
      v4.new_code_cell(
          'for arm, rs in records.items():\n'
          '  timed = rs[1:] or rs  # the first step compiles\n'
          '  mean = lambda key: sum(r.get(key, 0.0) for r in timed) / len(timed)\n'
          '  print(f"{arm:9s} step {mean(\'time/step_s\'):.2f} s  rollout {mean(\'time/rollout_s\'):.2f} s  "\n'
          '        f"reward {rs[-1][\'reward/mean\']:.3f}  acceptance length {mean(\'rollout/accept_len\'):.2f}")'),
  ]


def qwen_notebook():
  return [
      v4.new_markdown_cell(
          "# TLT on Qwen2.5-0.5B-Instruct (Colab GPU / TPU)\n\n"
          "Downloads Qwen2.5-0.5B-Instruct and GSM8K, warms up an EAGLE drafter on the model's own samples, "
          "runs a few RL steps with TLT (`configs/qwen2_5_0_5b.py`) and shows the acceptance length and the "
          "speculative-decoding speedup. `SMOKE = True` runs the same cells offline on a CPU with a tiny "
          "local policy and procedural problems (the test suite does)."),
      v4.new_code_cell(
          'SMOKE = False  # True: offline, a tiny local policy and procedural problems\n'
          'MODEL_ID = "Qwen/Qwen2.5-0.5B-Instruct"\n'
          'WORK = "runs/colab_qwen"  # model, data, drafter and RL workdir (on Colab under /content)\n'
          'STEPS = 3  # RL steps\n'
          'REPO_URL = ""  # git URL of the tlt_jax repository, cloned and installed when tlt_jax is not importable',
          metadata={"tags": ["parameters"]}),
      v4.new_code_cell(SETUP),
      v4.new_code_cell(
          'from configs import qwen2_5_0_5b, tiny\n'
          'from tlt_jax import config as config_lib\n'
          'from tlt_jax import metrics\n'
          'from tlt_jax.rl import bootstrap, tasks\n'
          'from tlt_jax.rl.trainer import Trainer\n\n'
          'config = qwen2_5_0_5b.get_config("smoke" if SMOKE else "")\n'
          'config.unlock()\n'
          'config_lib.setup_devices(config)  # before any computation\n'
          'print(jax.devices())'),
      v4.new_markdown_cell(
          "## Model and data\n\n"
          "The policy is a local Hugging Face directory; the prompts a local JSONL file of "
          "`{\"prompt\", \"answer\"}` rows (rewards: `math_verify` against the answer)."),
      v4.new_code_cell(
          'import json\n\n'
          'os.makedirs(WORK, exist_ok=True)\n'
          'if SMOKE:  # offline: the tiny world\'s policy and drafter (tlt_tiny.ipynb\'s or built here), problems\n'
          '  tiny_config = tiny.get_config("smoke")\n'
          '  tiny_config.unlock()\n'
          '  tiny_config.workdir = "runs/colab_tiny"\n'
          '  bootstrap.load_drafter(tiny_config, *bootstrap.load_policy(tiny_config))\n'
          '  MODEL_DIR = os.path.join(tiny_config.workdir, "policy")\n'
          '  difficulty = tasks.Difficulty(max_terms=tiny_config.task.max_terms)\n'
          '  rows = [{"prompt": p.prompt, "answer": p.answer}\n'
          '          for p in tasks.generate("basic_arithmetic", 64, seed=0, difficulty=difficulty)]\n'
          'else:\n'
          '  import datasets\n'
          '  from huggingface_hub import snapshot_download\n'
          '  MODEL_DIR = snapshot_download(MODEL_ID, local_dir=os.path.join(WORK, MODEL_ID.split("/")[-1]))\n'
          '  gsm8k = datasets.load_dataset("openai/gsm8k", "main", split="train")\n'
          '  rows = [{"prompt": r["question"], "answer": r["answer"].split("####")[-1].strip()} for r in gsm8k]\n'
          'DATA = os.path.join(WORK, "gsm8k_train.jsonl")\n'
          'DRAFTER_PROMPTS = os.path.join(WORK, "drafter_prompts.jsonl")\n'
          'for path, part in ((DATA, rows), (DRAFTER_PROMPTS, rows[:512])):\n'
          '  with open(path, "w", encoding="utf-8") as f:\n'
          '    f.writelines(json.dumps(r) + "\\n" for r in part)\n'
          'print(MODEL_DIR, len(rows), "prompts")'),
      v4.new_markdown_cell(
          "## Drafter warm-up\n\n"
          "An EAGLE drafter distilled from the policy's own samples on the first 512 prompts "
          "(`python -m tlt_jax.train_drafter`; ~10-20 minutes on a T4). In smoke mode: the tiny world's drafter, "
          "warmed up by the trainer on the tiny policy's SFT data."),
      v4.new_code_cell(
          'if SMOKE:  # the tiny world\'s warmed-up drafter\n'
          '  DRAFTER = os.path.join(tiny_config.workdir, "drafter")\n'
          'else:\n'
          '  DRAFTER = os.path.join(WORK, "drafter")\n'
          '  if not os.path.isdir(DRAFTER):\n'
          '    args = f"--model={MODEL_DIR} --prompts={DRAFTER_PROMPTS} --output={DRAFTER} --num_samples=4"\n'
          '    !{sys.executable} -m tlt_jax.train_drafter {args} --steps=400 --max_new_tokens=512 --row_len=768'),
      v4.new_markdown_cell(
          "## RL with TLT\n\n"
          "Each step: rollouts whose long tail decodes speculatively (the bandit picks a strategy or SD off "
          "per batch size), rewards, GRPO advantages, the actor update. `rollout/accept_len` is the mean number "
          "of tokens each verify pass accepted."),
      v4.new_code_cell(
          'config.policy.path, config.data.path, config.drafter.path = MODEL_DIR, DATA, DRAFTER\n'
          'config.workdir = os.path.join(WORK, "rl")\n'
          'config.steps = 1 if SMOKE else STEPS\n'
          'trainer = Trainer(config, *bootstrap.load(config))\n'
          'try:\n'
          '  trainer.run()\n'
          'finally:\n'
          '  trainer.close()\n'
          'records = metrics.read(os.path.join(config.workdir, "metrics.jsonl"))\n'
          'for r in records:\n'
          '  print(f"step {r[\'step\']}: reward {r[\'reward/mean\']:.3f}, "\n'
          '        f"acceptance length {r[\'rollout/accept_len\']:.2f}, "\n'
          '        f"drafter version {r[\'drafter/version\']:.0f}, rollout {r[\'time/rollout_s\']:.1f} s")'),
      v4.new_markdown_cell(
          "## Speculative-decoding speedup\n\n"
          "The trained policy (exported by the trainer) with the warm-up drafter, SD vs plain decoding on "
          "the same prompts per batch size (`tlt_jax.rollout.benchmark`, compilation excluded)."),
      v4.new_code_cell(
          'from tlt_jax.rollout import benchmark\n'
          'from tlt_jax.drafter import checkpoint\n'
          'from tlt_jax.models import hf\n'
          'from tlt_jax.rl import datasets as tlt_datasets\n\n'
          'policy_dir = os.path.join(config.workdir, "export", "policy")\n'
          'model = hf.from_pretrained(policy_dir, dtype=config.policy.dtype)\n'
          'tok = hf.load_tokenizer(policy_dir)\n'
          'drafter = checkpoint.load_drafter(DRAFTER, model.config)\n'
          'batch_sizes = [1] if SMOKE else [1, 4, 16]\n'
          'dataset = tlt_datasets.from_file(DATA, tok, max_prompt_len=config.data.max_prompt_len)\n'
          'prompts = [ex.prompt_ids for ex in dataset][:max(batch_sizes)]\n'
          'grid = benchmark.run_grid(model, drafter, prompts, batch_sizes, config_lib.strategies(config),\n'
          '                          temperature=1.0, max_new_tokens=8 if SMOKE else 512, seed=0,\n'
          '                          stop_ids=[tok.eos_token_id])\n'
          'for r in grid:\n'
          '  print(f"batch {r[\'batch_size\']:3d} {r[\'strategy\']:7s} acceptance length {r[\'accept_len\']:.2f}  "\n'
          '        f"speedup {r[\'speedup\']:.2f}x")'),
  ]


def write(cells, name: str) -> None:
  for i, cell in enumerate(cells):
    cell.id = f"cell-{i}"  # stable ids: regenerating an unchanged notebook changes nothing
  nb = v4.new_notebook(cells=cells, metadata={
      "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
      "language_info": {"name": "python"}, "accelerator": "GPU", "colab": {"provenance": []}})
  nbformat.validate(nb)
  nbformat.write(nb, os.path.join(HERE, name))


if __name__ == "__main__":
  write(tiny_notebook(), "tlt_tiny.ipynb")
  write(qwen_notebook(), "tlt_qwen2_5_0_5b.ipynb")
