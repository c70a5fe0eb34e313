"""Supervised warm start of the tiny policy on worked solutions, then a held-out evaluation.

`run(config)` (the CLI `python -m tlt_jax.sft`) writes `<workdir>/policy`, a Hugging Face model
directory with the tokenizer, and `<workdir>/sft_report.json`; `warm_start` is the SFT alone (the
RL bootstrap's, tlt_jax.rl.bootstrap).
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from flax import nnx
from tqdm import tqdm

from tlt_jax import packing
from tlt_jax.models import CausalLM, hf
from tlt_jax.rl import builders
from tlt_jax.rl import datasets, scorer, tasks, tokenizer as tokenizer_lib, tools
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.state import EngineConfig
from tlt_jax.rollout.sampling import SamplingParams

# Difficulty bins (number of terms) for the accuracy report.
BINS = (("2-3", 2, 3), ("4-7", 4, 7), ("8-15", 8, 15), ("16+", 16, 1 << 30))


def difficulty(config) -> tasks.Difficulty:
  return tasks.Difficulty(min_terms=config.task.min_terms, max_terms=config.task.max_terms,
                          tail_alpha=config.task.tail_alpha, min_digits=config.task.min_digits,
                          max_digits=config.task.max_digits)


def build_policy(config, tok) -> CausalLM:
  """A fresh policy of `model.*`'s architecture and shape for the tokenizer `tok` (the tiny world's:
  Qwen3, tied embeddings, the tokenizer's vocabulary)."""
  return CausalLM(builders.model_config(config, tok), rngs=nnx.Rngs(config.seed))


def sequences(examples, tok, unanswered: float = 0.0, seed: int = 0, turns: tools.ToolTurns | None = None,
              tool_share: float = 1.0):
  """(prompt ids, worked solution + EOS, trained mask) of each example: the SFT targets.

  `unanswered`: the fraction of solutions (a seeded choice) that stop after their last step,
  without the `Answer:` line the reward reads: a sloppy teacher's habit that SFT copies and RL
  can unlearn (see configs/tiny.py). With tool `turns` (a calculator among them), `tool_share` of
  the solutions (another seeded choice) are two turns instead: a calculator call on the problem's
  expression, then `Answer:` with its result; the tool turn's tokens are masked, as in RL.
  """
  rng = np.random.default_rng([seed, 0xA45])
  drop = rng.random(len(examples)) < unanswered
  call = rng.random(len(examples)) < (tool_share if turns is not None else 0.0)
  encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]
  out = []
  for ex, cut, tool in zip(examples, drop, call):
    if tool:
      expression = ex.extra_info["entry"]["metadata"]["expression"]
      first = encode(tools.call_text("calculator", {"expression": expression})) + [tok.eos_token_id]
      appended = turns.turn([{"name": "calculator", "result": tools.calculator(expression)}]).tokens.tolist()
      last = encode(f"{tasks.ANSWER_PREFIX} {ex.ground_truth}") + [tok.eos_token_id]
      out.append((ex.prompt_ids, first + appended + last, [True] * len(first) + [False] * len(appended)
                  + [True] * len(last)))
    else:
      response = encode(ex.solution.rpartition("\n")[0] if cut else ex.solution) + [tok.eos_token_id]
      out.append((ex.prompt_ids, response, [True] * len(response)))
  return out


def lm_loss(model: CausalLM, tokens, positions, segments, loss_mask):
  """Mean next-token cross-entropy over the loss mask; packed samples never see each other."""
  hidden, _, _ = model(tokens, positions, None, packing.segment_mask(segments))
  logits = model.logits(hidden[:, :-1])
  weights = loss_mask[:, 1:]
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
  return (ce * weights).sum() / jnp.maximum(weights.sum(), 1)


