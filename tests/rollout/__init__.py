"""Tests of the built-in rollout engine and its sampling."""
