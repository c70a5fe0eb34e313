"""The Adaptive Rollout Engine: state and step functions, the engine loop with bucket compaction, the pool."""
