"""config.check and the CLI: random bad values of random keys are rejected with the key named (hypothesis)."""

import inspect
import json
import math
import re

import jax
import ml_collections

import pytest
from flax import nnx
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from configs import accelerator, qwen2_5_0_5b, r1_7b, tiny
from tests.conftest import run_clis
from tlt_jax import config as config_lib
from tlt_jax.drafter.buffer import BufferConfig
from tlt_jax.drafter.trainer import DrafterTrainerConfig
from tlt_jax.models import CausalLM
from tlt_jax.rl import actor as actor_lib
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.tlt import TLTConfig
from tlt_jax.kernels import tree_attention
from tlt_jax.rl import builders, checks, corrections, grpo
from tlt_jax.rl import rewards

COUNTS = (  # must be >= 1
    "mesh.dry_run_devices", "model.hidden_size", "model.num_layers", "model.num_heads", "model.num_kv_heads",
    "model.head_dim", "model.intermediate_size", "model.max_position_embeddings", "task.min_terms", "data.size",
    "data.max_prompt_len", "sft.num_problems", "sft.batch_rows", "sft.eval_max_new_tokens", "rollout.prompts_per_step",
    "rollout.num_samples", "rollout.sampling.max_new_tokens", "rollout.groups", "rollout.engine.segment_steps",
    "rollout.engine.kv_block", "rollout.engine.sd_max_batch", "rollout.engine.suffix_ngram", "rollout.bandit.window",
    "drafter.distill.batch_rows", "drafter.trainer.rows_per_device", "drafter.buffer.max_pairs", "rl.mini_batches",
    "rl.actor.micro_batch_rows", "rl.actor.logits_chunk", "eval.size", "eval.num_samples", "checkpoint.every",
    "checkpoint.keep")
NON_NEGATIVE_INTS = (
    "steps", "mesh.cpu_devices", "model.vocab_size", "sft.steps", "sft.warmup_steps", "sft.eval_size",
    "rollout.sampling.top_k", "drafter.distill.steps", "drafter.trainer.warmup_steps", "rollout.tlt.solo_steps",
    "rollout.engine.suffix_history_len", "rollout.engine.page_size", "rollout.engine.num_pages",
    "rollout.mean_response_len",
    "rl.optimizer.warmup_steps", "rl.actor.attention_block", "rl.overlong_buffer",
    "eval.every")
NON_NEGATIVE_FLOATS = (
    "mesh.device_memory_gb", "sft.learning_rate", "sft.weight_decay", "rollout.sampling.temperature",
    "drafter.distill.learning_rate", "drafter.trainer.learning_rate", "rl.optimizer.learning_rate",
    "rl.optimizer.weight_decay", "rl.loss.clip_high", "rl.loss.kl_coef")
POSITIVE_FLOATS = ("model.rope_theta", "task.tail_alpha", "rl.optimizer.max_grad_norm", "rollout.sampling.top_p")
CHOICES = ("policy.dtype", "policy.weight_dtype", "data.reward", "rollout.engine.attention", "rl.loss.aggregation",
           "rl.advantage_std", "rollout.drafter", "rl.loss.kind", "rl.loss.importance_level",
           "rl.rollout_correction.preset", "rl.rollout_correction.is_mode")
VALID_CHOICES = {"float32", "bfloat16", *rewards.REWARDS, *tree_attention.IMPLEMENTATIONS, *grpo.AGGREGATIONS,
                 *grpo.ADVANTAGE_STDS, "eagle", "suffix", *grpo.LOSSES, *corrections.PRESETS, "", "truncate", "mask"}

