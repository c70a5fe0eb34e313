"""Every CLI's bad inputs: one line `error: ...` naming the flag, file or key, exit 1, nothing
written, no input touched, and the check done before the expensive work (reaching the rollout
engine, the policy's SFT warm start or the export exits 3 here). Plus `tlt_jax.cli`'s helpers."""

import os
import re
import shutil
import subprocess
import sys

import pytest
from flax import nnx

from tests.conftest import run_clis, write_gguf
from tlt_jax import cli
from tlt_jax.drafter import checkpoint, export
from tlt_jax.drafter.model import Drafter
from tlt_jax.models import hf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Where a bad input would start the expensive work, the forked CLIs stop with exit code 3.
_STOP_BEFORE_WORK = """
import sys
from tlt_jax.drafter import export
from tlt_jax.models import gguf
from tlt_jax.rl import bootstrap
from tlt_jax.rollout.engine import Engine
def reached(what):
  def stop(*args, **kwargs):
    print(f"a bad input reached {what}", file=sys.stderr)
    sys.exit(3)
  return stop
Engine.__init__ = reached("the rollout engine")
bootstrap.load_policy = reached("the policy (SFT warm start)")
export.export_eagle = reached("the export")
gguf.convert = reached("the conversion")
"""

G = ("tlt_jax.generate", "--model={I}/model", "--prompts={I}/prompts.jsonl", "--output={OUT}/out.jsonl")
B = ("tlt_jax.bench", "--model={I}/model", "--drafter=random", "--output={OUT}/grid.json")
T = ("tlt_jax.train_drafter", "--model={I}/model", "--prompts={I}/prompts.jsonl", "--output={OUT}/drafter")
T_OUT = ("tlt_jax.train_drafter", "--model={I}/model", "--prompts={I}/prompts.jsonl")
E = ("tlt_jax.export_drafter", "--model={I}/model", "--drafter={I}/drafter", "--output={OUT}/eagle")
E_OUT = ("tlt_jax.export_drafter", "--model={I}/model", "--drafter={I}/drafter")
MAIN = ("tlt_jax.main", "--config.workdir={OUT}/run")
C = ("tlt_jax.convert_gguf", "--gguf={I}/llama.gguf", "--output={OUT}/model")

