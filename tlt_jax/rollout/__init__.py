"""The Adaptive Rollout Engine: sampling, the engine loop with bucket compaction, the executable pool."""
