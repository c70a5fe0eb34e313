"""The GPU check's parts, each run by experiments/gpu_check.py in a process of its own under a deadline:
env (the package end to end, versions, imports), kernels (bench_kernels against the float32 reference),
parity (the engine's greedy tokens against transformers'), figures (accelerator.py sized by gpu_plan),
and the helpers they share (subprocesses under a timeout, JSON files). Each part returns its result;
`kernel_goals` and `parity_goal` read the goals out of theirs.
"""

from __future__ import annotations

import ast
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

from gpu_plan import ASSUMED, plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(ROOT, "experiments")
CHECK = os.path.join(HERE, "gpu_check.py")  # the script a part runs as (`--part=NAME`)

# ---- shared helpers ----

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


def fmt(v) -> str:
  return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


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


def part_env(work: str, deadline: float, smoke: bool, main_smoke: bool = True) -> dict:
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
  # What `pip show` says of each, from the same metadata (pip show also works out every package's
  # dependents: 10-30 s of CPU on a 2-core machine).
  found = {}
  for name in names:
    try:
      found[name] = md.distribution(name)
    except md.PackageNotFoundError:
      pass
  with open(os.path.join(work, "env", "installed.txt"), "w", encoding="utf-8") as f:
    for name, dist in found.items():
      f.write(f"Name: {dist.metadata['Name']}\nVersion: {dist.version}\nLocation: {dist.locate_file('')}\n"
              f"Requires: {', '.join(dist.requires or [])}\n---\n")
  result["installed"] = {"of": len(names), "found": len(found), "not_found": sorted(set(names) - set(found))}
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
  if not main_smoke:
    return {**result, "seconds": round(time.perf_counter() - start, 1)}
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
    run = run_logged([sys.executable, CHECK, "--part=hf_greedy", f"--work={work}"],
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

def accelerator_done(out: str) -> dict:
  """The pieces accelerator.py's --out already holds."""
  done = {"target": os.path.exists(os.path.join(out, "target.json"))}
  records = read_json(os.path.join(out, "grid.json")) or []
  for r in records:
    done["grid_full" if r["head"] != records[0]["head"] else f"grid_b{r['batch_size']}"] = True  # the 2nd head: full
  done["bandit"] = os.path.exists(os.path.join(out, "bandit.json"))
  done["rl"] = os.path.exists(os.path.join(out, "rl.json"))
  return done


def part_compile(work: str, deadline: float, smoke: bool, target: str) -> dict:
  """configs/accelerator.py's dry run compiled for `target` (the device's own description; "": the local
  GPU's, if a target describes it) by its own compiler, deviceless: every executable the figures part runs,
  checked to compile and fit before a device's minute goes to them, and the roofline the figures are set
  beside. On a CPU it runs ahead of the device (`--parts=compile --target=h100`; the --out it fills is then
  carried to the device, where the part is done)."""
  sys.path.insert(0, ROOT)
  if not target:
    import jax  # pylint: disable=import-outside-toplevel
    from tlt_jax import targets  # pylint: disable=import-outside-toplevel
    local = targets.of_device_kind(jax.devices()[0].device_kind) if jax.default_backend() == "gpu" else None
    if local is None:
      return {"skipped": f"no target describes {jax.devices()[0].device_kind}: pass --target"}
    target = local.key
  config = "configs/accelerator.py" + (":smoke" if smoke else "")
  folder = os.path.join(work, "compile")
  os.makedirs(folder, exist_ok=True)
  # Smoke: the plumbing, one strategy verifying 16 tokens as one of the four does, at depth 2 (a third of the
  # compile time of depth 8).
  smoke_flags = ["--config.rollout.strategies=('2_4_16',)"] if smoke else []
  run = run_logged([sys.executable, "-m", "tlt_jax.main", f"--config={config}", "--config.dry_run=True",
                    f"--config.mesh.target={target}", f"--config.workdir={folder}", *smoke_flags],
                   os.path.join(work, "compile.out"), deadline)
  report = read_json(os.path.join(folder, f"dry_run_{target}.json")) or {}
  errors = [line.strip() for line in tail(os.path.join(work, "compile.out"), 3).splitlines()
            if line.startswith("error: ")]
  return {"target": target, "config": config, "run": run, "error": errors[-1] if errors else "",
          "executables": len(report.get("executables", {})), "failed": report.get("failed"),
          "fits": report.get("fits"), "max_per_device_gb": report.get("max_per_device_gb"),
          "largest": report.get("max_per_device_executable"), "device_memory_gb": report.get("device_memory_gb"),
          "roofline": report.get("roofline")}


def compile_goal(result: dict | None) -> dict:
  """The compile part's goal: executables that do not compile or fit (None when it did not run)."""
  if not result or result.get("fits") is None:
    return {}
  bad = len(result["failed"]) + (not result["fits"])
  note = result["error"] or f"{result['executables']} executables for {result['target']}"
  return {"value": bad, "met": bad == 0, "note": note[:200]}


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
