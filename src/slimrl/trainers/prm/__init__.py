"""PRM: a process reward model (slimrl's own trainer; TRL 1.16 has none)."""
