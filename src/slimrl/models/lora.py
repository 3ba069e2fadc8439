"""LoRA setup for `FastLanguageModel.get_peft_model`: which projections get adapters, the checks on what was asked,
and the seeded peft call. The base model's weights stay frozen; only the adapter (and `modules_to_save`) train."""

from __future__ import annotations

import logging

import torch

from slimrl.models import quantization

logger = logging.getLogger(__name__)

LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GRADIENT_CHECKPOINTING_CHOICES = (True, False, "offload")


def linear_layer_names(model) -> set[str]:
    """The distinct last name parts of the model's Linear layers (bitsandbytes ones included)."""
    names = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) or quantization.is_quantized_linear(module):
            names.add(name.rsplit(".", 1)[-1])
    return names


def find_lora_targets(model) -> list[str]:
    """The Llama-style projections (q, k, v, o, gate, up, down) among the model's actual Linear layers."""
    linear_names = linear_layer_names(model)
    targets = [name for name in LLAMA_PROJECTIONS if name in linear_names]
    if not targets:
        raise ValueError(
            f"No Llama-style projections ({', '.join(LLAMA_PROJECTIONS)}) in this model; its Linear layers are "
            f"named {sorted(linear_names)}. Pass target_modules=[...] to get_peft_model."
        )
    missing = [name for name in LLAMA_PROJECTIONS if name not in linear_names]
    if missing:
        logger.warning("slimrl: LoRA on %s; this model has no %s (its Linear layers: %s). Pass target_modules to "
                       "choose others.", targets, missing, sorted(linear_names))  # fmt: skip
    return targets


def check_lora_request(model, r: int, use_gradient_checkpointing: bool | str) -> bool | str:
    """Errors for what get_peft_model cannot do; returns the checkpointing mode ("unsloth" read as "offload")."""
    from peft import PeftModel

    if isinstance(model, PeftModel) or hasattr(model, "peft_config"):
        raise ValueError(
            "This model already has a LoRA adapter; call get_peft_model once, on the model from from_pretrained. "
            "To train an existing adapter, load it with peft's PeftModel.from_pretrained(model, path, "
            "is_trainable=True)."
        )
    if use_gradient_checkpointing == "unsloth":
        use_gradient_checkpointing = "offload"  # Unsloth's name for the same idea
    if use_gradient_checkpointing not in GRADIENT_CHECKPOINTING_CHOICES:
        raise ValueError(f"use_gradient_checkpointing must be True, False or 'offload', got "
                         f"{use_gradient_checkpointing!r}.")  # fmt: skip
    options = getattr(model, "slimrl_options", None)
    if options is not None and r > options.max_lora_rank:
        raise ValueError(f"r={r} exceeds max_lora_rank={options.max_lora_rank} given to from_pretrained; raise "
                         "max_lora_rank or lower r.")  # fmt: skip
    return use_gradient_checkpointing


def add_lora(model, *, r: int, target_modules, random_state: int, **lora_options):
    """peft's LoRA on `model` (targets: the Llama-style projections it has unless given), the base frozen (a 4/8-bit
    one prepared for k-bit training) and the adapter initialised from `random_state` with the global RNG left as it
    was. `lora_options` go to peft's LoraConfig."""
    from peft import LoraConfig, get_peft_model

    if quantization.is_quantized_model(model):
        quantization.prepare_for_kbit_training(model)
    else:
        for param in model.parameters():  # the base stays frozen; only the adapter (and modules_to_save) train
            param.requires_grad_(False)
    config = LoraConfig(
        r=r,
        target_modules=target_modules if target_modules is not None else find_lora_targets(model),
        task_type="CAUSAL_LM",
        **lora_options,
    )
    cuda_devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda_devices):
        torch.manual_seed(random_state)
        return get_peft_model(model, config)


def skip_input_casts_under_autocast(model) -> int:
    """Stop peft's LoRA layers from copying their input to the adapter's dtype when autocast will cast it back.

    With fp32 adapters on a bf16 base (peft's default), a LoRA layer first copies its input to fp32 and autocast then
    copies that back to bf16 for the adapter's matmul, which saves the copy for backward: one more activation per
    projection, alive through the layer's backward (per chunk, 0.8 GiB of W4's peak). When autocast is on and its
    dtype is the input's, the round trip returns the same values, so the layer can use its input as it is and the
    matmul saves the tensor the base layer already saved. peft's own 4-bit layers skip the cast under autocast the
    same way. Only plain LoRA without dropout is changed (dropout or a variant such as DoRA would compute on the
    copy); elsewhere, and whenever autocast is off, peft's cast runs. Returns the number of layers changed."""
    from peft.tuners.lora import LoraLayer

    changed = 0
    for module in model.modules():
        if not isinstance(module, LoraLayer) or "_cast_input_dtype" in vars(module):
            continue
        plain = not getattr(module, "lora_variant", {}) and not any(getattr(module, "use_dora", {}).values())
        if plain and all(isinstance(dropout, torch.nn.Identity) for dropout in module.lora_dropout.values()):
            module._cast_input_dtype = _cast_unless_autocast.__get__(module)  # an override on this instance only
            changed += 1
    return changed


def _cast_unless_autocast(layer, x, dtype: torch.dtype):
    # contract: peft's BaseTunerLayer._cast_input_dtype(x, dtype): x, or x in `dtype`
    if x is not None and x.is_floating_point():
        device = x.device.type
        if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == x.dtype:
            return x
    return type(layer)._cast_input_dtype(layer, x, dtype)
