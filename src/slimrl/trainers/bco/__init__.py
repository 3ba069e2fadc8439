"""BCO (binary classifier optimisation): slimrl's own, TRL 1.16 having removed it."""
