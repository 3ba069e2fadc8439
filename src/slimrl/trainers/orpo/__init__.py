"""ORPO."""
