"""What an RL run starts from, built from its config: the tokenizer, the prompts, the policy and the
drafter, made first when the tiny world's are missing (SFT warm start of the policy, distillation
of a drafter). `Trainer(config, *load(config))` is a run (tlt_jax.main).

Several processes: process 0 alone creates a missing tiny policy or drafter (the others wait, then
read them).
"""

from __future__ import annotations

import os
from typing import NamedTuple, Sequence

from absl import logging
from flax import nnx
from tqdm import tqdm

from tlt_jax import config as config_lib
from tlt_jax import distributed
from tlt_jax.drafter import checkpoint as drafter_checkpoint
from tlt_jax.drafter import train as drafter_train
from tlt_jax.rl import warmup
from tlt_jax.drafter.model import Drafter
from tlt_jax.models import CausalLM, hf, lora
from tlt_jax.rl import checks
from tlt_jax.rl import builders, datasets, rewards, rollouts, sft, tokenizer as tokenizer_lib


class Loaded(NamedTuple):
  """A run's inputs, in the order `Trainer` takes them after the config."""

  policy: CausalLM
  tokenizer: object
  drafter: Drafter | None  # None: the rollout needs no drafter model (rollouts.uses_drafter)
  prompts: datasets.Dataset
  eval_sets: dict[str, datasets.Dataset]  # the held-out prompts ("") and eval.sets' ({}: eval.every=0)


def load(config) -> Loaded:
  """The run's inputs. Prompt files are read, and checked, before the policy loads or the tiny
  policy's SFT warm start runs; errors (OSError, ValueError) name the config key."""
  checks.check(config)
  rollouts.check(config)
  tok = load_tokenizer(config)
  prompts = load_prompts(config, tok)
  eval_sets = load_eval_sets(config, tok) if config.eval.every else {}
  warm = None  # the drafter warm-up's examples, checked before the SFT warm start
  if rollouts.uses_drafter(config) and _missing(config.drafter.path or os.path.join(config.workdir, "drafter")):
    warm = _warmup_examples(config, tok, prompts)
    check_warmup(config, warm)
  policy, tok = load_policy(config)
  drafter = load_drafter(config, lora.merged(policy), tok, prompts, warm) if rollouts.uses_drafter(config) else None
  return Loaded(policy, tok, drafter, prompts, eval_sets)


def load_tokenizer(config):
  """The policy's tokenizer, without the policy (to read the prompts with before it loads)."""
  if config.policy.path:
    try:
      hf.read_config(config.policy.path)
      tok = hf.load_tokenizer(config.policy.path)
    except (OSError, ValueError) as e:
      raise ValueError(f"config.policy.path={config.policy.path!r}: {e}") from None
    if tok is None:
      raise FileNotFoundError(f"config.policy.path={config.policy.path!r}: no tokenizer "
                              "(tokenizer.json / tokenizer_config.json) to encode prompts with")
    return tok
  policy_dir = os.path.join(config.workdir, "policy")
  if os.path.exists(os.path.join(policy_dir, "config.json")):
    return hf.load_tokenizer(policy_dir)
  return tokenizer_lib.build_tokenizer(config.model.max_position_embeddings)  # what SFT saves with the policy


def lora_spec(config) -> lora.Spec | None:
  """The LoRA adapters `policy.lora` asks for (those of the PEFT adapter at `policy.lora.path`, else fresh ones);
  None: full fine-tuning."""
  c = config.policy.lora
  if not c.path:
    return lora.Spec(c.rank, c.alpha, c.target_modules) if c.rank else None
  try:
    spec = lora.read_spec(c.path)
  except lora.AdapterError as e:
    raise ValueError(f"config.policy.lora.path={c.path!r}: {e}") from None
  if c.rank and c.rank != spec.rank:
    raise ValueError(f"config.policy.lora.rank={c.rank}: the adapter at policy.lora.path has rank {spec.rank} (0: "
                     f"the adapter's)")
  return spec


