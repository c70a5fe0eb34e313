"""Reasoning RL: tasks, tokenizer, rewards and datasets; SFT, the GRPO/DAPO loss, the actor and the trainer."""
