"""tlt_jax: TLT (Taming the Long Tail) reasoning-RL rollouts with adaptive speculative decoding."""

import os

# transformers advises installing PyTorch on import; only the GGUF conversion and tests use it.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
