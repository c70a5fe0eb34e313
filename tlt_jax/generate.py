"""Sample from a Hugging Face model directory with the rollout engine.

  python -m tlt_jax.generate --model=DIR --prompts=IN.jsonl --output=OUT.jsonl \\
      [--max_new_tokens=256 --temperature=1.0 --top_p=1.0 --top_k=0 --seed=0 --num_samples=1 --batch_size=64]
      [--drafter=DIR|random|suffix --strategy=4_2_8[,s4_1_5,...] --sd_max_batch=32 --suffix_bank_len=4096]

Input lines are {"prompt": "text"} (needs a tokenizer in DIR; `--chat` applies its chat
template) or {"prompt_ids": [1, 2, 3]}. Output lines: prompt_index, sample_index, output_ids,
text (with a tokenizer), finish_reason. A JSON summary goes to stdout, a progress bar to stderr.
Each prompt generates up to --max_new_tokens, or fewer when it leaves fewer of the model's
positions (its own budget only; the cut prompts are reported on stderr and counted in the
summary's `cut_prompts`).
With `--drafter`, rows decode speculatively once at most `--sd_max_batch` are active; the
summary then reports target verify passes and the mean acceptance length (tokens per pass).
`--drafter=suffix` needs no drafter model: drafts are suffix matches in each prompt's token bank
(the prompt and its samples' tokens, `--suffix_bank_len` per prompt), and `--strategy` shapes
are suffix strategies ('4_1_5' reads as 's4_1_5'). With a drafter model, 's'-strategies (e.g.
`--strategy=4_2_8,s4_1_5`) are suffix arms beside the EAGLE ones; several strategies are chosen
between (and SD off) by a bandit.
The output file appears only when generation succeeded (written to a temporary path, renamed);
bad flags or input (`--output` that is `--prompts`, a damaged model) fail with one line
`error: ...` before any work.
"""

from __future__ import annotations

import json
import sys

from absl import flags
from flax import nnx
from tqdm import tqdm

from tlt_jax import cli, files
from tlt_jax.drafter import checkpoint
from tlt_jax.drafter.model import Drafter
from tlt_jax.models import hf
from tlt_jax.prompts import read_prompts
from tlt_jax.rollout.bandit import Bandit
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.speculative import Strategy
from tlt_jax.rollout.state import EngineConfig

_MODEL = flags.DEFINE_string("model", None, "Hugging Face model directory.", required=True)
_SCAN_LAYERS = cli.define_scan_layers()
_PROMPTS = flags.DEFINE_string("prompts", None, "Input JSONL file.", required=True)
_OUTPUT = flags.DEFINE_string("output", None, "Output JSONL file.", required=True)
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 256, "Tokens to generate at most per sample (fewer for a prompt "
                                "that leaves fewer of the model's positions).")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "0 = greedy.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass, in (0, 1].")
_TOP_K = flags.DEFINE_integer("top_k", 0, "0 = off.")
cli.check_sampling_flags(max_new_tokens=_MAX_NEW, temperature=_TEMPERATURE, top_p=_TOP_P, top_k=_TOP_K)
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 1, "Samples per prompt.", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch_size", 64, "Rows decoded together at most (rounded up to a power of two).",
                              lower_bound=1)
_CHAT = flags.DEFINE_bool("chat", False, "Apply the tokenizer's chat template to text prompts.")
_DTYPE = flags.DEFINE_enum("dtype", None, list(hf.DTYPES), "Compute dtype (default: the checkpoint's).")
_DRAFTER = flags.DEFINE_string("drafter", None, "Drafter directory (train_drafter output), 'random' (testing), or "
                               "'suffix' (no model: drafts from each prompt's token bank).")
_STRATEGY = flags.DEFINE_list("strategy", ["4_2_8"], "Speculative strategies depth_topk_verify (with --drafter), "
                              "'s' in front for a suffix one; several: a bandit picks.")
_SD_MAX_BATCH = flags.DEFINE_integer("sd_max_batch", 32, "Speculate while at most this many rows are active.",
                                     lower_bound=1)
_BANK_LEN = flags.DEFINE_integer("suffix_bank_len", 4096, "Suffix strategies: tokens banked per prompt at most "
                                 "(its prompt and its samples' responses).", lower_bound=2)


