"""One config for the whole decoder family, read from and written to Hugging Face `config.json`.

The family differs only by switches: q/k/v bias (Qwen2), q/k RMSNorm (Qwen3), an independent
head_dim (Qwen3, Llama), llama3 RoPE scaling (Llama 3.x) and tied embeddings.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM")
_MODEL_TYPES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}


class ConfigError(ValueError):
  """A model config we cannot build; the message names the key and the file."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Static description of a decoder-only transformer (hashable, so usable as a jit static)."""

  architecture: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  # llama3 RoPE scaling as a sorted tuple of (key, value) pairs, or None.
  rope_scaling: tuple[tuple[str, float], ...] | None = None
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = False
  mlp_bias: bool = False
  qk_norm: bool = False
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 32768
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  pad_token_id: int | None = None
  # Not a Hugging Face key: how our decoder runs its layers. True: parameters stacked along a
  # leading layer axis and one `lax.scan` over them, so every executable compiles one layer body;
  # False: the layers unrolled, each its own parameters (paths `model.layers.<i>.*`).
  scan_layers: bool = True

  def __post_init__(self):
    if self.architecture not in SUPPORTED_ARCHITECTURES:
      raise ConfigError(
          f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(f"num_attention_heads={self.num_heads} is not a multiple of "
                        f"num_key_value_heads={self.num_kv_heads}")

  @property
  def model_type(self) -> str:
    return _MODEL_TYPES[self.architecture]

  @property
  def stop_token_ids(self) -> tuple[int, ...]:
    if self.eos_token_id is None:
      return ()
    return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)

  def inv_freq(self) -> np.ndarray:
    """RoPE inverse frequencies [head_dim // 2], float64 on the host (scaled for llama3)."""
    inv = 1.0 / self.rope_theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim)
    if self.rope_scaling is None:
      return inv
    s = dict(self.rope_scaling)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
    scaled = np.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, blended, scaled)

  @classmethod
  def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> "ModelConfig":
    """Builds a config from a Hugging Face config dict (old `rope_scaling` or new `rope_parameters`)."""
    archs = hf.get("architectures") or []
    if not archs:
      model_type = hf.get("model_type")
      archs = [a for a, t in _MODEL_TYPES.items() if t == model_type]
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
      raise ConfigError(f"{source}: unsupported architectures {archs or hf.get('model_type')!r}; "
                        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    arch = archs[0]

    def need(key):
      if key not in hf:
        raise ConfigError(f"{source}: missing key {key!r}")
      return hf[key]

    if hf.get("use_sliding_window"):
      raise ConfigError(f"{source}: use_sliding_window=true is not supported")
    if hf.get("hidden_act", "silu") != "silu":
      raise ConfigError(f"{source}: hidden_act={hf['hidden_act']!r} is not supported (only 'silu')")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type == "default":
      rope_scaling = None
    elif rope_type == "llama3":
      keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
      missing = [k for k in keys if k not in rope]
      if missing:
        raise ConfigError(f"{source}: llama3 rope scaling lacks {missing}")
      rope_scaling = tuple(sorted((k, float(rope[k])) for k in keys))
    else:
      raise ConfigError(f"{source}: rope type {rope_type!r} is not supported (default, llama3)")
    hidden, heads = need("hidden_size"), need("num_attention_heads")
    eos = hf.get("eos_token_id")
    return cls(
        architecture=arch,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        intermediate_size=need("intermediate_size"),
        num_layers=need("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        # Qwen2 always has q/k/v bias; Llama and Qwen3 say so with `attention_bias`.
        qkv_bias=True if arch == "Qwen2ForCausalLM" else bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        pad_token_id=hf.get("pad_token_id"),
    )

  def to_hf(self) -> dict[str, Any]:
    """The Hugging Face config dict (old-style rope keys, which every transformers version reads)."""
    hf = {
        "architectures": [self.architecture],
        "model_type": self.model_type,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "hidden_act": "silu",
        "rope_theta": self.rope_theta,
        "rms_norm_eps": self.rms_norm_eps,
        "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings,
        "bos_token_id": self.bos_token_id,
        "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
        "pad_token_id": self.pad_token_id,
    }
    if self.architecture != "Qwen2ForCausalLM":
      hf["attention_bias"] = self.qkv_bias
    if self.architecture == "LlamaForCausalLM":
      hf["mlp_bias"] = self.mlp_bias
    if self.rope_scaling is not None:
      hf["rope_scaling"] = {"rope_type": "llama3", **dict(self.rope_scaling)}
      hf["rope_scaling"]["original_max_position_embeddings"] = int(
          hf["rope_scaling"]["original_max_position_embeddings"])
    return hf
