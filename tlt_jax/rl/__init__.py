"""Reasoning RL: procedural tasks, tokenizer, rewards and datasets (losses and loop to come)."""
