"""setup.py: the README's first command works on a fresh machine.

The suite's own environment holds torch and the test extras, which pull in packages tlt_jax needs
but might forget to require (jinja2 once came only that way: the suite was green while the
README's first command failed for a newcomer). So this test makes a fresh virtual environment (no
system site packages: only what the README's `pip install -e .` brings), checks that none of the
test-only packages are there, and runs the README's first command in it, from an empty
directory, to the end, on the smoke variant of the default config (seconds-sized shapes, the
same pipeline: SFT warm start, drafter warm-up, an RL step with TLT rollouts, the export).
pip fetches what it needs (its cache makes repeats fast); a few minutes in all.
"""

import ast
import json
import os
import re
import shutil
import subprocess
import sys

from tests.conftest import FAST_COMPILE_FLAGS, run_clis

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALL, RUN = "pip install -e .", "python -m tlt_jax.main"
# Nor JAX_*: a newcomer sets none. A newcomer's Python writes bytecode: the run's reward workers read what its main
# process compiled (this machine's PYTHONDONTWRITEBYTECODE=1 had each of them compile its imports again).
_NOT_INHERITED = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "XLA_FLAGS", "PYTHONDONTWRITEBYTECODE")


def readme_first_command() -> str:
  with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
    section = f.read().split("\n## Two commands", 1)[1]
  return re.search(r"```bash\n(.*?)\n```", section, re.S).group(1).strip()


def test_readme_first_command_on_a_fresh_environment(tmp_path, xla_cache):
  assert readme_first_command() == f"{INSTALL} && {RUN}"  # what this test runs is what the README says
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
  env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED and not k.startswith("JAX_")}
  env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"  # as `activate` does
  # PIP_NO_COMPILE=0 is pip's spelling of --no-compile (no .pyc written ahead): the same packages, less CPU.
  install = subprocess.run(INSTALL, shell=True, cwd=REPO, env={**env, "PIP_NO_COMPILE": "0"}, capture_output=True,
                           text=True, timeout=1200)
  assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
  python = str(venv / "bin" / "python")
  absent = subprocess.run([python, "-c", "import importlib.util as u; print([m for m in ('torch', 'pytest', "
                           "'hypothesis', 'tlt_jax') if u.find_spec(m) is None])"], env=env, capture_output=True,
                          text=True, check=True, timeout=120).stdout.strip()
  assert absent == "['torch', 'pytest', 'hypothesis']", absent  # fresh: none of the test environment
  work = tmp_path / "newcomer"
  work.mkdir()
  # XLA compiles at the suite's fast-compile settings into the run's compilation cache (tests/conftest.py): the
  # run is mostly compiling, and what is checked here is the environment and the pipeline, not XLA's optimizer.
  smoke = f"--config={REPO}/configs/tiny.py:smoke --config.rollout.compilation_cache_dir={xla_cache}"
  run = subprocess.run(f"{RUN} {smoke}", shell=True, cwd=work,
                       env={**env, "XLA_FLAGS": FAST_COMPILE_FLAGS}, capture_output=True, text=True, timeout=1200)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
  assert run.stdout.startswith("RL: 1 step ("), run.stdout[-3000:]
  assert "steps without a policy update: 0 of 1" in run.stdout  # the smoke runs the update too
  summary = json.loads((work / "runs" / "tiny_smoke" / "summary.json").read_text())  # its own workdir
  assert summary["steps"] == 1
  for output in ("policy/config.json", "drafter/drafter_config.json", "export/policy/model.safetensors",
                 "export/drafter/model.safetensors", "metrics.jsonl", "completions.jsonl",
                 "run.png"):  # reasoning-gym brings matplotlib
    assert (work / "runs" / "tiny_smoke" / output).is_file(), output


def test_requirements_admit_the_accelerator_stack():
  """The GPU run's stack (Python 3.12, JAX 0.11.2; experiments/accelerator.py) and this machine's (3.11,
  0.10.2) both satisfy setup.py."""
  from packaging.requirements import Requirement
  from packaging.specifiers import SpecifierSet
  call = next(node for node in ast.walk(ast.parse(open(os.path.join(REPO, "setup.py"), encoding="utf-8").read()))
              if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup")
  kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("python_requires", "install_requires")}
  jax = next(Requirement(r) for r in kwargs["install_requires"] if Requirement(r).name == "jax")
  for python, jax_version in (("3.12.0", "0.11.2"), ("3.11.7", "0.10.2")):
    assert SpecifierSet(kwargs["python_requires"]).contains(python) and jax.specifier.contains(jax_version)


