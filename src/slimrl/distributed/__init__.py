"""Beyond one GPU. `sharded.py`: the in-process engine over FSDP2- and ZeRO-3-sharded weights (gathered once per
rollout, freed after it; the fit check before training). The rollout device: an engine in its own process
(`rollout_server.py`), fed only the trainable tensors (the LoRA adapter) after each optimizer step by the trainer's
`RemoteRolloutEngine` (`remote_engine.py`), over a two-rank gloo channel (`transport.py`). `process_group.py`: the
launcher's process group destroyed at the end of an entry point (the demo, the scaling bench)."""
