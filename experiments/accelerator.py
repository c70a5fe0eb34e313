"""Accelerator figures: SD vs plain decoding per batch size, the bandit vs its arms, TLT vs plain RL steps.

  python experiments/accelerator.py --out=runs/accelerator          # on whatever JAX sees (one GPU)
  python experiments/accelerator.py --out=/tmp/accelerator --smoke  # seconds-sized shapes, any CPU

  # where a command may run 10 minutes at most: each run continues where the last one stopped
  for i in 1 2 3 4 5; do timeout 590 python experiments/accelerator.py --out=runs/accelerator && break; done
  python experiments/accelerator.py --out=runs/accelerator --time_limit_s=400   # starts nothing new after 400 s

One process builds a target and measures it, part by part into --out; a part whose results are
there is skipped, so a killed run continues (the persistent compilation cache, <out>/xla_cache
unless the config or JAX_COMPILATION_CACHE_DIR names one, spares a rerun the compiling):
  target  configs/accelerator.py's target: Qwen2.5-0.5B's shape and Qwen2 architecture (bf16), SFT from
          scratch on the tiny world's worked solutions (tlt_jax.rl.bootstrap, <out>/init/policy), and
          its EAGLE drafter with a reduced-vocabulary head (`drafter.draft_vocab_size`) distilled from
          the policy's own samples (tlt_jax.rl.warmup, <out>/init/drafter). target.json: its size,
          the policy's entropy per token on its own samples (peaked: well under 1 nat), the drafter's
          held-out top-1 agreement.
  grid    plain vs speculative decoding tokens/s at each --batch_sizes for each of the config's
          strategies (configs/r1_7b.py's) on long problems (benchmark.run_grid: compaction off, the
          median of 3 timed rollouts after a warm-up one; saved after each batch size), and at batch 1
          the same drafter scoring the whole vocabulary (`head` full vs reduced). grid.json, grid.csv,
          sd_grid.png.
  bandit  the bandit over SD off + the strategies vs each arm alone vs plain decoding on a rollout of
          --bandit_rows long-tailed problems (benchmark.run_adaptive, as experiments/bandit.py).
          bandit.json, bandit.csv, bandit.png.
  rl      TLT and plain-rollout RL trainers from the target stepping alternately --rl_steps steps
          (experiments/side_by_side.py, as experiments/end_to_end.py): step time split into the
          rollout and the rest, the rewards of each step, the executables each rollout compiled.
          rl.json, rl_steps.csv, rl_step.png.
Then summary.json and a one-screen summary: the device, jax's version, and each figure's headline
against its goal (GOALS). The first step of each trainer compiles and is left out of the timings.

--smoke: the config is --smoke_config (configs/accelerator.py:smoke) instead of --config, and each
measurement flag not given takes its smoke value (SMOKE): seconds-sized shapes, figures that are no
results. --out keeps the settings of its first run (settings.json); a run there with other settings
is refused. --time_limit_s: no part and no grid batch size starts after that many seconds of the run
(the target is always built); the summary names what was left, and a later run continues there.
"""

from __future__ import annotations

import csv
import json
import os
import time

import matplotlib

matplotlib.use("Agg")
import jax  # pylint: disable=wrong-import-position
import matplotlib.pyplot as plt  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
from absl import flags, logging  # pylint: disable=wrong-import-position
from flax import nnx  # pylint: disable=wrong-import-position
from ml_collections import config_flags  # pylint: disable=wrong-import-position