def strategies(names: list[str], drafter: str | None) -> tuple[Strategy, ...]:
  """The strategies `--strategy` names (none without `--drafter`); with `--drafter=suffix`, suffix ones."""
  if not drafter:
    return ()
  out = []
  for name in names:
    try:
      out.append(Strategy.parse(name, suffix_only=drafter == "suffix"))
    except ValueError as e:
      raise cli.InputError(f"--strategy={','.join(names)}: {e}") from None
  if not out:
    raise cli.InputError("--strategy: name at least one strategy (e.g. 4_2_8)")
  if len({s.name for s in out}) < len(out):
    raise cli.InputError(f"--strategy={','.join(names)}: a strategy is named twice")
  return tuple(out)


def main(argv):
  del argv
  cli.check_output("output", _OUTPUT.value, {"prompts": _PROMPTS.value, "model": _MODEL.value})
  arms = strategies(_STRATEGY.value, _DRAFTER.value)
  with cli.named("model", _MODEL.value):  # the cheap parts first: config, tokenizer, prompts, drafter
    cfg, _ = hf.read_config(_MODEL.value)
    tokenizer = hf.load_tokenizer(_MODEL.value)
  with cli.named("prompts", _PROMPTS.value):
    prompts = read_prompts(_PROMPTS.value, tokenizer, chat=_CHAT.value, max_len=cfg.max_position_embeddings,
                           vocab_size=cfg.vocab_size)
  drafter = None
  if _DRAFTER.value == "random":
    drafter = Drafter(cfg, rngs=nnx.Rngs(_SEED.value))
  elif _DRAFTER.value and _DRAFTER.value != "suffix":
    with cli.named("drafter", _DRAFTER.value):
      drafter = checkpoint.load_drafter(_DRAFTER.value, cfg)
  with cli.named("model", _MODEL.value):
    model = hf.from_pretrained(_MODEL.value, dtype=_DTYPE.value, scan_layers=cli.scan_layers(_SCAN_LAYERS))
  stop = set(cfg.stop_token_ids)
  if tokenizer is not None and tokenizer.eos_token_id is not None:
    stop.add(tokenizer.eos_token_id)
  max_new, cut = cli.token_budgets(prompts, _MAX_NEW.value, cfg.max_position_embeddings)
  buckets = [1]
  while buckets[-1] < _BATCH.value:
    buckets.append(buckets[-1] * 2)
  longest = max(map(len, prompts))
  if any(s.suffix for s in arms) and _BANK_LEN.value < longest + 2:
    raise cli.InputError(f"--suffix_bank_len={_BANK_LEN.value}: must hold the longest prompt ({longest} tokens) + 2")
  engine = Engine(
      model, EngineConfig(batch_buckets=tuple(buckets), max_prompt_len=longest, max_new_tokens=max_new,
                          strategies=arms, sd_max_batch=_SD_MAX_BATCH.value, suffix_bank_len=_BANK_LEN.value),
      SamplingParams(temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value, max_new_tokens=max_new,
                     stop_token_ids=tuple(sorted(stop)), seed=_SEED.value), drafter=drafter,
      bandit=Bandit(arms, seed=_SEED.value) if len(arms) > 1 else None)
  with tqdm(total=len(prompts) * _NUM_SAMPLES.value, unit="sample", file=sys.stderr) as bar:
    tokens = [0]

    def progress(rows, new_tokens):
      tokens[0] += new_tokens
      bar.set_postfix(tokens=tokens[0], refresh=False)
      bar.update(rows)

    rollout = engine.generate(prompts, num_samples=_NUM_SAMPLES.value, max_total_len=cfg.max_position_embeddings,
                              on_progress=progress)

  with files.atomic_file(_OUTPUT.value) as tmp, open(tmp, "w", encoding="utf-8") as f:
    for s in rollout.samples:
      rec = {"prompt_index": s.prompt_index, "sample_index": s.sample_index, "output_ids": s.tokens.tolist(),
             "finish_reason": s.finish_reason}
      if tokenizer is not None:
        rec["text"] = tokenizer.decode(s.tokens, skip_special_tokens=True)
      f.write(json.dumps(rec) + "\n")
  m = rollout.metrics
  print(json.dumps({"samples": len(rollout.samples), "tokens": m.tokens, "cut_prompts": len(cut),
                    "wall_s": round(m.wall_s, 4), "tokens_per_s": round(m.tokens_per_s, 2),
                    "prefill_s": round(m.prefill_s, 4), "decode_s": round(m.decode_s, 4),
                    "compact_s": round(m.compact_s, 4), "sd_s": round(m.sd_s, 4), "verify_passes": m.verify_passes,
                    "accept_len": round(m.accept_len, 3), "executables": len(engine.pool)}))


if __name__ == "__main__":
  cli.run(main)
