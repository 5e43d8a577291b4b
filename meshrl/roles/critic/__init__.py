"""The critic service: per-token values for new samples, trained on the returns rollout computes."""
