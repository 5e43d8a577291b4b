"""The teacher service (on-policy distillation)."""