CASES = [  # (base command, more flags, what the one line must say)
    (G, ["--temperature=nan"], "flag --temperature=nan: must be a finite number >= 0"),
    (G, ["--temperature=inf"], "flag --temperature=inf: must be a finite number >= 0"),
    (G, ["--top_p=0"], "flag --top_p=0.0: must be in (0, 1]"),
    (G, ["--top_p=nan"], "flag --top_p=nan: must be in (0, 1]"),
    (G, ["--top_k=-1"], "flag --top_k=-1: must be >= 0"),
    (G, ["--max_new_tokens=0"], "flag --max_new_tokens=0: must be >= 1"),
    (G, ["--prompts={I}/bool.jsonl"], "bool.jsonl:1: 'prompt_ids' must be a list of token ids in [0, 103)"),
    (G, ["--prompts={I}/nonutf8.jsonl"], "nonutf8.jsonl:1: not UTF-8 text"),
    (G, ["--prompts={I}/missing.jsonl"], "missing.jsonl: no such file"),
    (G, ["--model={I}/missing"], "--model={I}/missing: model directory '{I}/missing' does not exist"),
    (G, ["--model={I}/truncated"], "--model={I}/truncated: {I}/truncated/model.safetensors: not a readable "
     "safetensors file"),
    (G, ["--model={I}/broken_tokenizer"], "cannot load its tokenizer (tokenizer.json / tokenizer_config.json): "
     "JSONDecodeError"),
    (G, ["--chat", "--model={I}/strict_template"], "prompts.jsonl:2: tokenizer '{I}/strict_template': chat template "
     "failed (TemplateError: no chats)"),
    (G, ["--output={I}/prompts.jsonl"], "--output={I}/prompts.jsonl is --prompts={I}/prompts.jsonl: writing it would "
     "delete that input"),
    (G, ["--output={OUT}"], "--output={OUT} is a directory"),
    (G, ["--drafter={I}/missing"], "--drafter={I}/missing: drafter directory '{I}/missing' does not exist"),
    (G, ["--drafter=random", "--strategy=bogus"], "--strategy=bogus: strategy 'bogus' is not 'depth_topk_verify'"),
    (G, ["--temprature=1"], "Unknown command line flag 'temprature'"),
    (G, ["extra"], "unexpected arguments: ['extra']"),
    (B, ["--batch_sizes=0"], "--batch_sizes=0: expected positive integers"),
    (B, ["--batch_sizes=two"], "--batch_sizes=two: expected positive integers"),
    (B, ["--temperatures=0,nan"], "--temperatures=0,nan: expected numbers >= 0"),
    (B, ["--temperatures=-1"], "--temperatures=-1: expected numbers >= 0"),
    (B, ["--strategies=bogus"], "--strategies=bogus: strategy 'bogus' is not"),
    (B, ["--temperature=nan"], "flag --temperature=nan: must be a finite number >= 0"),
    (B, ["--task=nosuchtask"], "--task=nosuchtask: unknown task family"),
    (B, ["--output={OUT}/grid.csv"], "the table is also written beside it as {OUT}/grid.csv"),
    (B, ["--drafter={I}/missing"], "--drafter={I}/missing: drafter directory"),
    (B, ["--model={I}/truncated"], "not a readable safetensors file"),
    (T_OUT, ["--output={I}/model"], "--output={I}/model is --model={I}/model: writing it would delete that input"),
    (T_OUT, ["--output={I}"], "--output={I} holds --model={I}/model: writing it would delete that input"),
    (T_OUT, ["--output={I}/other"], "--output={I}/other: it exists and is not a drafter checkpoint: refusing to "
     "replace it"),
    (T_OUT, ["--output={I}/drafter"], "--output={I}/drafter already holds a drafter checkpoint; pass --overwrite"),
    (T, ["--prompts=", "--task=nosuchtask"], "--task=nosuchtask: unknown task family"),
    (T, ["--task=basic_arithmetic"], "Exactly one of (prompts, task) must have a value other than None"),
    (T, ["--row_len=5"], "--row_len=5 cannot hold prompt 1 (10 tokens as encoded) and a response token"),
    (T, ["--learning_rate=nan"], "--learning_rate=nan: must be a finite number"),
    (T, ["--eval_fraction=nan"], "--eval_fraction=nan: must be a finite number"),
    (T, ["--temperature=-1"], "flag --temperature=-1.0: must be a finite number >= 0"),
    (T, ["--model={I}/broken_tokenizer"], "cannot load its tokenizer"),
    (T, ["--prompts={I}/nonutf8.jsonl"], "nonutf8.jsonl:1: not UTF-8 text"),
    (T, ["--eagle3_layers=a,b,c"], "--eagle3_layers=a,b,c: expected integers"),
    (E_OUT, ["--output={I}/drafter"], "--output={I}/drafter is --drafter={I}/drafter: writing it would delete"),
    (E_OUT, ["--output={I}/model"], "--output={I}/model is --model={I}/model"),
    (E_OUT, ["--output={I}/eagle"], "--output={I}/eagle already holds an EAGLE export; pass --overwrite"),
    (E_OUT, ["--output={I}/other", "--overwrite"], "--output={I}/other: it exists and is not an EAGLE export"),
    (E, ["--drafter={I}/missing"], "--drafter={I}/missing: drafter directory"),
    (E, ["--model={I}/truncated"], "not a readable safetensors file"),
    (MAIN, ["--config=missing.py"], "--config=missing.py: cannot load it ([Errno 2] No such file or directory"),
    (MAIN, ["--config=" + REPO + "/configs/tiny.py:bogus"], "unknown variant 'bogus' (known: smoke)"),
    (MAIN, ["--config.rollout.nsamples=2"], "unknown config key 'nsamples' in --config.rollout.nsamples (did you "
     "mean 'num_samples'?); every key"),
    (MAIN, ["--config.rollout.sampling.temperature=nan"], "--config.rollout.sampling.temperature=nan: must be a "
     "finite number"),
    (MAIN, ["--config.rl.optimizer.learning_rate=inf"], "--config.rl.optimizer.learning_rate=inf: must be a finite "
     "number"),
    (MAIN, ["--config.rollout.sampling.top_p=0"], "config.rollout.sampling.top_p=0.0: must be in (0, 1]"),
    (MAIN, ["--config.rollout.top_p=0.5"], "config.rollout.top_p is now config.rollout.sampling.top_p"),
    (MAIN, ["--config={I}/old_keys.py"], "config.drafter.warmup_steps is now config.drafter.distill.steps"),
    (MAIN, ["--config={I}/old_section.py"], "config.kernels.attention is now config.rollout.engine.attention"),
    (MAIN, ["--config.rollout.engine.batch_buckets=(1,2,8)"], "config.rollout.engine.batch_buckets=(1, 2, 8): must "
     "be 1, 2, 4, ... (powers of two)"),
    (MAIN, ["--config.drafter.feature_layers=(1,2)"], "config.drafter.feature_layers=(1, 2): EAGLE-3 needs three"),
    (MAIN, ["--config.workdir={I}/prompts.jsonl"], "config.workdir='{I}/prompts.jsonl': not a directory"),
    (MAIN, ["--config.rollout.compilation_cache_dir={I}/prompts.jsonl/cache"], "config.rollout.compilation_cache_dir="
     "'{I}/prompts.jsonl/cache': {I}/prompts.jsonl is not a directory"),
    (MAIN, ["--config.data.path={I}/missing.jsonl", "--config.eval.every=0"], "config.data.path='{I}/missing.jsonl': "
     "dataset file not found"),
    (MAIN, ["--config.data.path={I}/broken.parquet", "--config.eval.every=0"], "config.data.path='{I}/broken.parquet'"
     ": {I}/broken.parquet: not a readable Parquet file"),
    (MAIN, ["--config.policy.path={I}/missing"], "config.policy.path='{I}/missing': model directory"),
    (MAIN, ["--config.policy.path={OUT}/run/export/policy"], "config.policy.path='{OUT}/run/export/policy' lies in "
     "{OUT}/run/export, which the run's export replaces"),
    (("tlt_jax.sft",), ["--config=missing.py"], "--config=missing.py: cannot load it"),
    (C, ["--gguf={I}/missing.gguf"], "--gguf={I}/missing.gguf: '{I}/missing.gguf' is neither a GGUF file nor an "
     "installed Python distribution"),
    (C, ["--gguf=no-such-distribution"], "--gguf=no-such-distribution: 'no-such-distribution' is neither"),
    (C, ["--gguf={I}/prompts.jsonl"], "--gguf={I}/prompts.jsonl: {I}/prompts.jsonl: not a readable GGUF file"),
    (C, ["--gguf={I}/gpt2.gguf"], "--gguf={I}/gpt2.gguf: {I}/gpt2.gguf: architecture 'gpt2' is not supported; "
     "supported: llama, qwen2, qwen3"),
    (C, ["--output={I}/other"], "--output={I}/other: it exists and is not a model directory"),
    (C, ["--output={I}/model"], "--output={I}/model already holds a model directory as save_pretrained writes it; "
     "pass --overwrite"),
    (C, ["--output={I}"], "--output={I} holds --gguf={I}/llama.gguf"),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_policy_dir):
  """A model, damaged copies of it, a drafter, an EAGLE export, another directory and prompt files."""
  root = tmp_path_factory.mktemp("inputs")
  model = str(root / "model")
  shutil.copytree(tiny_policy_dir, model)
  for name in ("truncated", "broken_tokenizer", "strict_template"):
    shutil.copytree(model, root / name)
  weights = root / "truncated" / "model.safetensors"
  weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
  (root / "broken_tokenizer" / "tokenizer.json").write_text('{"version": ')
  (root / "strict_template" / "chat_template.jinja").write_text("{{ raise_exception('no chats') }}")
  target = hf.from_pretrained(model)
  drafter = Drafter(target.config, rngs=nnx.Rngs(0))
  checkpoint.save_drafter(drafter, str(root / "drafter"))
  export.export_eagle(target, drafter, str(root / "eagle"))
  (root / "other").mkdir()
  (root / "other" / "notes.txt").write_text("not a tlt_jax output")
  (root / "prompts.jsonl").write_text('{"prompt_ids": [5, 6, 7, 8]}\n{"prompt": "1 + 2 ="}\n')
  (root / "bool.jsonl").write_text('{"prompt_ids": [true, false, true]}\n')
  (root / "nonutf8.jsonl").write_bytes(b'\xff\xfe{"prompt": "1 + 2"}\n')
  (root / "broken.parquet").write_text("not parquet")
  # Old keys: on base() (check() finds it), and in a section that is gone (the file fails to load).
  (root / "old_keys.py").write_text("from tlt_jax import config\n\ndef get_config():\n  c = config.base()\n"
                                    "  c.drafter.warmup_steps = 3\n  c.lock()\n  return c\n")
  (root / "old_section.py").write_text("from tlt_jax import config\n\ndef get_config():\n  c = config.get_config()\n"
                                       "  c.kernels.attention = 'xla'\n  return c\n")
  write_gguf(root / "llama.gguf", "llama")
  write_gguf(root / "gpt2.gguf", "gpt2")
  return root


