"""On-policy distillation."""
