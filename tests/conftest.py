"""Shared fixtures: 8 simulated CPU devices, tiny random Hugging Face models of each family, a
hard-shrunk tiny RL config with its random policy, one compilation cache for the session (the
trainer tests hand it to their subprocesses) and the comparison of training runs that differ only
in the order of their float arithmetic."""

import importlib.metadata
import os
import re

# XLA:CPU's fast-compile settings: LLVM at -O0, the classic loop emitters instead of the fusion
# emitters (a choice jaxlib 0.11's XLA no longer offers: it rejects the flag), one codegen thread
# (the suite runs two workers on two cores). The tests' tiny programs compile about 4x faster and
# run about 2.5x slower; compiling is most of the suite's time. The HLO the tests build is the same;
# only XLA's machine-code optimization is skipped. Subprocesses inherit them (tests/test_distributed.py
# keeps them, tests/test_setup.py sets them for its run alone).
_JAXLIB = tuple(int(part) for part in importlib.metadata.version("jaxlib").split(".")[:2])
FAST_COMPILE_FLAGS = " ".join(["--xla_backend_optimization_level=0",
                               *(["--xla_cpu_use_fusion_emitters=false"] if _JAXLIB < (0, 11) else []),
                               "--xla_cpu_parallel_codegen_split_count=1"])

# Before jax is imported anywhere: tests run on 8 simulated CPU devices. Each flag once (pytest-xdist's
# workers inherit the flags their controller set): JAX's compilation cache keys hash the flags as written.
_FLAGS = os.environ.get("XLA_FLAGS", "").split()
_OURS = [*FAST_COMPILE_FLAGS.split(), "--xla_force_host_platform_device_count=8"]
os.environ["XLA_FLAGS"] = " ".join(_FLAGS + [flag for flag in _OURS if flag not in _FLAGS])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Before triton is imported anywhere: `triton.jit` gives interpreted kernels (CPU, numpy), so the
# Triton tree-attention kernel runs here (tests/kernels/test_triton_gpu.py).
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


# The suite's costliest files, costliest first (seconds in one run, idle 2-core machine, 2026-12-06; refresh with
# --durations=0). pytest-xdist (--dist loadfile) hands a worker the next file as it runs out: these
# first and the many short ones last, so that the two workers finish together (its default order, by
# number of tests, left a worker alone with a few-test file of minutes at the end).
COSTLIEST_FIRST = ("rollout/test_engine.py", "test_experiments.py", "test_dry_run.py", "test_main.py",  # 341-120 s
                   "test_bench.py", "test_distributed.py", "rl/test_trainer.py",  # 118-110 s
                   "test_notebooks.py", "test_setup.py",  # 105-103 s
                   "test_generate.py", "rollout/test_speculative.py", "models/test_gguf.py",  # 64-54 s
                   "kernels/test_tree_attention.py", "test_train_drafter.py", "rollout/test_tlt.py",  # 49-29 s
                   "models/test_transformer.py", "rl/test_actor.py")
_TESTS = os.path.dirname(os.path.abspath(__file__))
assert all(os.path.isfile(os.path.join(_TESTS, name)) for name in COSTLIEST_FIRST), "COSTLIEST_FIRST names a lost file"


def pytest_configure(config):
  if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's: keep pytest_collection_modifyitems' order
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
  rank = {os.path.join(_TESTS, name): i for i, name in enumerate(COSTLIEST_FIRST)}
  items.sort(key=lambda item: rank.get(str(item.path), len(rank)))  # stable: a file's tests stay in order


def xla_flags_without_device_count() -> str:
  """This process's XLA_FLAGS for a subprocess that simulates its own number of CPU devices."""
  return re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ["XLA_FLAGS"]).strip()


import functools  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from hypothesis import settings  # noqa: E402

from tests.hf_models import FAMILIES, VOCAB, build_hf_model  # noqa: E402, F401  (the tests import them from here)
from tlt_jax.models import transformer  # noqa: E402

# Property-based tests try the same examples on every run (reproducible CI), with no per-example
# deadline (the machine is shared) and no example database written into the tree.
settings.register_profile("tlt", deadline=None, derandomize=True, database=None)
settings.load_profile("tlt")


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
  """family -> (directory holding the saved HF model, the torch model). Built once per run."""
  out = {}
  for family in FAMILIES:
    model = build_hf_model(family)
    path = str(tmp_path_factory.mktemp(family))
    model.save_pretrained(path)
    out[family] = (path, model)
  return out


@pytest.fixture(scope="session", params=list(FAMILIES))
def family(request):
  return request.param


@functools.partial(jax.jit, static_argnums=0, static_argnames=("all_logits",))
def jit_prefill(graphdef, state, tokens, lengths, cache, all_logits=False):
  return transformer.prefill(nnx.merge(graphdef, state), tokens, lengths, cache, all_logits=all_logits)


@functools.partial(jax.jit, static_argnums=0)
def jit_decode(graphdef, state, tokens, cache):
  return transformer.decode(nnx.merge(graphdef, state), tokens, cache)


