"""The GPU check's figures plan: what experiments/accelerator.py can measure in the seconds a part has.

`plan` estimates each piece on an H100 (FLOPs at its bf16 rate and ASSUMED efficiencies, HBM at its
bandwidth, compile times from an H200 run) and picks the sizes and parts that fit; experiments/gpu_check.py
passes them to accelerator.py as flags. Pure Python: no JAX.
"""

from __future__ import annotations

import math

H100 = {"bf16_flops": 989e12, "hbm_bytes_per_s": 3.35e12}
# Efficiencies and compile times the plan assumes. Measured on an H200 (2026-11-27, docs/BENCHMARKS.md
# "The GPU check on an H200"): the SFT's 277 steps in 43 s, its first 14 s (float32 at 116 TFLOP/s:
# 3x slower than the bf16 MFU below); the drafter's 256 samples in 54 s, mostly compiling the engine's 8
# batch buckets; distillation's 260 steps in 24 s. The rest are guesses until a run measures them.
ASSUMED = {"mfu": 0.35,  # of the bf16 peak, for training steps and batched forwards
           "float32_slowdown": 3.0,  # SFT and distillation train in float32 (TF32 matmuls)
           "hbm_efficiency": 0.6,  # of the peak bandwidth, decode steps
           "step_floor_s": 2e-3,  # a decode step's least time (kernel launches of 24 layers)
           "bucket_compile_s": 6.0,  # an Engine's executables for one batch bucket at the 0.5B shape
           "jit_compile_s": 15.0,  # the SFT or distillation step
           "trainer_compile_s": 90.0,  # an RL trainer's first step: its rollout, log-probs and update
           "start_s": 40.0,  # imports, device, building or loading the target
           "report_s": 15.0}
GRID_PRIORITY = (1, 16, 4, 8, 2, 64, 32)  # the goals need 1 and up to 16 first
TRAIN_FLOOR = 0.4  # the least share of its planned training the target gets to leave time for the grid at batch 1


def model_costs(c) -> dict:
  """Parameters, FLOPs per token of a forward (the LM head's matmul included), bytes of the bf16 weights."""
  m = c.model
  q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
  layer = m.hidden_size * (2 * q + 2 * kv) + 3 * m.hidden_size * m.intermediate_size
  embed = m.vocab_size * m.hidden_size
  params = m.num_layers * layer + embed * (1 if m.tie_word_embeddings else 2)
  draft_vocab = c.drafter.draft_vocab_size or m.vocab_size
  drafter = layer + 5 * m.hidden_size**2 + m.hidden_size * draft_vocab  # a layer, fuse (3h x h), fc (2h x h), head
  return {"parameters": params, "forward_flops": 2 * (m.num_layers * layer + embed), "bytes": 2 * params,
          "drafter_flops": 2 * drafter, "head_flops": 2 * embed}


def estimates(c, sizes: dict) -> dict:
  """{piece: {"flops", "seconds"}} on an H100 under ASSUMED, for accelerator.py at `sizes`."""
  a, mc = ASSUMED, model_costs(c)
  train_rate = H100["bf16_flops"] * a["mfu"] / a["float32_slowdown"]

  def step_s(batch: int) -> float:  # one decode step of `batch` rows
    return max(a["step_floor_s"], mc["bytes"] / (H100["hbm_bytes_per_s"] * a["hbm_efficiency"])
               + batch * mc["forward_flops"] / (H100["bf16_flops"] * a["mfu"]))

  def buckets(rows: int) -> int:  # the engine's batch buckets a rollout of `rows` rows compiles as they drain
    return sum(b <= rows for b in c.rollout.engine.batch_buckets) or 1

  new = c.rollout.sampling.max_new_tokens
  strategies = len(c.rollout.strategies)
  out = {}
  sft_flops = sizes["sft_steps"] * c.sft.batch_rows * c.sft.row_len * 3 * mc["forward_flops"]
  out["sft"] = {"flops": sft_flops, "seconds": a["jit_compile_s"] + sft_flops / train_rate}
  rows = sizes["drafter_prompts"] * sizes["drafter_samples"]
  out["drafter_samples"] = {"flops": rows * new * mc["forward_flops"],
                            "seconds": buckets(rows) * a["bucket_compile_s"]
                                       + math.ceil(rows / 128) * new * step_s(min(rows, 128))}
  d = c.drafter.distill
  distil_flops = sizes["distill_steps"] * d.batch_rows * d.row_len * (3 * mc["drafter_flops"] + mc["head_flops"])
  out["distill"] = {"flops": distil_flops, "seconds": a["jit_compile_s"] + distil_flops / train_rate}
  # accelerator.py's grid: plain and each arm per batch size (the drafter's reduced head), then the arms
  # with the full head at the least batch size (grid_full)
  cells = [(f"grid_b{b}", b, 1 + strategies) for b in sizes["batch_sizes"]]
  if c.drafter.draft_vocab_size:
    cells.append(("grid_full", min(sizes["batch_sizes"]), strategies))
  for piece, b, engines in cells:
    out[piece] = {"flops": engines * 4 * b * new * mc["forward_flops"],
                  "seconds": engines * (a["bucket_compile_s"] + 4 * new * step_s(b))}
  modes = 3 + strategies  # plain, SD off, each arm, the bandit
  rows = sizes["bandit_rows"]
  out["bandit"] = {"flops": modes * (sizes["repeats"] + 1) * rows * new * mc["forward_flops"],
                   "seconds": modes * (buckets(rows) * a["bucket_compile_s"]
                                       + (sizes["repeats"] + 1) * new * step_s(min(rows, 128)))}
  rows = c.rollout.prompts_per_step * c.rollout.num_samples
  update_flops = rows * c.rl.row_len * 4 * mc["forward_flops"]  # log-probs recomputed, then forward + backward
  out["rl"] = {"flops": 2 * sizes["rl_steps"] * (rows * new * mc["forward_flops"] + update_flops),
               "seconds": 2 * (a["trainer_compile_s"] + sizes["rl_steps"] * (
                   new * step_s(min(rows, 128)) + update_flops / (H100["bf16_flops"] * a["mfu"])))}
  return out