import side_by_side  # pylint: disable=wrong-import-position
from tlt_jax import cli, files  # pylint: disable=wrong-import-position
from tlt_jax import distributed  # pylint: disable=wrong-import-position
from tlt_jax.rl import builders, checks  # pylint: disable=wrong-import-position
from tlt_jax.cli import InputError  # pylint: disable=wrong-import-position
from tlt_jax.drafter import checkpoint  # pylint: disable=wrong-import-position
from tlt_jax.rl import warmup  # pylint: disable=wrong-import-position
from tlt_jax.models import hf  # pylint: disable=wrong-import-position
from tlt_jax.rl import bootstrap, datasets, sft, tasks  # pylint: disable=wrong-import-position
from tlt_jax.rollout import benchmark  # pylint: disable=wrong-import-position

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "accelerator.py")
_CONFIG = config_flags.DEFINE_config_file("config", CONFIG, "The target and its RL run.")
_SMOKE_CONFIG = config_flags.DEFINE_config_file("smoke_config", CONFIG + ":smoke", "The config of --smoke runs.")
_OUT = flags.DEFINE_string("out", "runs/accelerator", "Output directory (a killed run there continues).")
_SMOKE = flags.DEFINE_bool("smoke", False, "Seconds-sized: --smoke_config, and SMOKE's values of the flags not given.")
PARTS = ("grid", "bandit", "rl")
_PARTS = flags.DEFINE_list("parts", list(PARTS), f"Measurements to run (the target is built for any), of {PARTS}.")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "2", "4", "8", "16", "32", "64"], "Batch sizes of the grid.")
_GRID_MIN_TERMS = flags.DEFINE_integer("grid_min_terms", 16, "Fewest terms of the grid's problems (long responses).",
                                       lower_bound=1)
_BANDIT_ROWS = flags.DEFINE_integer("bandit_rows", 64, "Rows (problems) of the bandit's rollout.", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 2, "Timed rounds of the bandit's rollout after its warm-up round.",
                                lower_bound=1)
_RL_STEPS = flags.DEFINE_integer("rl_steps", 4, "RL steps per trainer (the first compiles: not timed).", lower_bound=2)
_DRAFTER_PROMPTS = flags.DEFINE_integer("drafter_prompts", 256, "Problems the drafter's samples answer (10% of them, "
                                        "one at least, held out).", lower_bound=2)
_DRAFTER_SAMPLES = flags.DEFINE_integer("drafter_samples", 4, "The policy's samples per problem for the drafter.",
                                        lower_bound=1)
_TIME_LIMIT = flags.DEFINE_float("time_limit_s", 0.0, "Start no part or grid batch size after this many seconds of "
                                 "the run (0: no limit); a later run continues there.", lower_bound=0.0)
_STARTED = time.perf_counter()
SMOKE = {"batch_sizes": ["1", "2"], "grid_min_terms": 2, "bandit_rows": 2, "repeats": 1, "rl_steps": 2,
         "drafter_prompts": 4, "drafter_samples": 1}
GOALS = {"sd_batch1": ("SD / plain tokens/s at batch 1, best strategy", ">=", 2.0),
         "sd_up_to_16": ("SD / plain at every batch size up to 16, best strategy (the least)", ">", 1.0),
         "bandit": ("bandit / its best arm alone, tokens/s", ">=", 0.95),
         "rl_step": ("plain / TLT RL step time, rewards identical", ">=", 1.3),
         "compilations": ("executables compiled inside rollouts after warm-up", "==", 0)}


def out_of_time() -> bool:
  """Whether --time_limit_s has passed since the process started."""
  return bool(_TIME_LIMIT.value) and time.perf_counter() - _STARTED > _TIME_LIMIT.value


def value(holder: flags.FlagHolder):
  """The flag's value; under --smoke its SMOKE value unless it was given."""
  return SMOKE[holder.name] if _SMOKE.value and not flags.FLAGS[holder.name].present else holder.value


def write_json(path: str, data) -> None:
  with files.atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
    json.dump(data, f, indent=2)


def read_json(path: str):
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def write_csv(path: str, records: list[dict]) -> None:
  with files.atomic_file(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in records for k in r)), extrasaction="ignore")
    writer.writeheader()
    writer.writerows(records)


def check_settings(out: str, config) -> None:
  """Records this run's settings in <out>/settings.json, or refuses a run with others there."""
  settings = json.loads(json.dumps({"smoke": _SMOKE.value, "config": config.to_dict(),
                                    **{name: value(flags.FLAGS[name]) for name in SMOKE}}))
  path = os.path.join(out, "settings.json")
  before = read_json(path)
  if before is None:
    write_json(path, settings)
  elif before != settings:
    changed = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k))
    raise InputError(f"--out={out} holds a run with other settings (differing: {', '.join(changed)}; see its "
                     "settings.json); choose another --out")