def load_policy(config) -> tuple[CausalLM, object]:
  """The policy (computing in `policy.dtype`, its weights in `policy.weight_dtype`; with LoRA, the frozen
  base in `policy.dtype` and its adapters in `policy.weight_dtype`) and its tokenizer: `policy.path`, else
  the tiny world's (SFT into the workdir if absent)."""
  p = config.policy
  policy_dir = p.path or os.path.join(config.workdir, "policy")
  if not p.path and _missing(os.path.join(policy_dir, "config.json")):
    if distributed.primary():
      logging.info("no policy in %s: SFT warm start of the tiny policy", policy_dir)
      tok = tokenizer_lib.build_tokenizer(config.model.max_position_embeddings)
      model, losses = sft.warm_start(config, tok)
      logging.info("SFT loss %.3f -> %.3f", losses[0], losses[-1])
      hf.save_pretrained(model, policy_dir, tokenizer=tok)
    distributed.barrier("tiny policy")
  if not p.path:
    check_workdir_policy(config, policy_dir)
  spec = lora_spec(config)
  model = hf.from_pretrained(policy_dir, dtype=p.dtype, param_dtype=p.weight_dtype if spec is None else p.dtype,
                             scan_layers=p.scan_layers)
  if spec is not None:
    attach_lora(config, model, spec)
  return model, hf.load_tokenizer(policy_dir)


_SHAPE_KEYS = ("architecture", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
               "head_dim")


def check_workdir_policy(config, policy_dir: str) -> None:
  """The tiny world's policy found in the workdir has `config.model`'s shape: ValueError naming the keys
  that differ (another config, e.g. a smoke variant, trained it there)."""
  found = hf.read_config(policy_dir)[0]
  differ = [f"{k}={getattr(found, k)!r}" for k in _SHAPE_KEYS if getattr(found, k) != config.model[k]]
  if differ:
    wanted = ", ".join(f"{k.split('=')[0]}={config.model[k.split('=')[0]]!r}" for k in differ)
    raise ValueError(f"config.workdir={config.workdir!r}: its policy ({policy_dir}) has {', '.join(differ)}; "
                     f"config.model asks for {wanted} (another config trained it): set config.workdir to another "
                     "directory or remove this one")


def attach_lora(config, model: CausalLM, spec: lora.Spec) -> None:
  """`policy.lora`'s adapters (`spec`, from `lora_spec`) on `model` (in place): a PEFT adapter from
  `policy.lora.path`, or fresh ones; ValueError naming the key for targets that select nothing or an adapter
  that does not fit."""
  c, dtype = config.policy.lora, hf.DTYPES[config.policy.weight_dtype]
  key = "policy.lora.path" if c.path else "policy.lora.target_modules"
  try:
    if c.path:
      lora.load_peft(model, c.path, param_dtype=dtype)
    else:
      lora.attach(model, spec, param_dtype=dtype, seed=config.seed)
  except lora.AdapterError as e:
    raise ValueError(f"config.{key}={config_lib.config_value(config, key)!r}: {e}") from None


def _missing(path: str) -> bool:
  """Whether `path` is absent, as process 0 sees it (the processes must take the same branch)."""
  return distributed.allgather(not os.path.exists(path))[0]


