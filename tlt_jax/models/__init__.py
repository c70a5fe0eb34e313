"""Target decoder family (Qwen2/2.5, R1-Distill-Qwen, Llama 3.x, Qwen3) and Hugging Face interop."""

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.transformer import CausalLM, KVCache, Output, decode, prefill, verify

__all__ = ["ModelConfig", "CausalLM", "KVCache", "Output", "prefill", "decode", "verify"]
