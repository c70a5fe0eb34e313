"""The Adaptive Rollout Engine: device state (`state`) and pure steps (`steps`, `speculative`,
`sampling`, `suffix`), the engine (`engine`) and its host-side scheduling (`schedule`, `pages`), the
bandit, and the rollouts over device groups (`plain`, `tlt` with its group threads in `groups`)."""