@functools.partial(jax.jit, static_argnums=0)
def jit_verify(graphdef, state, tokens, positions, mask, cache):
  return transformer.verify(nnx.merge(graphdef, state), tokens, positions, mask, cache)


# float_order_mismatches' bounds: far above what float rounding does to a few updates, far below
# what a wrong gradient does (tests/rl/test_actor.py checks both sides).
FLOAT_ORDER_BOUNDS = {"update": 1e-2, "loss": 1e-5, "grad_norm": 1e-3}


def float_order_mismatches(initial, reference, other) -> dict[str, float]:
  """How run `other` differs from run `reference` beyond float rounding: {check: worst value}, {} if not.

  A run is (params, [{"loss", "grad_norm"} of each update or step]), trained from `initial` params
  by the same arithmetic as the other but in another order: on other devices, processes, shards
  or micro-batches, gradients are summed in another order. Measured in tests/rl/test_actor.py and
  tests/test_distributed.py, rounding vs a wrong gradient (one of 8 rows' gradient dropped, or
  half the rows' doubled as if one of 2 processes' gradient were):
  - "update": ||params' - params|| / ||params - initial||, L2 over every parameter: 4e-7 to 4e-5
    vs 0.23 to 0.45. Not per element: Adam steps each element by about lr * m / sqrt(v) whatever
    its gradient's size, so where a gradient is near 0 its rounding moves the step by a fair part
    of lr (warm-up-free Adam on 8 devices vs 1: an element 0.3% of the largest move apart, 3% on
    other batches; a relative tolerance of 1e-5 per element fails). Such elements are few: in L2
    they weigh little.
  - "loss": absolute. A mean (token weights sum to 1) of terms |advantage| * ratio ~ 1 which may
    cancel to near 0, so its rounding is absolute: <= 2e-7 vs >= 4e-2 in some update.
  - "grad_norm": relative (a sum of squares: no cancellation; later updates start from params
    that rounding already moved): <= 1e-6 (2e-5 on other batches) vs >= 2e-2 in some update.
  """
  (params, stats), (ref_params, ref_stats) = other, reference
  diff = lambda x, y: jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), x, y)
  norm = lambda tree: np.sqrt(sum(float(np.sum(x * x)) for x in jax.tree.leaves(tree)))
  pairs = list(zip(stats, ref_stats, strict=True))
  worst = {"update": norm(diff(params, ref_params)) / norm(diff(ref_params, initial)),
           "loss": max(abs(s["loss"] - r["loss"]) for s, r in pairs),
           "grad_norm": max(abs(s["grad_norm"] - r["grad_norm"]) / r["grad_norm"] for s, r in pairs)}
  return {k: float(v) for k, v in worst.items() if not v <= FLOAT_ORDER_BOUNDS[k]}  # NaN is a mismatch too


def write_gguf(path, arch: str) -> str:
  """A GGUF file whose header names `arch`, with one small tensor (architecture checks read the header)."""
  import gguf
  import numpy as np
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return str(path)


def tiny_rl_config(workdir, steps: int, cache_dir):
  """configs/tiny.py shrunk to about a second a step: a 2-layer policy, 2 prompts x 4 samples, the
  plain rollout baseline on one group, a held-out evaluation every 2 steps. Set `policy.path` to
  `tiny_policy_dir`."""
  from configs import tiny
  c = tiny.get_config()
  c.unlock()
  c.workdir = str(workdir)
  c.steps = steps
  c.model.hidden_size, c.model.num_layers, c.model.intermediate_size = 32, 2, 64
  c.data.size = 64
  c.data.max_prompt_len = 64
  c.rollout.speculative = False
  c.rollout.prompts_per_step = 2
  c.rollout.num_samples = 4
  c.rollout.sampling.max_new_tokens = 24
  c.rollout.engine.batch_buckets = (1, 2, 4, 8)
  c.rollout.engine.segment_steps = 8
  c.rollout.engine.kv_block = 32
  c.rollout.compilation_cache_dir = str(cache_dir)
  c.rl.row_len = 96
  c.rl.actor.micro_batch_rows = 4
  c.rl.optimizer.learning_rate = 1e-2
  c.rl.dynamic_sampling = False
  # A random policy never answers right; the overlong penalty makes rewards differ within a group.
  c.rl.overlong_buffer = 24
  c.checkpoint.every = 2
  c.rollout.groups = 1
  c.rl.mini_batches = 2
  c.eval.every = 2
  c.eval.size = 3
  c.eval.num_samples = 2
  c.data.reward_workers = 0  # in this process (tests/rl/test_rewards.py and tests/test_main.py run the pool)
  return c


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory):
  """A random tiny policy (`tiny_rl_config`'s shape) saved as a Hugging Face directory (no SFT)."""
  from tlt_jax.rl import sft
  from tlt_jax.models import hf
  from tlt_jax.rl import tokenizer as tokenizer_lib
  c = tiny_rl_config("unused", 0, "unused")
  tok = tokenizer_lib.build_tokenizer(c.model.max_position_embeddings)
  path = tmp_path_factory.mktemp("policy")
  hf.save_pretrained(sft.build_policy(c, tok), str(path), tokenizer=tok)
  return str(path)