def train(config, model: CausalLM, rows: np.ndarray) -> list[float]:
  """Adam(W) on packed rows; returns the loss curve."""
  s = config.sft
  schedule = optax.warmup_cosine_decay_schedule(0.0, s.learning_rate, s.warmup_steps, s.steps)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                          optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=s.weight_decay))
  graphdef, params = nnx.split(model)
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(lambda p: lm_loss(nnx.merge(graphdef, p), *batch))(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(config.seed)
  order = np.empty(0, np.int64)
  losses = []
  with tqdm(range(s.steps), desc="sft", unit="step") as bar:
    for _ in bar:
      while len(order) < s.batch_rows:
        order = np.concatenate([order, rng.permutation(rows.shape[1])])
      take, order = order[:s.batch_rows], order[s.batch_rows:]
      params, opt_state, loss = step(params, opt_state, tuple(rows[:, take]))
      losses.append(float(loss))
      bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
  nnx.update(model, params)
  return losses


def length_stats(lengths) -> dict[str, float]:
  x = np.asarray(lengths)
  return {"median": float(np.median(x)), "p90": float(np.percentile(x, 90)), "p99": float(np.percentile(x, 99)),
          "max": int(x.max()), "p99_over_median": float(np.percentile(x, 99) / max(np.median(x), 1))}


def evaluate(config, model: CausalLM, tok, held_out: datasets.Dataset, turns: tools.ToolTurns | None = None) -> dict:
  """Greedy accuracy by difficulty and response lengths (greedy and temperature 1) on held-out problems;
  with tool `turns`, multi-turn, and the tool calls per response."""
  prompts = [ex.prompt_ids for ex in held_out]
  # Compaction off: for a policy this small, compiling every bucket costs more than decoding
  # the tail at full batch.
  engine_config = EngineConfig(batch_buckets=tuple(2**i for i in range(9)), max_prompt_len=max(map(len, prompts)),
                               max_new_tokens=config.sft.eval_max_new_tokens, kv_block=64, compact=False)
  report = {}
  for name, temperature in (("greedy", 0.0), ("temperature_1", 1.0)):
    engine = Engine(model, engine_config, SamplingParams(
        temperature=temperature, max_new_tokens=config.sft.eval_max_new_tokens, stop_token_ids=(tok.eos_token_id,),
        seed=config.seed), turns=turns)
    rollout = engine.generate(prompts)
    responses = [tok.decode(s.answer, skip_special_tokens=True) for s in rollout.samples]
    scores, stats = scorer.Scorer(workers=0).score("reasoning_gym", [ex.item(r) for ex, r in zip(held_out, responses)])
    correct = scores >= 1.0
    terms = np.asarray([ex.extra_info["num_terms"] for ex in held_out])
    by_bin = {}
    for label, lo, hi in BINS:
      sel = (terms >= lo) & (terms <= hi)
      if sel.any():
        by_bin[label] = {"accuracy": float(correct[sel].mean()), "problems": int(sel.sum())}
    report[name] = {"accuracy": float(correct.mean()), "mean_reward": float(scores.mean()),
                    "accuracy_by_terms": by_bin, "reward_failures": stats["failures"],
                    "response_length": length_stats([len(s.tokens) for s in rollout.samples]),
                    "truncated": sum(s.finish_reason == "length" for s in rollout.samples),
                    "tokens_per_s": rollout.metrics.tokens_per_s}
    if turns is not None:
      report[name]["tool_calls_per_response"] = float(np.mean([len(s.tool_calls) for s in rollout.samples]))
  return report


def warm_start(config, tok) -> tuple[CausalLM, list[float]]:
  """A fresh tiny policy trained on worked solutions (with `rollout.tools`, calculator calls too: the
  prompts show the tools); returns it and its loss curve."""
  train_set = datasets.from_tasks(config.task.family, tok, size=config.sft.num_problems, seed=config.seed,
                                  difficulty=difficulty(config), tools=builders.tool_schemas(config))
  turns = builders.tool_turns(config, tok, workers=0)
  try:
    rows = packing.pack(sequences(train_set, tok, config.sft.unanswered, config.seed, turns, config.sft.tool_share),
                        config.sft.row_len, truncate=False)
  except ValueError as e:  # no solution fits a row
    raise ValueError(f"config.sft.row_len={config.sft.row_len}: {e}") from None
  model = build_policy(config, tok)
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  logging.info("tiny policy: %.2fM parameters; %d packed rows of %d tokens", n_params / 1e6, rows.shape[1],
               config.sft.row_len)
  return model, train(config, model, rows)


def run(config: ml_collections.ConfigDict) -> dict:
  """SFT of a fresh tiny policy, saved to <workdir>/policy, and its held-out report (also written to
  <workdir>/sft_report.json)."""
  start = time.perf_counter()
  tok = tokenizer_lib.build_tokenizer(config.model.max_position_embeddings)
  model, losses = warm_start(config, tok)
  train_s = time.perf_counter() - start
  held_out = datasets.from_tasks(config.task.family, tok, size=config.sft.eval_size, seed=config.seed + 1,
                                 difficulty=difficulty(config), tools=builders.tool_schemas(config))
  policy_dir = os.path.join(config.workdir, "policy")
  hf.save_pretrained(model, policy_dir, tokenizer=tok)
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  report = {"parameters": int(n_params), "steps": config.sft.steps, "loss_first": losses[0], "loss_last": losses[-1],
            "train_s": round(train_s, 1), "policy": policy_dir,
            **evaluate(config, model, tok, held_out, builders.tool_turns(config, tok, workers=0))}
  report["wall_s"] = round(time.perf_counter() - start, 1)
  with open(os.path.join(config.workdir, "sft_report.json"), "w", encoding="utf-8") as f:
    json.dump(report, f, indent=2)
  return report