def stop_ids(model, tok) -> list[int]:
  return sorted(set(model.config.stop_token_ids) | {tok.eos_token_id})


# ---- target ----

def target(config, out: str):
  """(policy dir, drafter dir, policy, tokenizer, drafter, target.json's record): built when missing."""
  init, path = os.path.join(out, "init"), os.path.join(out, "target.json")
  c = config.copy_and_resolve_references()
  c.workdir, c.policy.path, c.drafter.path = init, "", ""
  policy_dir, drafter_dir = os.path.join(init, "policy"), os.path.join(init, "drafter")
  start = time.perf_counter()
  if not os.path.exists(os.path.join(policy_dir, "config.json")):
    bootstrap.load_policy(c)  # SFT from scratch, saved there
    write_json(os.path.join(init, "sft.json"), {"seconds": round(time.perf_counter() - start, 1)})
  model = hf.from_pretrained(policy_dir, dtype=config.policy.dtype, scan_layers=config.policy.scan_layers)
  tok = hf.load_tokenizer(policy_dir)
  record = read_json(path)
  if record is not None and checkpoint.is_checkpoint(drafter_dir):
    return policy_dir, drafter_dir, model, tok, checkpoint.load_drafter(drafter_dir, model.config), record
  problems = datasets.from_tasks(config.task.family, tok, size=value(_DRAFTER_PROMPTS), seed=config.seed + 3,
                                 difficulty=sft.difficulty(config), max_prompt_len=config.data.max_prompt_len)
  t0 = time.perf_counter()
  own = warmup.sample(model, [ex.prompt_ids for ex in problems], stop_ids=stop_ids(model, tok),
                      num_samples=value(_DRAFTER_SAMPLES), temperature=config.rollout.sampling.temperature,
                      max_new_tokens=config.rollout.sampling.max_new_tokens, seed=config.seed,
                      eval_fraction=max(0.1, 1 / len(problems)))  # one problem held out at least
  sample_s = time.perf_counter() - t0
  d = config.drafter.distill
  drafter, distilled = warmup.distil(model, own, steps=d.steps, batch_rows=d.batch_rows, row_len=d.row_len,
                                     lr=d.learning_rate, draft_vocab_size=config.drafter.draft_vocab_size,
                                     seed=config.seed)
  checkpoint.save_drafter(drafter, drafter_dir)
  logprobs = np.concatenate([s.logprobs for s in own.samples])
  record = {"architecture": model.config.architecture, "dtype": config.policy.dtype,
            "parameters": int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))),
            "vocab_size": model.config.vocab_size, "tokenizer_size": len(tok),
            "sft": read_json(os.path.join(init, "sft.json")), "own_samples": len(own.samples),
            "own_tokens": own.tokens, "entropy_per_token": round(float(-logprobs.mean()), 4),
            "sample_s": round(sample_s, 1), "drafter": distilled, "seconds": round(time.perf_counter() - start, 1)}
  write_json(path, record)
  return policy_dir, drafter_dir, model, tok, drafter, record


# ---- the measurements ----

def grid(config, out: str, model, tok, drafter, saved) -> list[str]:
  """SD vs plain per batch size (the reduced head) and at batch 1 the full head too; saved per batch size
  (then `saved()`). Returns the cells --time_limit_s left unmeasured."""
  path = os.path.join(out, "grid.json")
  records = read_json(path) or []
  sizes = [int(b) for b in value(_BATCH_SIZES)]
  least = value(_GRID_MIN_TERMS)
  difficulty = tasks.Difficulty(min_terms=least, max_terms=max(least, config.task.max_terms))
  prompts = [ex.prompt_ids for ex in datasets.from_tasks(config.task.family, tok, size=max(sizes), seed=config.seed,
                                                         difficulty=difficulty,
                                                         max_prompt_len=config.data.max_prompt_len)]
  strategies = builders.strategies(config)
  heads = [("reduced" if drafter.draft_vocab else "full", drafter, sizes)]
  if drafter.draft_vocab:
    heads.append(("full", drafter.with_full_vocab(), [min(sizes)]))
  left = []
  for head, d, batch_sizes in heads:
    for b in batch_sizes:
      if any(r["head"] == head and r["batch_size"] == b for r in records):
        continue
      if out_of_time():
        left.append(f"grid {head} head batch {b}")
        continue
      cell = benchmark.run_grid(model, d, prompts, [b], strategies, config.rollout.sampling.temperature,
                                config.rollout.sampling.max_new_tokens, config.seed, stop_ids(model, tok))
      records += [{"head": head, "draft_vocab": d.vocab_size, **r} for r in cell]
      write_json(path, records)
      saved()
  write_csv(os.path.join(out, "grid.csv"), records)
  return left


