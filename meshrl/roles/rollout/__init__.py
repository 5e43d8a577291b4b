"""Rollout: feeds prompts, scores completions, computes advantages, paces itself on the trainer."""
