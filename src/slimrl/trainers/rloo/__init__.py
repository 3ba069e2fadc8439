"""RLOO."""
