"""reward modelling."""