def load_drafter(config, policy: CausalLM, tok, prompts: datasets.Dataset | None = None,
                 examples: Sequence[datasets.Example] | None = None) -> Drafter:
  """`drafter.path` or <workdir>/drafter; else a new drafter distilled (the warm-up), saved there: on
  the tiny world's SFT data, or, for a pretrained policy, on its own responses to the first
  `drafter.distill.prompts` training prompts (`prompts`, else `load_prompts`), sampled at the rollout's
  temperature and token budget (no top-k / top-p). `examples`: the warm-up's (`_warmup_examples`), already
  checked, where the caller has them."""
  path = config.drafter.path or os.path.join(config.workdir, "drafter")
  if not _missing(path):
    return drafter_checkpoint.load_drafter(path, policy.config)
  if not distributed.primary():
    distributed.barrier("warm-up drafter")
    return drafter_checkpoint.load_drafter(path, policy.config)
  d = config.drafter.distill
  if config.policy.path:
    prompts = prompts or load_prompts(config, tok)
  if examples is None:
    examples = _warmup_examples(config, tok, prompts)
    check_warmup(config, examples)
  if config.policy.path:
    warm_prompts = [e.prompt_ids for e in examples]
    logging.info("drafter warm-up: sampling the policy's responses to %d training prompts (the first "
                 "drafter.distill.prompts=%d of %d)", len(warm_prompts), d.prompts, len(prompts))
    with tqdm(total=len(warm_prompts), desc="drafter warm-up samples", unit="sample") as bar:
      own = warmup.sample(policy, warm_prompts, stop_ids=(tok.eos_token_id,), num_samples=1,
                          temperature=config.rollout.sampling.temperature,
                          max_new_tokens=config.rollout.sampling.max_new_tokens, seed=config.seed,
                          capture_hidden=False, on_progress=lambda done, _: bar.update(done))
    sequences = [(p, s.tokens) for p, s in zip(own.prompts, own.samples)]
  else:
    sequences = sft.sequences(examples, tok, turns=builders.tool_turns(config, tok, workers=0),
                              tool_share=config.sft.tool_share)  # tool turns' tokens weigh 0
  try:
    vocab, covered = drafter_train.draft_head(sequences, policy.config.vocab_size, config.drafter.draft_vocab_size,
                                              config.drafter.draft_vocab_coverage)
  except ValueError as e:
    raise ValueError(f"config.drafter.draft_vocab_size: {e}") from None
  if vocab:
    logging.info("drafter head: %d of %d tokens, covering %.2f%% of the warm-up's response tokens", len(vocab),
                 policy.config.vocab_size, 100 * covered)
  drafter = Drafter(policy.config, feature_layers=config.drafter.feature_layers, draft_vocab=vocab,
                    rngs=nnx.Rngs(config.seed))
  with tqdm(total=d.steps, desc="drafter warm-up", unit="step") as bar:
    result = drafter_train.distill(policy, drafter, sequences, steps=d.steps, batch_rows=d.batch_rows,
                                   row_len=d.row_len, lr=d.learning_rate, seed=config.seed,
                                   draft_steps=drafter_train.sampling_draft_steps(d.draft_steps,
                                                                                 config.rollout.sampling.temperature),
                                   on_step=lambda *_: bar.update(1),
                                   **drafter_train.sampling_loss(config.rollout.sampling.temperature))
  logging.info("drafter warm-up: loss %.3f -> %.3f, top-1 %.2f", result.losses[0], result.losses[-1],
               result.metrics[-1]["top1"])
  drafter_checkpoint.save_drafter(drafter, path)
  distributed.barrier("warm-up drafter")
  return drafter


def _warmup_examples(config, tok, prompts: datasets.Dataset | None) -> Sequence[datasets.Example]:
  """What the drafter's warm-up distills on: the first drafter.distill.prompts training prompts (a policy from
  policy.path answers them), else the tiny world's SFT problems with their worked solutions."""
  if config.policy.path:
    return prompts.examples[:config.drafter.distill.prompts]
  return datasets.from_tasks(config.task.family, tok, size=2048, seed=config.seed + 3,
                             difficulty=sft.difficulty(config), tools=builders.tool_schemas(config))


def check_warmup(config, examples) -> None:
  """drafter.distill.row_len holds a response token after the shortest of the warm-up's prompts."""
  d = config.drafter.distill
  shortest = min(len(e.prompt_ids) for e in examples)
  if shortest >= d.row_len:
    schemas = ", rollout.tools' schemas included" if config.rollout.tools else ""
    raise ValueError(f"config.drafter.distill.row_len={d.row_len}: holds none of the warm-up's {len(examples)} "
                     f"prompts and a response token (the shortest prompt has {shortest} tokens{schemas}); set it to "
                     f"data.max_prompt_len + rollout.sampling.max_new_tokens ({config.data.max_prompt_len} + "
                     f"{config.rollout.sampling.max_new_tokens}), as rl.row_len")


def _keys(config, prefix: str) -> datasets.Keys:
  return datasets.Keys(**{k: config_lib.config_value(config, f"{prefix}.{k}") for k in
                          ("prompt_key", "answer_key", "answer_regex", "system_prompt")})


