"""The Adaptive Drafter: EAGLE-style one-layer drafter, its loss and training."""