def _snapshot(root):
  return sorted((os.path.relpath(os.path.join(top, n), root), os.stat(os.path.join(top, n)).st_mtime_ns)
                for top, dirs, names in os.walk(root) for n in dirs + names)


@pytest.fixture(scope="module")
def runs(inputs, tmp_path_factory):
  """Every case run once, in one forking process: (args, its empty output directory, exit code, stderr)
  per case, and the inputs' snapshots before and after."""
  before = _snapshot(inputs)
  root = tmp_path_factory.mktemp("cases")
  cases = []
  for i, ((module, *base), more, _) in enumerate(CASES):
    out = root / f"case{i}"
    out.mkdir()
    fill = lambda a: a.format(I=inputs, OUT=out)
    overridden = {a.split("=")[0] for a in more}
    args = [fill(a) for a in more] + [fill(a) for a in base if a.split("=")[0] not in overridden]
    cases.append((module, [a for a in args if not a.endswith("=")], out))
  (root / "logs").mkdir()
  results = run_clis(cases, root / "logs", prelude=_STOP_BEFORE_WORK)
  return [(args, out, code, stderr) for (_, args, out), (code, _, stderr) in zip(cases, results)], before, \
      _snapshot(inputs)


@pytest.mark.parametrize("index", range(len(CASES)),
                         ids=[f"{base[0].split('.')[-1]} {' '.join(more)}" for base, more, _ in CASES])
