"""The one place that unwraps a model: from what the user or a trainer holds to the transformers model inside."""

from __future__ import annotations

from torch import nn


def hf_model(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (its LoRA layers stay injected); any other model as it is."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers `*ForCausalLM` inside DDP, torch.compile and peft wrappers (LoRA layers stay injected)."""
    for _ in range(8):
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
            model = model.get_base_model()
        else:
            break
    return model
