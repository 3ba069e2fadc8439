"""How a trainer reaches the rollout engine: backend choice, in-process and remote engine, async rollouts."""
