"""PPO (slimrl's own trainer) and its value model."""
