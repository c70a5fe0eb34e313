"""Tiny random Hugging Face models of each family the package reads, built on the spot with
`transformers` (torch). Apart from conftest so that a script can build them without the test
suite's set-up (its simulated CPU devices and interpreted Triton): experiments/gpu_check.py's
parity part builds them on a GPU host."""

# name -> (transformers config class, kwargs). Small, but every switch of the family is on in
# at least one: q/k/v bias, tied and untied heads, GQA, llama3 rope scaling, q/k norm, head_dim
# independent of hidden / heads.
FAMILIES = {
    "qwen2_tied": ("Qwen2Config", dict(tie_word_embeddings=True, num_key_value_heads=2)),
    "qwen2_untied": ("Qwen2Config", dict(tie_word_embeddings=False, num_key_value_heads=4, rope_theta=1e6)),
    "llama3": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=False, rope_theta=500000.0,
                                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                     high_freq_factor=4.0, original_max_position_embeddings=64))),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),
}
VOCAB = 96


def build_hf_model(family: str, seed: int = 0, **sizes):
  """A tiny random `transformers` model of `family` with every weight (biases, norms) perturbed.
  `sizes` overrides the shape (hidden_size=64 gives the 16-wide heads the GPU kernels need)."""
  import torch
  import transformers

  cls_name, kwargs = FAMILIES[family]
  shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=256)
  cfg = getattr(transformers, cls_name)(eos_token_id=1, pad_token_id=0, **{**shape, **kwargs, **sizes})
  torch.manual_seed(seed)
  model = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
      else:
        p.copy_(0.1 * torch.randn_like(p))
  return model
