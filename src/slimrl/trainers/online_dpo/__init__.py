"""online DPO."""
