"""The reward-model service: a scalar score per completion from a sequence-classification model."""
