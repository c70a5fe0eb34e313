"""`python -m tlt_jax.sft`: the default config's SFT (shrunk by overrides) writes a policy
`transformers` loads, a report, and prints it."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import torch
import transformers

from tlt_jax.models import KVCache, hf, transformer

_SMALL = ["--config.model.hidden_size=32", "--config.model.num_layers=2", "--config.model.num_heads=2",
          "--config.model.num_kv_heads=1", "--config.model.head_dim=16", "--config.model.intermediate_size=64",
          "--config.sft.num_problems=200", "--config.sft.steps=4", "--config.sft.batch_rows=4",
          "--config.sft.row_len=128", "--config.sft.warmup_steps=1", "--config.sft.eval_size=16",
          "--config.sft.eval_max_new_tokens=32"]


def test_sft_writes_a_policy_transformers_loads(tmp_path):
  run = subprocess.run([sys.executable, "-m", "tlt_jax.sft", f"--config.workdir={tmp_path}", *_SMALL],
                       capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  report = json.loads(run.stdout[run.stdout.index("{"):])
  assert report["loss_last"] < report["loss_first"]
  for mode in ("greedy", "temperature_1"):
    assert set(report[mode]["response_length"]) >= {"median", "p90", "p99", "max"}
    assert 0 <= report[mode]["accuracy"] <= 1
  assert json.load(open(os.path.join(tmp_path, "sft_report.json")))["steps"] == 4
  policy = os.path.join(tmp_path, "policy")
  ours = hf.from_pretrained(policy)
  ref = transformers.AutoModelForCausalLM.from_pretrained(policy).eval()
  reloaded_tok = transformers.AutoTokenizer.from_pretrained(policy)
  ids = reloaded_tok.apply_chat_template([{"role": "user", "content": "Calculate 1 + 2."}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
  assert reloaded_tok.decode(ids) == "<bos><|user|>Calculate 1 + 2.<|assistant|>"
  out = transformer.prefill(ours, jnp.asarray([ids]), jnp.asarray([len(ids)]), KVCache.zeros(ours.config, 1, len(ids)),
                            all_logits=True)
  with torch.no_grad():
    expected = ref(torch.tensor([ids])).logits[0].numpy()
  np.testing.assert_allclose(out.logits[0], expected, atol=1e-4)