def bandit(config, out: str, model, tok, drafter) -> None:
  problems = datasets.from_tasks(config.task.family, tok, size=value(_BANDIT_ROWS), seed=config.seed + 5,
                                 difficulty=sft.difficulty(config), max_prompt_len=config.data.max_prompt_len)
  records = benchmark.run_adaptive(model, drafter, [ex.prompt_ids for ex in problems], builders.strategies(config),
                                   config.rollout.sampling.temperature, config.rollout.sampling.max_new_tokens,
                                   config.seed, stop_ids(model, tok), config.rollout.engine.sd_max_batch,
                                   value(_REPEATS))
  write_csv(os.path.join(out, "bandit.csv"), [{k: v for k, v in r.items() if not isinstance(v, dict)}
                                             for r in records])
  write_json(os.path.join(out, "bandit.json"), records)


def rl(config, out: str, policy_dir: str, drafter_dir: str) -> None:
  steps = value(_RL_STEPS)
  rows = side_by_side.step_alternately(side_by_side.trainers(config, ["tlt", "baseline"], steps,
                                                             os.path.join(out, "rl"), policy_dir, drafter_dir), steps)
  write_csv(os.path.join(out, "rl_steps.csv"), rows)
  write_json(os.path.join(out, "rl.json"), {"rows": rows, "summary": side_by_side.summary(rows, "baseline")})


# ---- figures and the summary ----

def measured_steps(grid_records) -> dict:
  """Per batch size b of the grid: a plain decode step's milliseconds (b rows at once: b / the plain rollout's
  tokens per second) and, per verify tokens k, a speculative iteration (draft + verify-k + accept) over that
  step (the accepted tokens per verify x plain tokens/s over SD tokens/s): the measured side of the roofline."""
  steps = {}
  for r in grid_records:
    b = r["batch_size"]
    step = steps.setdefault(b, {"plain_step_ms": round(1e3 * b / r["baseline_tokens_per_s"], 3),
                                "iteration_over_plain": {}})
    step["iteration_over_plain"][r["verify_tokens"]] = round(
        r["accept_len"] * r["baseline_tokens_per_s"] / r["tokens_per_s"], 3)
  return steps


def headlines(grid_records, bandit_records, rl_result) -> dict:
  """Each GOALS figure's value (None: its part has not run) and whether it meets its goal."""
  values = dict.fromkeys(GOALS)
  details = {}
  compilations = []
  if grid_records:
    best = {}
    for r in grid_records:
      if r["head"] == grid_records[0]["head"]:
        best[r["batch_size"]] = max(best.get(r["batch_size"], 0.0), r["speedup"])
    details["sd_best_speedup_by_batch"] = best
    details["measured_steps"] = measured_steps([r for r in grid_records if r["head"] == grid_records[0]["head"]])
    values["sd_batch1"] = best.get(1)
    values["sd_up_to_16"] = min((s for b, s in best.items() if b <= 16), default=None)
  if bandit_records:
    values["bandit"] = bandit_records[-1]["vs_best_fixed"]
    compilations += [r["compilations"] for r in bandit_records]
  if rl_result:
    rows, s = rl_result["rows"], rl_result["summary"]
    rewards = {arm: [r["reward/mean"] for r in rows if r["trainer"] == arm] for arm in ("tlt", "baseline")}
    values["rl_step"] = s["step_time_ratio"]["tlt"]
    details["rl"] = {"rewards_identical": s["rewards_identical"], "rewards": rewards,
                     "rollout_share_of_step": {arm: s["rollout_s"][arm] / s["step_s"][arm] for arm in rewards},
                     "step_s": s["step_s"], "rollout_s": s["rollout_s"], "accept_len": s["accept_len"]}
    compilations += [r["rollout/compilations"] for r in rows if r["step"] > 1]
  if bandit_records or rl_result:
    values["compilations"] = int(sum(compilations))
  compare = {">=": lambda v, g: v >= g, ">": lambda v, g: v > g, "==": lambda v, g: v == g}
  goals = {name: {"what": what, "goal": f"{op} {goal}", "value": values[name],
                  "met": None if values[name] is None else bool(compare[op](values[name], goal))}
           for name, (what, op, goal) in GOALS.items()}
  if rl_result:  # different rewards fail the goal whatever the speed
    goals["rl_step"]["met"] &= details["rl"]["rewards_identical"]
  return {"goals": goals, **details}