def _prompt_file(config, prefix: str, tok, max_prompt_len: int | None = -1) -> datasets.Dataset:
  """The prompt file config.<prefix>.path names (`data.path`, an evaluation set's path), read with the
  keys beside it (prompts up to `max_prompt_len` tokens: data.max_prompt_len unless given); a missing or
  unusable one is an error naming the key."""
  key = f"{prefix}.path"
  path = config_lib.config_value(config, key)
  keys_from = "data" if prefix == "eval" else prefix  # the held-out file has the training data's keys
  max_prompt_len = config.data.max_prompt_len if max_prompt_len == -1 else max_prompt_len
  try:
    return datasets.from_file(path, tok, keys=_keys(config, keys_from), max_prompt_len=max_prompt_len,
                              reward=reward(config, keys_from), tools=builders.tool_schemas(config))
  except rewards.Unscorable as e:
    spec = config_lib.config_value(config, f"{keys_from}.reward")
    raise ValueError(f"config.{keys_from}.reward={spec!r} cannot score the rows of config.{key}={path!r}: {e}; set "
                     f"config.{keys_from}.reward to a reward that can (one of {sorted(rewards.REWARDS)}, or a "
                     "function of yours)") from None
  except (OSError, ValueError) as e:
    raise ValueError(f"config.{key}={path!r}: {e}") from None


def reward(config, prefix: str = "data") -> rewards.Reward:
  """The reward config.<prefix>.reward and its reward_weights name (`data`, or an evaluation set's)."""
  return rewards.Reward.of(config_lib.config_value(config, f"{prefix}.reward"),
                           config_lib.config_value(config, f"{prefix}.reward_weights"))


def load_prompts(config, tok) -> datasets.Dataset:
  """The training prompts: data.path, or data.size procedural problems; at least a step's, else an error
  naming the key that would do."""
  prompts = _training_prompts(config, tok, config.data.max_prompt_len)
  n = config.rollout.prompts_per_step
  if len(prompts) < n:
    message = f"{len(prompts)} prompts, fewer than config.rollout.prompts_per_step={n}"
    too_long = prompts.skipped.get("prompt_too_long", 0)
    lengths = sorted(len(e.prompt_ids) for e in _training_prompts(config, tok, None).examples) if too_long else []
    if len(lengths) >= n:
      schemas = " with rollout.tools' schemas" if config.rollout.tools else ""
      message += (f": {too_long} are longer than config.data.max_prompt_len={config.data.max_prompt_len} tokens"
                  f"{schemas}; {lengths[n - 1]} would keep {n} (rl.row_len grows with it)")
    raise ValueError(message)
  return prompts


def _training_prompts(config, tok, max_prompt_len: int | None) -> datasets.Dataset:
  if config.data.path:
    return _prompt_file(config, "data", tok, max_prompt_len)
  return datasets.from_tasks(config.task.family, tok, size=config.data.size, seed=config.seed + 2,
                             difficulty=sft.difficulty(config), max_prompt_len=max_prompt_len,
                             reward=reward(config), tools=builders.tool_schemas(config))


def load_eval_sets(config, tok) -> dict[str, datasets.Dataset]:
  """The evaluation sets by name: "" the held-out prompts (the first eval.size of eval.path, read with
  the data.* keys, or eval.size procedural problems of a seed the training prompts do not use), and
  each of eval.sets (its first `size`, all with 0)."""
  e = config.eval
  if e.path:
    data = _prompt_file(config, "eval", tok)
    held_out = datasets.Dataset(data.examples[:e.size], data.skipped)
  else:
    held_out = datasets.from_tasks(config.task.family, tok, size=e.size, seed=config.seed + 1_000_003,
                                   difficulty=sft.difficulty(config), max_prompt_len=config.data.max_prompt_len,
                                   reward=reward(config), tools=builders.tool_schemas(config))
  sets = {"": held_out}
  for name, s in e.sets.items():
    data = _prompt_file(config, f"eval.sets.{name}", tok)
    sets[name] = datasets.Dataset(data.examples[:s.size or None], data.skipped)
  return sets