def plan(c, available: float, done: dict, sizes: dict | None = None) -> dict:
  """accelerator.py's sizes (fixed on a first run: its --out refuses others later) and the parts that fit
  in `available` seconds after the pieces `done` (target, grid batch sizes, bandit, rl) are left out.
  The target's training takes up to 30% + 8% of the time (SFT, distillation), less, down to TRAIN_FLOOR
  of that, where the grid at batch 1 (the headline: SD vs plain) would not fit otherwise."""
  a = ASSUMED
  if sizes is None:
    sizes = {"sft_steps": 1, "distill_steps": 1, "drafter_prompts": 128, "drafter_samples": 2, "bandit_rows": 32,
             "repeats": 2, "rl_steps": 3, "batch_sizes": [GRID_PRIORITY[0]]}
    unit = estimates(c, sizes)
    per_sft, per_distil = unit["sft"]["seconds"] - a["jit_compile_s"], unit["distill"]["seconds"] - a["jit_compile_s"]
    sft_s, distil_s = min(0.3 * available, 120.0), min(0.08 * available, 40.0)
    rest = (a["start_s"] + a["report_s"] + 2 * a["jit_compile_s"] + unit["drafter_samples"]["seconds"]
            + unit[f"grid_b{GRID_PRIORITY[0]}"]["seconds"])
    scale = min(1.0, max(TRAIN_FLOOR, (available - rest) / (sft_s + distil_s)))
    sizes["sft_steps"] = int(max(20, min(c.sft.steps, scale * sft_s / per_sft)))
    sizes["distill_steps"] = int(max(20, min(c.drafter.distill.steps, scale * distil_s / per_distil)))
    sizes["batch_sizes"] = list(GRID_PRIORITY)  # narrowed below to those that fit
    est = estimates(c, sizes)
    left = available - a["start_s"] - a["report_s"] - sum(est[k]["seconds"] for k in ("sft", "drafter_samples",
                                                                                      "distill"))
    # The bandit and the RL step (goals too) keep their time from the grid's later cells where they would fit
    # after its first two (1 and 16: SD's goals).
    later = est["bandit"]["seconds"] + est["rl"]["seconds"]
    first = sum(est[f"grid_b{b}"]["seconds"] for b in GRID_PRIORITY[:2])
    reserve = later if first + later <= left else 0.0
    chosen = []
    for b in GRID_PRIORITY:
      if est[f"grid_b{b}"]["seconds"] <= left - reserve or not chosen:
        chosen.append(b)
        left -= est[f"grid_b{b}"]["seconds"]
    sizes["batch_sizes"] = chosen
  est = estimates(c, sizes)
  left = available - a["start_s"] - a["report_s"]
  target_pieces = ("sft", "drafter_samples", "distill")
  if not done.get("target"):
    left -= sum(est[k]["seconds"] for k in target_pieces)
  fits = {}
  grid = [f"grid_b{b}" for b in sizes["batch_sizes"]] + (["grid_full"] if "grid_full" in est else [])
  for piece in grid + ["bandit", "rl"]:
    if done.get(piece):
      fits[piece] = "done"
    elif est[piece]["seconds"] <= left and not (piece in grid and "does not fit" in fits.values()):
      fits[piece] = "fits"  # (the grid's cells run in order: none after one that does not fit)
      left -= est[piece]["seconds"]
    else:
      fits[piece] = "does not fit"
  parts = [p for p, pieces in (("grid", grid), ("bandit", ["bandit"]), ("rl", ["rl"]))
           if any(fits[x] == "fits" for x in pieces)]
  target_s = 0.0 if done.get("target") else sum(est[k]["seconds"] for k in target_pieces)
  return {"sizes": sizes, "parts": parts, "fits": fits, "available_s": round(available),
          "target_s": round(target_s), "estimates": {k: {"tflop": round(v["flops"] / 1e12, 1),
                                                         "seconds": round(v["seconds"])} for k, v in est.items()},
          "enough_for_target": target_s + a["start_s"] + a["report_s"] <= available}
