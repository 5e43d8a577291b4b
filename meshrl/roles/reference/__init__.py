"""The reference service: log-probabilities of the sampled tokens under a frozen policy."""