negative = st.floats(max_value=-1e-9) | st.just(-math.inf) | st.just(math.nan)
word = st.text("abcdefghijklmnopqrstuvwxyz0123456789_-", max_size=10)
small = st.integers(0, 9).map(str)
bad_strategy_names = st.one_of(
    st.lists(small, min_size=1, max_size=4).filter(lambda f: len(f) != 3).map("_".join),  # wrong field count
    st.tuples(small, word.filter(lambda w: not w.isdigit()), small).map("_".join),  # not a number
    st.tuples(st.just("0"), small, small).map("_".join), st.tuples(small, st.just("0"), small).map("_".join),
    st.tuples(st.integers(1, 3), st.integers(1, 3)).flatmap(  # verify_tokens outside [2, root + candidates]
        lambda dk: (st.integers(-1, 1) | st.integers(2 + dk[1] + (dk[0] - 1) * dk[1]**2, 99)).map(
            lambda v: f"{dk[0]}_{dk[1]}_{v}")))
thresholds = st.lists(st.integers(0, 30), min_size=1, max_size=5).filter(
    lambda t: t[0] != 1 or any(a >= b for a, b in zip(t, t[1:]))).map(tuple)
buckets = st.lists(st.integers(-2, 300), max_size=6).filter(
    lambda b: not b or b[0] != 1 or any(y != 2 * x for x, y in zip(b, b[1:]))).map(tuple)
not_ints = st.lists(st.integers(0, 9) | word, min_size=1, max_size=3).filter(
    lambda xs: any(isinstance(x, str) for x in xs)).map(tuple)


def bad_settings(config, cli: bool = False):
  """(key set, its bad value, key the message must name) for `config`; `cli`: values a --config override can write."""
  most_terms, heads, row_len = config.task.max_terms, config.model.num_heads, config.rl.row_len
  needed = config.data.max_prompt_len + config.rollout.sampling.max_new_tokens
  same = lambda keys, values: st.tuples(st.sampled_from(keys), values).map(lambda kv: (kv[0], kv[1], kv[0]))
  cases = [
      same(COUNTS, st.integers(max_value=0)),
      same(("sft.row_len", "drafter.distill.row_len", "drafter.trainer.row_len", "rollout.engine.suffix_bank_len"),
           st.integers(max_value=1)),
      same(NON_NEGATIVE_INTS, st.integers(max_value=-1)),
      same(NON_NEGATIVE_FLOATS, negative),
      same(POSITIVE_FLOATS, negative | st.just(0.0)),
      same(("rollout.sampling.top_p", "rollout.bandit.epsilon"), st.floats(min_value=1, exclude_min=True)),
      same(("rollout.bandit.epsilon", "rl.loss.clip_low"), negative),
      same(("rl.loss.clip_low",), st.floats(min_value=1)),
      same(CHOICES, word.filter(lambda w: w not in VALID_CHOICES)),
      same(("data.reward",),
           st.lists(word.filter(lambda w: w not in VALID_CHOICES), min_size=1, max_size=2).map(tuple)),
      same(("data.reward_weights",), st.lists(st.floats(-2, 2), min_size=2, max_size=3).map(tuple)),  # 1 function
      same(("data.reward_max_failures",), negative | st.floats(min_value=1, exclude_min=True, allow_infinity=False)),
      same(("mesh.data", "mesh.fsdp", "mesh.tensor"), st.integers(max_value=-2) | st.just(0)),
      same(("rollout.engine.batch_buckets",), buckets | not_ints),
      same(("rollout.strategies",), st.lists(bad_strategy_names, min_size=1, max_size=2).map(tuple)
           | st.lists(st.integers(0, 999), min_size=1, max_size=2).map(tuple)),  # 3_1_4 unquoted reads as 314
      same(("rollout.bandit.thresholds",), thresholds | not_ints),
      same(("drafter.feature_layers",), not_ints | st.lists(st.integers(-9, 40), min_size=1, max_size=5).filter(
          lambda f: len(f) != 3 or f != sorted(set(f)) or f[0] < 0).map(tuple)),
      st.builds(lambda kv: ("model.num_kv_heads", kv, "model.num_heads"),
                st.integers(2, 64).filter(lambda k: heads % k)),
      st.builds(lambda lo: ("task.min_terms", lo, "task.max_terms"), st.integers(most_terms + 1, 10**6)),
      same(("rl.row_len",), st.integers(2, needed - 1)),  # below data.max_prompt_len + rollout.sampling.max_new_tokens
      same(("rl.actor.attention_block",), st.integers(1, 4096).filter(lambda a: row_len % a)),
  ]
  if not cli:  # a config file can also leave a key unset
    cases.append(same([key for key, _ in config_lib.leaves(config)], st.none()))
  return st.one_of(cases)


