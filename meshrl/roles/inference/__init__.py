"""Inference: generates completions for prompt rows, with the latest published weights."""
