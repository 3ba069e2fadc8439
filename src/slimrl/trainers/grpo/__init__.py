"""GRPO."""
