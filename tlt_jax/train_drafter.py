"""Offline drafter warm-up: distil an EAGLE drafter from a target's own samples.

  python -m tlt_jax.train_drafter --model=DIR --output=DIR [--overwrite] \\
      [--prompts=FILE.jsonl | --task=basic_arithmetic --num_prompts=512] \\
      [--num_samples=1 --temperature=0 --max_new_tokens=256 --steps=360 --epochs=16 --eval_every=100 --patience=3 \\
       --batch_rows=8 --row_len=512 --learning_rate=3e-3 --draft_vocab_size=-1 --draft_vocab_coverage=0.99 \\
       --draft_steps=0 --eagle3_layers= --eval_fraction=0.1 --seed=0]

Samples responses from the target with the rollout engine, distils a fresh drafter on them
(`tlt_jax.rl.warmup`), saves it to --output (`tlt_jax.drafter.checkpoint`), reloads it to
check, and prints a JSON summary. --output must not be an input (--model, --prompts) or hold
one; an existing non-empty --output is replaced only when it is a drafter checkpoint and
--overwrite is given. Flags, prompts, --row_len and --output are checked before any sampling;
a bad one is one line `error: ...`. Prompt lines are {"prompt": "text"} (chat-templated when the
tokenizer has a template, as RL prompts are) or {"prompt_ids": [...]}. The last --eval_fraction
of the prompts is held out: training (at most --epochs passes over the training rows, at most --steps)
keeps the drafter of its best held-out loss, measured at least once an epoch, and stops when that stops
improving (`loss_heldout_history` in the summary); the summary reports held-out top-1 agreement and,
sampling (--temperature > 0), what verification can accept per draft step
(`heldout_acceptance_per_draft_step`: 1 - TV, the target's mass on the drafter's top-1 / 4 / 8 tokens,
how often the target's draw is among a sampled draft tree's first 4 / 8 children, the coupled draw's
agreement), and what to expect: `heldout_chain_accept_len`, the tokens per verify pass a chain of 3
drafts (strategy 3_1_4) would accept on the held-out samples at those per-step rates (top-1 greedy, the
coupled draw's sampling), and sampling, `heldout_tree_accept_len`: the best trees' of 8 to 48 verify
tokens at the tree rates (`train.tree_accept_len`). Sampled responses train
the drafter for that temperature: the loss's distribution term at it, weighted as its features, and
two draft steps of training-time test.

The target's features come from the sampling rollout itself (captured while decoding, no
recomputation, as the online trainer gets them); an EAGLE-3 drafter, which reads three target
layers the rollout does not keep, recomputes them with one forward pass over each sequence.
The drafter's head is reduced to the most frequent response tokens of its training samples: by
default the fewest that cover --draft_vocab_coverage (99%) of them, rounded up to a multiple of 256
and at most 32768 (the whole vocabulary when that is not smaller); `--draft_vocab_size=N` takes N of
them, `--draft_vocab_size=0` the target's whole vocabulary. The summary reports the head's size and
how many of the training and held-out response tokens it covers.
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import numpy as np
from absl import flags
from flax import nnx
from tqdm import tqdm

from tlt_jax import cli
from tlt_jax.cli import InputError
from tlt_jax.drafter import checkpoint, train
from tlt_jax.rl import warmup
from tlt_jax.drafter.model import check_feature_layers
from tlt_jax.models import hf
from tlt_jax.prompts import read_prompts
from tlt_jax.rl import datasets, tasks

_MODEL = flags.DEFINE_string("model", None, "Target: a Hugging Face model directory.", required=True)
_SCAN_LAYERS = cli.define_scan_layers()
_OUTPUT = flags.DEFINE_string("output", None, "Directory to write the drafter checkpoint to.", required=True)
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace the drafter checkpoint already at --output (nothing "
                               "else is ever replaced).")
_PROMPTS = flags.DEFINE_string("prompts", None, "Prompts JSONL file (exclusive with --task).")
_TASK = flags.DEFINE_string("task", None, "Procedural task family, e.g. basic_arithmetic (exclusive with --prompts).")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 512, "Prompts generated for --task.", lower_bound=1)
flags.mark_flags_as_mutual_exclusive(["prompts", "task"], required=True)
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 1, "Samples per prompt (more than one: give --temperature > 0).",
                                    lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature of the responses the drafter learns "
                                  "from; 0 = greedy (the states greedy decoding visits).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 256, "Tokens generated at most per sample (fewer for a prompt "
                                "that leaves fewer of the model's positions).")
cli.check_sampling_flags(temperature=_TEMPERATURE, max_new_tokens=_MAX_NEW)
flags.register_multi_flags_validator(["num_samples", "temperature"],
                                     lambda f: f["num_samples"] == 1 or f["temperature"] > 0,
                                     "--num_samples > 1 needs --temperature > 0 (greedy draws one response)")
_STEPS = flags.DEFINE_integer("steps", 360, "Training steps at most (training stops earlier once the held-out "
                              "loss stops improving: --eval_every, --patience); 360: ~30 min for a 135M target "
                              "on 2 CPU cores at two draft steps (--temperature > 0).", lower_bound=1)
_EPOCHS = flags.DEFINE_float("epochs", 16.0, "Passes over the training rows at most (fewer steps than --steps on a "
                             "small set, which trains for more epochs than a large one; 0: --steps alone).",
                             lower_bound=0.0)
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 100, "Steps between held-out evaluations, at most an epoch's; the "
                                   "drafter saved is the best one's (0: the last step's).", lower_bound=0)
_PATIENCE = flags.DEFINE_integer("patience", 3, "Evaluations without a better held-out loss before training stops "
                                 "(0: it runs all --steps).", lower_bound=0)
_BATCH_ROWS = flags.DEFINE_integer("batch_rows", 8, "Packed rows per training step.", lower_bound=1)
_ROW_LEN = flags.DEFINE_integer("row_len", 512, "Tokens per packed row; longer sequences are truncated.",
                                lower_bound=2)
_LR = flags.DEFINE_float("learning_rate", 3e-3, "Peak learning rate (warmup, then cosine decay).", lower_bound=0.0)
_DRAFT_VOCAB = flags.DEFINE_integer("draft_vocab_size", -1, "Tokens of the draft head, the most frequent of the "
                                    "training responses: -1 = the fewest covering --draft_vocab_coverage of them "
                                    f"(rounded up to a multiple of {train.HEAD_MULTIPLE}, at most {train.HEAD_CAP}); "
                                    "0 = the target's whole vocabulary.", lower_bound=-1)
_COVERAGE = flags.DEFINE_float("draft_vocab_coverage", train.HEAD_COVERAGE, "Share of the training response tokens "
                               "a head chosen by coverage (--draft_vocab_size=-1) holds, in (0, 1].")
flags.register_validator("draft_vocab_coverage", lambda v: 0 < v <= 1, "--draft_vocab_coverage must lie in (0, 1]")
_DRAFT_STEPS = flags.DEFINE_integer("draft_steps", 0, "Draft steps trained (EAGLE-3's training-time test): step k "
                                    "feeds the drafter its own step k-1 features, as drafting a chain does; 0 = 1 for "
                                    "greedy samples, 2 at --temperature > 0.", lower_bound=0)
_EAGLE3 = flags.DEFINE_list("eagle3_layers", [], "Three target layer indices (low,mid,high) for an EAGLE-3 "
                            "drafter; empty = EAGLE-1.")
_EVAL_FRACTION = flags.DEFINE_float("eval_fraction", 0.1, "Fraction of the prompts held out for evaluation.",
                                    lower_bound=0.0, upper_bound=0.5)
_SEED = flags.DEFINE_integer("seed", 0, "Seed for prompts, sampling, drafter init and batch order.")


def build_prompts(model_dir: str, tokenizer, cfg) -> list[list[int]]:
  if _PROMPTS.value is not None:
    chat = tokenizer is not None and bool(tokenizer.chat_template)
    with cli.named("prompts", _PROMPTS.value):
      return read_prompts(_PROMPTS.value, tokenizer, chat=chat, max_len=cfg.max_position_embeddings,
                          vocab_size=cfg.vocab_size)
  if _TASK.value not in tasks.FAMILIES:
    raise InputError(f"--task={_TASK.value}: unknown task family; known: {sorted(tasks.FAMILIES)}")
  if tokenizer is None:
    raise InputError(f"--task needs a tokenizer in --model={model_dir}; give --prompts with 'prompt_ids' instead")
  with cli.named("model", model_dir):  # the tokenizer's chat template
    dataset = datasets.from_tasks(_TASK.value, tokenizer, size=_NUM_PROMPTS.value, seed=_SEED.value)
  return [ex.prompt_ids for ex in dataset]


def feature_layers(num_layers: int) -> tuple[int, ...]:
  flag = f"--eagle3_layers={','.join(_EAGLE3.value)}"
  try:
    layers = tuple(int(x) for x in _EAGLE3.value)
  except ValueError:
    raise InputError(f"{flag}: expected integers") from None
  try:
    check_feature_layers(num_layers, layers)
  except ValueError as e:
    raise InputError(f"{flag}: {e}") from None
  return layers


def run() -> dict:
  start = time.perf_counter()
  cli.check_output("output", _OUTPUT.value, {"model": _MODEL.value, "prompts": _PROMPTS.value},
                   kind="a drafter checkpoint", is_own=checkpoint.is_checkpoint, overwrite=_OVERWRITE.value)
  with cli.named("model", _MODEL.value):  # flags, prompts and output are checked before the weights load
    cfg, _ = hf.read_config(_MODEL.value)
    tokenizer = hf.load_tokenizer(_MODEL.value)
  layers = feature_layers(cfg.num_layers)
  if _DRAFT_VOCAB.value > cfg.vocab_size:
    raise InputError(f"--draft_vocab_size={_DRAFT_VOCAB.value} is larger than the target's vocabulary of "
                     f"{cfg.vocab_size}")
  prompts = build_prompts(_MODEL.value, tokenizer, cfg)
  longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
  if len(prompts[longest]) >= _ROW_LEN.value:
    raise InputError(f"--row_len={_ROW_LEN.value} cannot hold prompt {longest} ({len(prompts[longest])} tokens as "
                     "encoded) and a response token; raise it above the longest prompt")
  with cli.named("model", _MODEL.value):
    model = hf.from_pretrained(_MODEL.value, scan_layers=cli.scan_layers(_SCAN_LAYERS))
  stop = set(cfg.stop_token_ids) | ({tokenizer.eos_token_id} if tokenizer is not None and
                                    tokenizer.eos_token_id is not None else set())
  max_new, _ = cli.token_budgets(prompts, _MAX_NEW.value, cfg.max_position_embeddings)
  with tqdm(total=len(prompts) * _NUM_SAMPLES.value, desc="rollout", unit="sample", file=sys.stderr) as bar:
    own = warmup.sample(model, prompts, stop_ids=sorted(stop), num_samples=_NUM_SAMPLES.value,
                        temperature=_TEMPERATURE.value, max_new_tokens=max_new, seed=_SEED.value,
                        eval_fraction=_EVAL_FRACTION.value, capture_hidden=not layers,
                        on_progress=lambda done, _: bar.update(done))
  rollout_s = time.perf_counter() - start

  with tqdm(total=_STEPS.value, desc="distill", unit="step", file=sys.stderr) as bar:
    def on_step(_, metrics):
      bar.total = metrics["steps"]  # --epochs may plan fewer than --steps
      bar.set_postfix(loss=f"{metrics['loss']:.3f}", top1=f"{metrics['top1']:.2f}", refresh=False)
      bar.update(1)

    drafter, distilled = warmup.distil(model, own, steps=_STEPS.value, batch_rows=_BATCH_ROWS.value,
                                       row_len=_ROW_LEN.value, lr=_LR.value, feature_layers=layers,
                                       draft_vocab_size=_DRAFT_VOCAB.value, head_coverage=_COVERAGE.value,
                                       draft_steps=train.sampling_draft_steps(_DRAFT_STEPS.value, _TEMPERATURE.value),
                                       temperature=_TEMPERATURE.value, eval_every=_EVAL_EVERY.value,
                                       patience=_PATIENCE.value, epochs=_EPOCHS.value, seed=_SEED.value,
                                       on_step=on_step)

  checkpoint.save_drafter(drafter, _OUTPUT.value)
  reloaded = checkpoint.load_drafter(_OUTPUT.value, model.config)
  same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), nnx.state(drafter, nnx.Param),
                      nnx.state(reloaded, nnx.Param))
  if not all(jax.tree.leaves(same)):
    raise RuntimeError(f"{_OUTPUT.value}: the reloaded drafter differs from the trained one")

  summary = {"samples": len(own.samples), "tokens": own.tokens, **distilled}
  summary.update({"drafter": os.path.abspath(_OUTPUT.value), "rollout_s": round(rollout_s, 1),
                  "seconds": round(time.perf_counter() - start, 1)})
  return summary


def main(argv):
  del argv
  print(json.dumps(run()))


if __name__ == "__main__":
  cli.run(main)
