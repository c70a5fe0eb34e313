"""tlt_jax: TLT (Taming the Long Tail) reasoning-RL rollouts with adaptive speculative decoding."""