@pytest.fixture(scope="session", autouse=True)
def xla_cache(tmp_path_factory):
  """One persistent compilation cache for the whole run, set as main's start-up sets it, from the
  session's start: a program several tests build (the same shapes, engine config and sampling
  params) compiles once. Both pytest-xdist workers and the subprocesses the tests start share it,
  at one path: JAX's cache key holds the cache's path, and the device count, so a subprocess that
  simulates one device finds the entries of others that do."""
  from tlt_jax import distributed
  base = tmp_path_factory.getbasetemp()
  path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "xla_cache"  # the workers' common parent
  path.mkdir(exist_ok=True)
  distributed.setup_compilation_cache(str(path))
  return str(path)


# Imports what the named CLI modules (or scripts: a path ending in .py) import, in their functions too
# (and runs `prelude`), once, then runs `python -m MODULE ARGS...` (`python SCRIPT ARGS...`) for each
# case in a fork, in the case's directory, its stdout and stderr in files, exiting as the interpreter
# would (a string SystemExit is printed, anything else is a traceback) but without its slow start and
# teardown: each CLI's own code path, cheaply. An import that fails here fails again, with its
# traceback, in the case that needs it.
_FORKING_CLIS = """
import ast, importlib, json, os, runpy, sys, traceback
cases = json.loads(sys.argv[1])
script = lambda case: case["module"].endswith(".py")
origin = lambda case: os.path.join(case["cwd"], case["module"]) if script(case) else \\
    importlib.util.find_spec(case["module"]).origin
sys.path[:0] = sorted({os.path.dirname(origin(case)) for case in cases if script(case)})  # as `python SCRIPT` has
for path in sorted({origin(case) for case in cases}):
  for node in ast.walk(ast.parse(open(path).read())):  # the functions' imports too (tlt_jax.main's are there)
    if not isinstance(node, (ast.Import, ast.ImportFrom)) or getattr(node, "level", 0):
      continue
    for alias in node.names:
      name = f"{node.module}.{alias.name}" if isinstance(node, ast.ImportFrom) else alias.name
      try:
        importlib.import_module(name)
      except ImportError:  # `from module import attribute`, or an optional module the case may not need
        try:
          importlib.import_module(node.module or name)
        except ImportError:
          pass
exec(sys.argv[2])
for case in cases:
  sys.stdout.flush()
  sys.stderr.flush()
  pid = os.fork()
  if pid == 0:
    os.chdir(case["cwd"])
    for fd, name in ((1, "stdout"), (2, "stderr")):
      os.dup2(os.open(case[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.argv = [case["module"], *case["args"]]
    sys.modules.pop(case["module"], None)  # imported by another module: `python -m` runs a fresh copy anyway
    try:
      if script(case):
        runpy.run_path(case["module"], run_name="__main__")
      else:
        runpy.run_module(case["module"], run_name="__main__", alter_sys=True)
      code = 0
    except SystemExit as e:
      code = e.code if e.code is None or isinstance(e.code, int) else print(e.code, file=sys.stderr) or 1
    except BaseException:
      code = traceback.print_exc() or 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
  _, status = os.waitpid(pid, 0)
  print(os.waitstatus_to_exitcode(status), flush=True)
"""


def run_clis(cases, logs, prelude: str = "", timeout: float = 600, env=None, compilation_cache: str = ""):
  """Runs each case (module, args, cwd) as `python -m module *args` (a module ending in .py: `python
  module *args`, a script's path relative to `cwd`) in `cwd` (forked from one process
  that imported what the modules import and ran `prelude`); returns (exit code, stdout, stderr) of
  each. `logs`: a directory for their outputs; `env`: the environment of that process (default: this one's),
  which imports from the first case's `cwd`; `compilation_cache`: a persistent compilation cache the
  cases share (`xla_cache`), so that a program several of them build compiles once."""
  import json
  import subprocess
  import sys
  if compilation_cache:
    prelude = f"from tlt_jax import distributed\ndistributed.setup_compilation_cache({compilation_cache!r})\n{prelude}"
  specs = [{"module": m, "args": list(a), "cwd": str(c), "stdout": os.path.join(logs, f"{i}.out"),
            "stderr": os.path.join(logs, f"{i}.err")} for i, (m, a, c) in enumerate(cases)]
  result = subprocess.run([sys.executable, "-c", _FORKING_CLIS, json.dumps(specs), prelude], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=specs[0]["cwd"])
  codes = result.stdout.split()
  assert result.returncode == 0 and len(codes) == len(cases), result.stderr[-3000:]
  read = lambda path: open(path, encoding="utf-8", errors="replace").read()
  return [(int(code), read(s["stdout"]), read(s["stderr"])) for code, s in zip(codes, specs)]
