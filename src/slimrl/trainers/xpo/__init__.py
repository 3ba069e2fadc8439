"""XPO (slimrl's own trainer: online DPO with an exploration term)."""
