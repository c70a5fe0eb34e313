"""What a drafter lets verification accept, before any timing: per draft depth, on the target's own samples.

  python experiments/acceptance.py --model=models/smollm2 --drafter=runs/smollm2/drafter \\
      --prompts=runs/smollm2/eval.jsonl --temperatures=0.6,1 --out=runs/acceptance

The target samples a response to each prompt at each temperature (the rollout engine, its features
captured); over those responses' tokens `tlt_jax.drafter.train.acceptance_ceiling` measures, per draft
depth d (the drafter reading its own d - 1 earlier predictions, as a chain does): 1 - TV(p, q), the
target's mass on the drafter's top-k tokens for k = 1..8 (a tree node's acceptance with those k
children under membership verification), how often the target's draw is among the k children a sampled
draft tree ranks first (q and the draw's known noise: the tree's own nodes) and how often the
drafter's draw coupled to the target's key is the target's. A chain accepting at rate a gives
1 / (1 - a) tokens per verify at most; per temperature, the best trees of 8 to 48 verify tokens at the
tree rates (`train.tree_accept_len`, depths as independent) bound what any tree selection gets. Writes
acceptance.json (with the command, machine, commit and date) and prints one line per (temperature,
depth) and one per temperature for the trees.
"""

from __future__ import annotations

import json
import os

from absl import flags

from tlt_jax import cli
from tlt_jax.drafter import checkpoint, train
from tlt_jax.rl import warmup
from tlt_jax.models import hf
from tlt_jax.prompts import read_prompts

_MODEL = flags.DEFINE_string("model", None, "Target: a Hugging Face model directory.", required=True)
_DRAFTER = flags.DEFINE_string("drafter", None, "Drafter directory (train_drafter output).", required=True)
_PROMPTS = flags.DEFINE_string("prompts", None, "Held-out prompts, JSONL (chat-templated as train_drafter's).",
                               required=True)
_TEMPERATURES = flags.DEFINE_list("temperatures", ["0.6", "1"], "Sampling temperatures.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 256, "Tokens per response at most.", lower_bound=1)
_DEPTH = flags.DEFINE_integer("depth", 4, "Draft depths measured.", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_OUT = flags.DEFINE_string("out", "runs/acceptance", "Output directory.")


def main(argv):
  del argv
  cfg, _ = hf.read_config(_MODEL.value)
  tok = hf.load_tokenizer(_MODEL.value)
  with cli.named("prompts", _PROMPTS.value):
    prompts = read_prompts(_PROMPTS.value, tok, chat=tok is not None and bool(tok.chat_template),
                           max_len=cfg.max_position_embeddings, vocab_size=cfg.vocab_size)
  model = hf.from_pretrained(_MODEL.value, scan_layers=False)
  drafter = checkpoint.load_drafter(_DRAFTER.value, model.config)
  stop = sorted(set(model.config.stop_token_ids) | ({tok.eos_token_id} if tok is not None else set()))
  records, trees = [], []
  for temperature in map(float, _TEMPERATURES.value):
    own = warmup.sample(model, prompts, stop_ids=stop, num_samples=1, temperature=temperature,
                        max_new_tokens=_MAX_NEW.value, seed=_SEED.value)
    pairs = own.pairs(own.samples, max(len(p) for p in prompts) + _MAX_NEW.value)
    ceiling = train.acceptance_ceiling(model, drafter, pairs, temperature=temperature, draft_steps=_DEPTH.value,
                                       seed=_SEED.value)
    for depth, c in enumerate(ceiling, start=1):
      records.append({"temperature": temperature, "depth": depth, **c})
      print(f"T={temperature:g} depth {depth}: 1-TV {c['1-tv']:.3f}  p(top-1 of q) {c['p_top1']:.3f}  "
            f"p(top-4) {c['p_top4']:.3f}  p(top-8) {c['p_top8']:.3f}  coupled {c['coupled']:.3f}  "
            f"tree's 4 / 8 children {c['tree_top4']:.3f} / {c['tree_top8']:.3f}  "
            f"({c['pairs']:.0f} tokens)", flush=True)
    best = train.best_trees(ceiling)
    trees.append({"temperature": temperature, **best})
    print(f"T={temperature:g} best trees: " + "  ".join(f"{v} verify tokens {n:.2f}" for v, n in best.items()),
          flush=True)
  os.makedirs(_OUT.value, exist_ok=True)
  with open(os.path.join(_OUT.value, "acceptance.json"), "w", encoding="utf-8") as f:
    json.dump({**cli.provenance(), "records": records, "best_trees": trees}, f, indent=1)


if __name__ == "__main__":
  cli.run(main)
