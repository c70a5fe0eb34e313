"""The matmuls of a verify pass on XLA:CPU: a decoder's projections with M rows at a time.

  python experiments/matmul_rows.py --model=models/smollm2 [--rows=1,2,3,5,8 --repeats=7 --output=FILE.json]

A verify pass of M tree tokens runs every projection with M rows where a plain decode step runs
one. This times that part alone: the model's layers' q/k/v/o/gate/up/down matmuls (`x @ W`, as
`nnx.Linear` runs them) and its LM head over the vocabulary, with float32 weights of the model's
shapes (random, each layer its own and unrolled, as the tools run on a CPU), for M rows, in four
forms, interleaved, medians of `--repeats` rounds of 5 passes:
  model          the head as the model computes it: tied embeddings [V, H] contracted on H
                 (`Embed.attend`), or an untied `lm_head` [H, V];
  head H x V     the head stored [H, V] (an untied model's form);
  no YNNPACK     the model's form, XLA:CPU's YNNPACK library fusion off for the executable;
  both           the head stored [H, V] and YNNPACK off.
Prints ms per pass and each one's ratio to the model's form at the first of `--rows`, and writes
the table.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from tlt_jax.models import hf

_MODEL = flags.DEFINE_string("model", None, "Hugging Face model directory (only its config is read).", required=True)
_ROWS = flags.DEFINE_list("rows", ["1", "2", "3", "5", "8"], "Rows per pass (M).")
_REPEATS = flags.DEFINE_integer("repeats", 7, "Interleaved timed rounds (5 passes each).", lower_bound=1)
_OUTPUT = flags.DEFINE_string("output", None, "JSON file for the table.")

_NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}
FORMS = {"model": (False, {}), "head H x V": (True, {}), "no YNNPACK": (False, _NO_YNN), "both": (True, _NO_YNN)}


def _weights(cfg, seed: int = 0):
  rng = np.random.default_rng(seed)
  h, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  shapes = {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, f), "up": (h, f), "down": (f, h)}
  draw = lambda shape: jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02)
  layers = [{name: draw(shape) for name, shape in shapes.items()} for _ in range(cfg.num_layers)]
  return layers, draw((h, cfg.vocab_size))


def _stack(kv_size: int, head_vxh: bool):
  """x [M, H] through every layer's projections (attention left out: k + v added to q stand in for
  it) and the head."""
  def forward(x, layers, head):
    for p in layers:
      mix = x @ p["q"]
      mix = mix.at[:, :kv_size].add(x @ p["k"] + x @ p["v"])
      x = x + mix @ p["o"]
      x = x + (jax.nn.silu(x @ p["gate"]) * (x @ p["up"])) @ p["down"]
    return jax.lax.dot_general(x, head, (((1,), (1,)), ((), ()))) if head_vxh else x @ head
  return forward


def main(argv):
  del argv
  cfg, _ = hf.read_config(_MODEL.value)
  rows = [int(r) for r in _ROWS.value]
  layers, head_hxv = _weights(cfg)
  head_vxh = jnp.asarray(head_hxv.T)
  runs = {}
  for name, (stored_hxv, options) in FORMS.items():
    vxh = cfg.tie_word_embeddings and not stored_hxv
    for m in rows:
      x = jnp.full((m, cfg.hidden_size), 0.1, jnp.float32)
      args = (x, layers, head_vxh if vxh else head_hxv)
      exe = jax.jit(_stack(cfg.num_kv_heads * cfg.head_dim, vxh)).lower(*args).compile(compiler_options=options)
      exe(*args).block_until_ready()  # the first run sets up library fusions
      runs[name, m] = (exe, args)
  times = {key: [] for key in runs}
  for _ in range(_REPEATS.value):
    for key, (exe, args) in runs.items():
      start = time.perf_counter()
      for _ in range(5):
        exe(*args).block_until_ready()
      times[key].append((time.perf_counter() - start) / 5 * 1e3)
  base = float(np.median(times["model", rows[0]]))
  table = [{"form": name, "rows": m, "ms": round(float(np.median(times[name, m])), 2),
            "vs_model_first_rows": round(float(np.median(times[name, m])) / base, 3)} for name in FORMS for m in rows]
  print(f"{cfg.num_layers} layers, tied head: {cfg.tie_word_embeddings}; ms per pass (vs the model's form at "
        f"{rows[0]} row{'s' * (rows[0] > 1)})")
  print(f"{'form':12s}" + "".join(f"{f'{m} rows':>16s}" for m in rows))
  for name in FORMS:
    cells = [f"{r['ms']:>9.1f} {r['vs_model_first_rows']:4.2f}x" for r in table if r["form"] == name]
    print(f"{name:12s}" + "".join(cells))
  if _OUTPUT.value:
    with open(_OUTPUT.value, "w") as f:
      json.dump({"model": _MODEL.value, "layers": cfg.num_layers, "tied_head": cfg.tie_word_embeddings,
                 "table": table}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