def test_an_installed_copy_finds_its_default_config(tmp_path):
  """`pip install .` (not editable) copies the package and its configs: `python -m tlt_jax.main` run from
  elsewhere with only that copy importable defaults to the copy's config file, and loads and
  checks it (then fails on the workdir it is given, a file); `--config=configs/<name>.py` is the shipped
  config (one that imports another too). The default config's dry run sizes it
  there (its vocabulary is its procedural tokenizer's); a dry run of a policy directory that is not
  there and no vocabulary size is one line naming the key."""
  source = tmp_path / "source"  # a copy: building in the checkout would leave build/ and *.egg-info there
  for folder in ("tlt_jax", "configs"):
    shutil.copytree(os.path.join(REPO, folder), source / folder, ignore=shutil.ignore_patterns("__pycache__"))
  for name in ("setup.py", "README.md"):
    shutil.copy(os.path.join(REPO, name), source / name)
  site = tmp_path / "site"
  install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                            "--no-compile", "--quiet", "--target", str(site), str(source)],
                           capture_output=True, text=True, timeout=300)
  assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
  shutil.rmtree(source)
  work = tmp_path / "elsewhere"
  work.mkdir()
  (work / "a_file").write_text("")
  env = {**{k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}, "PYTHONPATH": str(site),
         "XLA_FLAGS": FAST_COMPILE_FLAGS}
  logs = tmp_path / "logs"
  logs.mkdir()
  cases = (["--helpfull"], ["--config.workdir=a_file"], ["--config.dry_run=True", "--config.eval.every=0"],
           ["--config.dry_run=True", f"--config.policy.path={work / 'no_model'}"],
           ["--config=configs/qwen2_5_32b.py", "--keys"])  # a shipped config that imports another, from here
  # Forked from one process that imported the copy's tlt_jax.main.
  helpfull, workdir, dry, missing, shipped = run_clis([("tlt_jax.main", args, work) for args in cases], logs, env=env)
  assert shipped[0] == 0 and "mesh.dry_run_devices = 32  (default 8)" in shipped[1], shipped[2][-3000:]
  # absl wraps the help text, also at the path's hyphens.
  assert f"(default:'{site / 'tlt_jax' / 'config.py'}')" in "".join(helpfull[1].split()), helpfull[2][-3000:]
  assert workdir[0] == 1 and workdir[2].strip().endswith("error: config.workdir='a_file': not a directory"), \
      workdir[2][-3000:]
  assert dry[0] == 0, dry[2][-3000:]
  report = json.loads(dry[1])
  assert report["model"] == "config.model" and report["fits"] and report["parameters_b"] > 0
  assert missing[0] == 1 and "Traceback" not in missing[2] and missing[2].strip().splitlines()[-1] == (
      f"error: dry run: config.model.vocab_size: {work / 'no_model' / 'config.json'} is not there, so a dry run "
      "takes the architecture from config.model and needs the vocabulary size"), missing[2][-3000:]


def test_readme_python_example_runs(tiny_policy_dir, tmp_path, monkeypatch):
  """The README's "In Python" example, run as written on a tiny policy and a random drafter laid out
  where it reads them (runs/tiny/...): its imports and calls stay those of the package."""
  from flax import nnx

  from tlt_jax.drafter import checkpoint
  from tlt_jax.drafter.model import Drafter
  from tlt_jax.models import hf
  with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
    section = f.read().split("\n## In Python", 1)[1]
  code = re.search(r"```python\n(.*?)\n```", section, re.S).group(1)
  shutil.copytree(tiny_policy_dir, tmp_path / "runs" / "tiny" / "policy")
  checkpoint.save_drafter(Drafter(hf.read_config(tiny_policy_dir)[0], rngs=nnx.Rngs(0)),
                          str(tmp_path / "runs" / "tiny" / "drafter"))
  monkeypatch.chdir(tmp_path)
  scope = {}
  exec(compile(code.replace("max_new_tokens=256", "max_new_tokens=8"), "README.md", "exec"), scope)  # noqa: S102
  assert len(scope["rollout"].samples) == 8
