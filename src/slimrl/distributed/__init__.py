"""Beyond one GPU: the rollout device (an engine in its own process, fed only the LoRA adapter) and the weight
gathering that lets the engine run on sharded (FSDP2, ZeRO-3) training."""
