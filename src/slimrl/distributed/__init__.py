"""Beyond one GPU: the rollout device, an engine in its own process fed only the trainable tensors (the LoRA
adapter) after each optimizer step. (Gathering sharded FSDP2 / ZeRO-3 weights for the in-process engine is not built
yet; under sharded training the trainers generate through TRL's path.)"""