def plot(out: str, grid_records, bandit_records, rl_result) -> None:
  if grid_records:
    fig, ax = plt.subplots(figsize=(6, 4))
    for head, style in (("reduced", "o-"), ("full", "s--")):
      for name in dict.fromkeys(r["strategy"] for r in grid_records):
        rs = [r for r in grid_records if r["strategy"] == name and r["head"] == head]
        if rs:
          ax.plot([r["batch_size"] for r in rs], [r["speedup"] for r in rs], style, label=f"{name} ({head} head)")
    ax.axhline(1.0, color="gray", lw=1)
    ax.axhline(GOALS["sd_batch1"][2], color="tab:green", lw=1, ls=":", label="goal at batch 1")
    ax.set(xscale="log", xlabel="batch size", ylabel="SD / plain tokens/s", title="speculative decoding speedup")
    ax.set_xticks(sorted({r["batch_size"] for r in grid_records}), [str(b) for b in
                                                                   sorted({r["batch_size"] for r in grid_records})])
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "sd_grid.png"), dpi=100)
    plt.close(fig)
  if bandit_records:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bars = ax.bar([r["mode"] for r in bandit_records], [r["tokens_per_s"] for r in bandit_records],
                  color=["gray", "silver"] + ["tab:blue"] * (len(bandit_records) - 3) + ["tab:orange"])
    for bar, r in zip(bars, bandit_records):
      ax.annotate(f"{r['speedup']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                  va="bottom", fontsize=8)
    ax.set(ylabel="tokens/s (whole rollout)", title="bandit vs its arms alone vs plain")
    ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "bandit.png"), dpi=100)
    plt.close(fig)
  if rl_result:
    s, rows = rl_result["summary"], rl_result["rows"]
    arms = list(s["step_s"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    rollout = [s["rollout_s"][a] for a in arms]
    axes[0].bar(arms, rollout, label="rollout")
    axes[0].bar(arms, [s["step_s"][a] - s["rollout_s"][a] for a in arms], bottom=rollout, label="rest of the step")
    axes[0].set(ylabel="seconds (mean, first step left out)", title="RL step time")
    axes[0].legend()
    for arm in arms:
      rs = [r for r in rows if r["trainer"] == arm]
      axes[1].plot([r["step"] for r in rs], [r["reward/mean"] for r in rs], "o-", label=arm)
    axes[1].set(xlabel="RL step", ylabel="mean reward", title="rewards")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "rl_step.png"), dpi=100)
    plt.close(fig)


RESULTS = {"grid": "grid.json", "bandit": "bandit.json", "rl": "rl.json"}


def write_summary(out: str, target_record, left: list[str]) -> dict:
  """summary.json from the parts' results in --out: written after each grid cell and each part too, so
  that a run killed later (a deadline) still says what it measured."""
  device = jax.devices()[0]
  summary = {"device": f"{len(jax.devices())} x {device.device_kind} ({device.platform})",
             "jax": jax.__version__, "smoke": _SMOKE.value, "target": target_record, "time_limit_left": left,
             **headlines(*(read_json(os.path.join(out, RESULTS[part])) for part in PARTS))}
  write_json(os.path.join(out, "summary.json"), summary)
  return summary


