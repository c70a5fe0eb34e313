"""Every accelerator config compiled for the GPUs and TPUs it is meant for, deviceless, in one table.

  python experiments/dry_runs.py --out=runs/dry_runs                        # every pair: hours on 2 cores
  python experiments/dry_runs.py --out=runs/dry_runs --pairs=r1_7b:h100,qwen2_5_0_5b:l4

Each pair is `python -m tlt_jax.main --config=configs/<config>.py --config.dry_run=True
--config.mesh.target=<target>` in a process of its own (the `gpu` and `tpu` extras installed), its report
kept in <out>/<config>_<target>.json (a pair whose report is there is not run again: a killed run
continues). The table, printed and written to <out>/summary.json (with the command, machine, commit and
date): per pair, the executables compiled, the largest per-device need against the device's memory (and the
executable; the five largest needs in the record), and the roofline's decode step and verify-k / decode ratios
at batch 1 and 16 (or the largest speculative bucket below).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from absl import app, flags

from tlt_jax import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIRS = ("r1_7b:h100", "r1_7b:h200", "r1_7b:a100-80gb", "r1_7b:tpu-v5p", "qwen2_5_7b:h100", "qwen2_5_7b:tpu-v5p",
         "qwen2_5_32b:h100", "qwen2_5_32b:tpu-v5p", "qwen2_5_0_5b:l4", "qwen2_5_0_5b:tpu-v5e", "accelerator:h100",
         "accelerator:h200")

_OUT = flags.DEFINE_string("out", "runs/dry_runs", "Reports and the summary.")
_PAIRS = flags.DEFINE_list("pairs", list(PAIRS), "config:target pairs (configs/<config>.py, tlt_jax/targets).")


def row(pair: str, report: dict, seconds: float | None, error: str) -> dict:
  """One table row of a report (the error line where the dry run failed)."""
  ex = report.get("executables", {})
  roof = report.get("roofline", {})
  ratios = roof.get("verify_over_decode", {})
  decode = {b: s["ms"] for b, s in ((k.split("/")[0], v) for k, v in roof.get("steps", {}).items() if k.endswith("/1"))
            if "ms" in s}
  largest = sorted(ex.items(), key=lambda kv: -kv[1].get("need_gb", 0.0))[:5]
  return {"pair": pair, "devices": report.get("devices"), "compiled": sum(e["compiled"] for e in ex.values()),
          "executables": len(ex), "failed": report.get("failed", []), "fits": report.get("fits"),
          "max_per_device_gb": report.get("max_per_device_gb"), "device_memory_gb": report.get("device_memory_gb"),
          "largest": report.get("max_per_device_executable"), "decode_ms": decode, "verify_over_decode": ratios,
          "context_tokens": roof.get("context_tokens"), "seconds": seconds, "error": error,
          "resident_gb": report.get("resident_gb"), "cache_rows": report.get("cache_rows"),
          "roofline_steps": roof.get("steps"), "largest_needs": {name: {k: e.get(k) for k in (
              "need_gb", "resident_gb", "temp_gb", "beside_gb")} for name, e in largest}}


def table(rows: list[dict]) -> str:
  lines = ["| config | target | compiled | largest need / memory, GiB (executable) | decode ms at b=1 / b=16 "
           "(roofline) | verify-k / decode at b=1 | at b=16 |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    config, target = r["pair"].split(":")
    b16 = max((b for b in r["decode_ms"] if int(b) <= 16), key=int, default=None)
    ratio = lambda b: ", ".join(f"{k}: {v}" for k, v in r["verify_over_decode"].get(b, {}).items()) or "-"
    need = (f"{r['max_per_device_gb']:.1f} / {r['device_memory_gb']:.1f} ({r['largest']})"
            if r["max_per_device_gb"] is not None else "-")
    lines.append(f"| {config} | {target} | {r['compiled']} of {r['executables']} | "
                 f"{'**' if r['fits'] is False else ''}{need}{'**' if r['fits'] is False else ''} | "
                 f"{r['decode_ms'].get('1', '-')} / {r['decode_ms'].get(b16, '-') if b16 else '-'} | "
                 f"{ratio('1')} | {ratio(b16) if b16 else '-'} |")
  return "\n".join(lines)


def main(argv):
  del argv
  out = os.path.abspath(_OUT.value)
  os.makedirs(out, exist_ok=True)
  rows = []
  for pair in _PAIRS.value:
    config, target = pair.split(":")
    path = os.path.join(out, f"{config}_{target}.json")
    log = os.path.join(out, f"{config}_{target}.log")
    seconds, error = None, ""
    if not os.path.exists(path):
      print(f"[dry_runs] {pair}: compiling", flush=True)
      start = time.perf_counter()
      with open(log, "w", encoding="utf-8") as f:
        run = subprocess.run([sys.executable, "-m", "tlt_jax.main", f"--config=configs/{config}.py",
                              "--config.dry_run=True", f"--config.mesh.target={target}", f"--config.workdir={out}"],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=f, check=False)
      seconds = round(time.perf_counter() - start)
      produced = os.path.join(out, f"dry_run_{target}.json")
      if not os.path.exists(produced):
        print(f"[dry_runs] {pair}: no report (exit {run.returncode}); see {log}", flush=True)
        continue
      os.replace(produced, path)
      with open(log, encoding="utf-8") as f:
        errors = [line.strip() for line in f if line.startswith("error: ")]
      error = errors[-1] if errors else ""
    with open(path, encoding="utf-8") as f:
      report = json.load(f)
    rows.append(row(pair, report, seconds if seconds is not None else report.get("seconds"), error))
    print(f"[dry_runs] {pair}: {rows[-1]['compiled']} of {rows[-1]['executables']} compiled, fits: "
          f"{rows[-1]['fits']} ({rows[-1]['seconds']} s){'; ' + error if error else ''}", flush=True)
  with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
    json.dump({**cli.provenance(), "rows": rows}, f, indent=1)
  print(table(rows))


if __name__ == "__main__":
  app.run(main)
