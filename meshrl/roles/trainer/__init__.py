"""Training: claims scored groups, updates the policy, publishes weights, opens the gate."""