def report(out: str, target_record, left: list[str]) -> dict:
  summary = write_summary(out, target_record, left)
  plot(out, *(read_json(os.path.join(out, RESULTS[part])) for part in PARTS))
  t = target_record
  lines = [f"device: {summary['device']}, jax {summary['jax']}" + ("  [SMOKE: shapes, not results]" if _SMOKE.value
                                                                   else ""),
           f"target: {t['architecture']} {t['parameters'] / 1e6:.2f}M parameters ({t['dtype']}), entropy "
           f"{t['entropy_per_token']:.3f} nats/token on its own samples; drafter top-1 held out "
           f"{t['drafter'].get('top1_heldout', float('nan')):.3f}, head {t['drafter']['draft_vocab_size']} of "
           f"{t['vocab_size']} tokens"]
  for name, g in summary["goals"].items():
    shown = "not run" if g["value"] is None else f"{g['value']:.3f}" if isinstance(g["value"], float) else g["value"]
    verdict = "" if g["met"] is None else "MET" if g["met"] else "NOT MET"
    lines.append(f"{name:>13}: {shown:>8}  goal {g['goal']:<7} {verdict:<8} {g['what']}")
  if "rl" in summary:
    r = summary["rl"]
    shares = ", ".join(f"{a} {v:.0%}" for a, v in r["rollout_share_of_step"].items())
    lines.append(f"  rl: rollout share of the step {shares}; rewards identical: {r['rewards_identical']}")
  if "sd_best_speedup_by_batch" in summary:
    lines.append("  sd: " + ", ".join(f"b{b} {s:.2f}x" for b, s in summary["sd_best_speedup_by_batch"].items()))
  if left:
    lines.append(f"  --time_limit_s left for a later run: {', '.join(left)}")
  print("\n".join(lines), flush=True)
  return summary


def main(argv):
  del argv
  out = _OUT.value
  config = cli.config_value(_SMOKE_CONFIG if _SMOKE.value else _CONFIG).copy_and_resolve_references()
  unknown = [p for p in _PARTS.value if p not in PARTS]
  if unknown:
    raise InputError(f"--parts={','.join(_PARTS.value)}: unknown {unknown}; known: {list(PARTS)}")
  try:
    sizes = [int(b) for b in value(_BATCH_SIZES)]
  except ValueError:
    raise InputError(f"--batch_sizes={','.join(value(_BATCH_SIZES))}: expected integers") from None
  if not sizes or min(sizes) < 1:
    raise InputError(f"--batch_sizes={','.join(value(_BATCH_SIZES))}: expected positive integers")
  try:
    checks.check(config)
  except ValueError as e:
    raise InputError(str(e)) from None
  os.makedirs(out, exist_ok=True)
  check_settings(out, config)
  if not config.rollout.compilation_cache_dir and not jax.config.jax_compilation_cache_dir:
    config.rollout.compilation_cache_dir = os.path.join(out, "xla_cache")
  distributed.setup_devices(config)
  logging.info("devices: %s", jax.devices())

  policy_dir, drafter_dir, model, tok, drafter, target_record = target(config, out)
  left = []
  saved = lambda: write_summary(out, target_record, left)
  for part in PARTS:
    done = read_json(os.path.join(out, RESULTS[part])) is not None
    if part not in _PARTS.value or (done and part != "grid"):  # the grid continues batch size by batch size
      continue
    if out_of_time() and part != "grid":  # the grid names the batch sizes it leaves
      left.append(part)
      continue
    start = time.perf_counter()
    if part == "grid":
      left += grid(config, out, model, tok, drafter, saved)
    elif part == "bandit":
      bandit(config, out, model, tok, drafter)
    else:
      rl(config, out, policy_dir, drafter_dir)
    logging.info("%s: %.1f s", part, time.perf_counter() - start)
    saved()
  report(out, target_record, left)


if __name__ == "__main__":
  cli.run(main)