def test_bad_input_is_a_one_line_error_and_writes_nothing(index, runs, inputs):
  args, out, code, stderr = runs[0][index]
  lines = stderr.strip().splitlines()
  assert code == 1 and len(lines) == 1 and lines[0].startswith("error: "), (args, stderr[-3000:])
  assert CASES[index][2].format(I=inputs, OUT=out) in lines[0], (args, lines[0])
  assert os.listdir(out) == []  # nothing written, not even a temporary


def test_bad_inputs_touch_no_input(runs):
  _, before, after = runs
  assert after == before


def test_token_budgets_cut_only_the_long_prompt():
  """A 124-token prompt in a 128-position model gets 4 new tokens; the others keep --max_new_tokens."""
  prompts = [[1] * 124, [1] * 10, [1] * 20]
  capacity, cut = cli.token_budgets(prompts, 64, 128)
  assert capacity == 64 and cut == {0: 4}
  assert cli.token_budgets(prompts[1:], 64, 128) == (64, {})


def test_a_missing_optional_dependency_is_one_line_naming_its_extra(monkeypatch):
  monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None if name == "accelerate" else object())
  with pytest.raises(SystemExit) as e:
    cli.require("gguf", "accelerate")
  assert str(e.value) == 'error: accelerate is not installed: it comes with the gguf extra, pip install -e ".[gguf]"'
  # A tool whose work imports one (here: a stand-in main) ends the same way, without a traceback.
  script = ("from tlt_jax import cli\n"
            "def main(argv):\n  raise ModuleNotFoundError(\"No module named 'wandb.sdk'\", name='wandb.sdk')\n"
            "cli.run(main)\n")
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, check=False)
  assert out.returncode == 1 and "Traceback" not in out.stderr
  assert out.stderr.strip().splitlines()[-1] == ('error: wandb is not installed: it comes with the wandb extra, '
                                                 'pip install -e ".[wandb]"')


def test_provenance_names_the_commit_or_none_without_git(monkeypatch):
  """A record's provenance: this checkout's commit (hex, `+changes` when tracked files differ), None
  where git is missing; the machine and a UTC date either way."""
  record = cli.provenance()
  assert re.fullmatch(r"[0-9a-f]{10}(\+changes)?", record["commit"]) and record["date"].endswith(" UTC")
  monkeypatch.setattr(cli.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(FileNotFoundError("git")))
  assert cli.provenance()["commit"] is None and "CPU cores" in cli.provenance()["machine"]