def assign(config, key: str, value) -> None:
  *path, name = key.split(".")
  for part in path:
    config = config[part]
  config[name] = value


@pytest.mark.parametrize("name", ["base", "tiny", "tools", "r1_7b", "qwen2_5_0_5b", "qwen2_5_7b", "qwen2_5_32b",
                                  "accelerator", "gsm8k_style", "smollm2"])
def test_shipped_configs_pass(name):
  checks.check(config_lib.base() if name == "base" else __import__(f"configs.{name}", fromlist=["_"]).get_config())


def test_accelerator_target_is_qwen2_5_0_5b_shaped_with_r1_7b_arms():
  """experiments/accelerator.py's target: Qwen2.5-0.5B's shape and parameter count, configs/r1_7b.py's
  strategies; its smoke variant passes too."""
  c = accelerator.get_config()
  assert c.model.to_dict() == qwen2_5_0_5b.get_config().model.to_dict()
  assert c.rollout.strategies == r1_7b.get_config().rollout.strategies
  cfg = builders.model_config(c)
  assert cfg.architecture == "Qwen2ForCausalLM" and cfg.qkv_bias
  shapes = nnx.state(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  assert 0.49e9 < sum(x.size for x in jax.tree.leaves(shapes)) < 0.5e9
  checks.check(accelerator.get_config("smoke"))


@settings(max_examples=200)
@given(bad_settings(config_lib.base()))
def test_fuzz_bad_values_are_rejected_by_name(setting):
  key, value, named = setting
  config = config_lib.base()
  assign(config, key, value)
  with pytest.raises(ValueError, match=f"^config.{re.escape(named)}="):
    checks.check(config)


@pytest.mark.parametrize("changes,message", [
    ({"strategies": ("3_1_4", "s4_1_5"), "engine.suffix_bank_len": 129},
     "rollout.engine.suffix_bank_len=129: must be >= max_prompt_len + suffix_history_len + 2 = 130"),
    ({"strategies": ("4_1_5", "s4_1_5"), "drafter": "suffix"},
     "rollout.strategies=('4_1_5', 's4_1_5'): must not name a strategy twice"),
    ({"strategies": ("s4_1_5", "4_x_5")}, "rollout.strategies=('s4_1_5', '4_x_5'): strategy '4_x_5' is not")])
def test_bad_suffix_settings_are_named(changes, message):
  """With suffix strategies the bank must hold a prompt; with rollout.drafter='suffix' '4_1_5' is 's4_1_5'."""
  config = config_lib.base()
  for key, value in changes.items():
    assign(config, f"rollout.{key}", value)
  with pytest.raises(ValueError, match=f"^config.{re.escape(message)}"):
    checks.check(config)
  config.rollout.update(strategies=("3_1_4", "s4_1_5"), drafter="eagle")
  config.rollout.engine.suffix_bank_len = 130
  checks.check(config)
  assert [s.name for s in builders.strategies(config)] == ["3_1_4", "s4_1_5"]
  config.rollout.drafter = "suffix"
  assert [s.name for s in builders.strategies(config)] == ["s3_1_4", "s4_1_5"]


@pytest.mark.parametrize("name", ["base", "tiny", "r1_7b", "qwen2_5_0_5b", "smollm2"])
def test_subtrees_build_the_dataclasses_they_mirror(name):
  """Each dataclass subtree holds its fields by their names, nothing else (`Dataclass(**subtree)`)."""
  c = config_lib.base() if name == "base" else __import__(f"configs.{name}", fromlist=["_"]).get_config()
  assert builders.sampling_params(c, (2,)) == SamplingParams(**c.rollout.sampling, stop_token_ids=(2,), seed=c.seed)
  engine = builders.engine_config(c, builders.strategies(c))
  assert engine.batch_buckets == c.rollout.engine.batch_buckets and engine.attention == c.rollout.engine.attention
  assert engine.max_new_tokens == c.rollout.sampling.max_new_tokens
  assert builders.bandit(c, ()).thresholds == c.rollout.bandit.thresholds
  assert builders.tlt_config(c) == TLTConfig(**c.rollout.tlt)
  assert builders.drafter_trainer_config(c) == DrafterTrainerConfig(
      **c.drafter.trainer, temperature=c.rollout.sampling.temperature, seed=c.seed)
  assert BufferConfig(**c.drafter.buffer).max_pairs == c.drafter.buffer.max_pairs
  assert set(c.rl.optimizer) == set(inspect.signature(actor_lib.make_optimizer).parameters) | {"max_grad_norm"}
  actor_kwargs = inspect.signature(actor_lib.Actor).parameters
  assert set(c.rl.actor) == {k for k, p in actor_kwargs.items() if p.kind == p.KEYWORD_ONLY} - {
      "mesh", "temperature", "seed", "loss", "max_grad_norm"}
  assert builders.objective(c) == grpo.Objective(**c.rl.loss)


@pytest.mark.parametrize("old", sorted(config_lib.RENAMED))
def test_old_keys_are_refused_with_their_new_name(old):
  """A config file built on base() that sets an old key fails `check`, naming the new key; no old key
  names a key base() has (it would mean something else now)."""
  config = config_lib.base()
  assert old not in dict(config_lib.leaves(config))
  *sections, name = old.split(".")
  tree = config
  for section in sections:
    if section not in tree:
      tree[section] = ml_collections.ConfigDict()
    tree = tree[section]
  tree[name] = 1
  new = config_lib.RENAMED[old].split(" and ")
  assert all(key in dict(config_lib.leaves(config)) for key in new)
  with pytest.raises(ValueError, match=f"^config.{re.escape(old)} is now config.{re.escape(new[0])}"):
    checks.check(config)


def test_unknown_keys_are_refused():
  config = config_lib.base()
  config.rollout.engine.nonsense = 3
  with pytest.raises(ValueError, match=r"^config.rollout.engine.nonsense: unknown key"):
    checks.check(config)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("key", [k for k, v in config_lib.leaves(config_lib.base()) if isinstance(v, float)])
def test_non_finite_floats_are_rejected(key, value):
  """Every float key, whatever its bounds (a NaN passes `x >= 0` and `x <= 1` alike)."""
  config = config_lib.base()
  assign(config, key, value)
  with pytest.raises(ValueError, match=f"^config.{re.escape(key)}={value}: must be a finite number$"):
    checks.check(config)


def _typed(key: str) -> bool:
  """Whether the key's field has a type (the keys taking a string or a tuple take any value: check() checks them)."""
  *path, name = key.split(".")
  config = config_lib.base()
  for part in path:
    config = config[part]
  return config.get_type(name) is not object


@settings(max_examples=100)
@given(st.sampled_from([key for key, _ in config_lib.leaves(config_lib.base()) if _typed(key)]),
       st.one_of(word.filter(lambda w: not w.isdigit()), st.lists(st.integers(), max_size=2)))
def test_fuzz_ill_typed_values_are_rejected_by_name(key, value):
  config = config_lib.base()
  if isinstance(config_lib.config_value(config, key), str) and isinstance(value, str):
    value = [value]  # a str key takes any word
  if isinstance(config_lib.config_value(config, key), tuple) and isinstance(value, list):
    value = value[0] if value else 1.5  # a tuple key takes a list (as a tuple; check() checks the elements)
  with pytest.raises(TypeError, match=f"field '{re.escape(key.split('.')[-1])}'"):
    assign(config, key, value)


# A bad value must never start a run: set up devices and it exits 3 instead.
_LET_THROUGH = """
import sys
import tlt_jax.distributed
def let_through(config):
  print("check() let it through", file=sys.stderr)
  sys.exit(3)
tlt_jax.distributed.setup_devices = let_through
"""
CLI_CONFIG = tiny.get_config()  # what python -m tlt_jax.main starts from
_LEAVES = dict(config_lib.leaves(CLI_CONFIG))
_NOT_A_VALUE = word.filter(lambda w: any(c.isalpha() for c in w) and w.lower() not in (
    "t", "f", "true", "false", "y", "n", "yes", "no", "inf", "nan", "infinity"))


def _flag_text(value) -> str:
  return repr(value) if isinstance(value, float) else str(value)


cli_overrides = st.one_of(
    bad_settings(CLI_CONFIG, cli=True).map(lambda s: (f"--config.{s[0]}={_flag_text(s[1])}", s[2])),
    st.tuples(st.sampled_from([k for k, v in _LEAVES.items() if not isinstance(v, str)]), _NOT_A_VALUE).map(
        lambda kv: (f"--config.{kv[0]}={kv[1]}", f"--config.{kv[0]}={kv[1]}")),  # ill-typed
    st.tuples(st.sampled_from(sorted({k.split(".")[0] for k in _LEAVES if "." in k})), _NOT_A_VALUE).filter(
        lambda sw: f"{sw[0]}.{sw[1]}" not in _LEAVES).map(
            lambda sw: (f"--config.{sw[0]}.{sw[1]}=1", f"{sw[0]}.{sw[1]}")),  # unknown
)


@settings(max_examples=1, phases=[Phase.generate])  # shrinking would rerun the subprocess many times
@given(st.lists(cli_overrides, min_size=30, max_size=30, unique_by=lambda o: o[0].split("=")[0]))
def test_fuzz_bad_overrides_are_rejected_by_name(tmp_path_factory, overrides):
  tmp = tmp_path_factory.mktemp("overrides")
  results = run_clis([("tlt_jax.main", [flag], tmp) for flag, _ in overrides], tmp, prelude=_LET_THROUGH, timeout=300)
  for (flag, named), (code, _, message) in zip(overrides, results):
    assert code == 1 and named in message and "Traceback" not in message, (flag, message)


def test_setup_devices_sets_the_compilation_cache(tmp_path):
  """The start-up (`setup_devices`) points JAX's persistent cache at `rollout.compilation_cache_dir`:
  what compiles next is written there."""
  import jax
  import numpy as np
  from jax.experimental.compilation_cache import compilation_cache
  from tlt_jax import distributed
  config = config_lib.base()
  config.rollout.compilation_cache_dir = str(tmp_path)
  before = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
  try:
    distributed.setup_devices(config)
    assert jax.config.jax_compilation_cache_dir == str(tmp_path)
    jax.jit(lambda x: x * 3 + 1).lower(np.arange(5.0)).compile()
    assert list(tmp_path.iterdir())
  finally:  # the process's own setting back
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
    compilation_cache.reset_cache()


# The config main would run with: printed, then exit 3 before any work.
_SHOW_CONFIG = """
import json
import sys
import tlt_jax.distributed
def show(config):
  r = config.rollout
  print(json.dumps([r.strategies, r.engine.batch_buckets, r.bandit.thresholds, config.drafter.feature_layers]))
  sys.exit(3)
tlt_jax.distributed.setup_devices = show
"""


@pytest.mark.parametrize("flags,parsed", [
    (["--config.rollout.strategies=('3_1_4','s4_2_6')", "--config.rollout.engine.batch_buckets=(1,2,4)",
      "--config.rollout.bandit.thresholds=(1,3)", "--config.drafter.feature_layers=(0,2,4)"],
     [["3_1_4", "s4_2_6"], [1, 2, 4], [1, 3], [0, 2, 4]]),
    (["--config.rollout.strategies=('5_2_8',)", "--config.drafter.feature_layers=()"],
     [["5_2_8"], [1, 2, 4, 8, 16, 32, 64, 128], [1, 2, 5, 21], []])])
def test_tuple_overrides_parse_on_the_command_line(tmp_path, flags, parsed):
  """The syntax the README shows: a Python literal per tuple key, strings quoted."""
  [(code, out, err)] = run_clis([("tlt_jax.main", flags, tmp_path)], tmp_path, prelude=_SHOW_CONFIG, timeout=300)
  assert code == 3, err[-2000:]
  assert json.loads(out.strip().splitlines()[-1]) == parsed


def test_evaluation_sets_are_checked_key_by_key():
  """`eval.sets.<name>` holds `config.eval_set`'s keys: each set's values are checked like the others, and
  sets need `eval.every`."""
  def with_set(**keys):
    c = config_lib.base()
    c.eval.every = 5
    c.eval.sets.gsm8k = config_lib.eval_set(**{"path": "test.jsonl", **keys})
    return c
  checks.check(with_set(num_samples=8, k=4, temperature=0.0))
  for keys, message in [
      (dict(k=9, num_samples=8), r"config.eval.sets.gsm8k.k=9: must be <= its num_samples"),
      (dict(num_samples=0), r"config.eval.sets.gsm8k.num_samples=0: must be an integer >= 1"),
      (dict(temperature=-0.5), r"config.eval.sets.gsm8k.temperature=-0.5: must be >= 0, or -1"),
      (dict(path=""), r"config.eval.sets.gsm8k.path='': must name a file"),
      (dict(reward="accuracy"), r"config.eval.sets.gsm8k.reward='accuracy': unknown reward"),
      (dict(answer_regex="(x"), r"config.eval.sets.gsm8k.answer_regex='\(x': answer_regex")]:
    with pytest.raises(ValueError, match=message):
      checks.check(with_set(**keys))
  c = with_set()
  c.eval.sets.gsm8k.samples = 4  # not a key of a set
  with pytest.raises(ValueError, match=r"config.eval.sets.gsm8k.samples: unknown key"):
    checks.check(c)
  c = with_set()
  c.eval.every = 0
  with pytest.raises(ValueError, match=r"config.eval.every=0: must be > 0: evaluation set 'gsm8k'"):
    checks.check(c)
  with pytest.raises(ValueError, match="eval_set: unknown key 'samples'"):
    config_lib.eval_set(samples=4)


def test_each_key_gets_its_own_comment_or_its_block_s():
  """`--keys`' comments: a block above a key stops at the next commented key or subtree (the optimizer's
  keys are not described as the old log-probs above them); a block above a subtree covers its keys."""
  notes = config_lib.comments()
  assert notes["rl.optimizer.max_grad_norm"] == "TRL max_grad_norm; verl actor.grad_clip"
  assert notes["rl.old_logp"].startswith("The ratio's old log-probs") and notes["rl.advantage_eps"].startswith(
      "Group advantages")
  assert "rl.optimizer.learning_rate" in notes and not notes["rollout.sampling.temperature"].startswith("Multi-turn")
  assert notes["model.hidden_size"].startswith("Architecture of the tiny policy")  # past model.vocab_size's own
  assert notes["rollout.engine.num_pages"] == notes["rollout.engine.page_size"]
  assert "sft.steps" not in notes


def test_a_rollout_correction_needs_the_trainers_own_old_log_probs():
  config = config_lib.base()
  config.rl.old_logp, config.rl.rollout_correction.preset = "rollout", "decoupled_token_is"
  with pytest.raises(ValueError, match=r"^config.rl.old_logp='rollout': .* rl.rollout_correction .* do nothing"):
    checks.check(config)
  config.rl.old_logp = "auto"  # recomputed for the correction (trainer.recomputes_old_logp)
  checks.check(config)
