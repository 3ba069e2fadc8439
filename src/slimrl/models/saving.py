"""Saving: the LoRA adapter (peft format) and a merged 16-bit model that transformers loads back.

Nothing is written in place: each save goes to a temporary sibling directory that replaces the target only once
complete, so an interrupted save never leaves a half-written model where a good one was. The live training model is
never modified: merged weights are computed into a new state dict (a 4-bit base is dequantised on the way).
"""

from __future__ import annotations

import shutil
import tempfile
import types
from contextlib import contextmanager
from pathlib import Path

import torch

from slimrl.models.quantization import dequantized_weight, is_quantized_linear

SAVE_METHODS = ("lora", "merged_16bit", "merged_32bit")


@contextmanager
def _atomic_directory(path, overwrite: bool):
    """Yield a temporary directory that becomes `path` on success; an existing non-empty `path` needs overwrite."""
    target = Path(path)
    if target.exists() and (not target.is_dir() or any(target.iterdir())) and not overwrite:
        raise FileExistsError(f"{target} exists and is not empty; pass overwrite=True or choose another path.")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.saving-", dir=target.parent))
    try:
        yield staging
        if target.exists():
            backup = target.with_name(f".{target.name}.old")
            shutil.rmtree(backup, ignore_errors=True)
            target.rename(backup)
            staging.rename(target)
            shutil.rmtree(backup, ignore_errors=True)
        else:
            staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def save_lora(model, tokenizer, path, overwrite: bool = False) -> str:
    """The adapter in peft's format (adapter_config.json + adapter_model.safetensors) and the tokenizer."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise ValueError("save_lora needs a model with a LoRA adapter (from FastLanguageModel.get_peft_model).")
    with _atomic_directory(path, overwrite) as staging:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    return str(path)


def merged_state_dict(model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The base model's state dict with every LoRA delta merged in and quantised weights dequantised, on the CPU."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    merged: dict[str, torch.Tensor] = {}
    lora_prefixes = []
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            lora_prefixes.append(name + ".")
            merged[f"{name}.weight"] = _merged_lora_weight(module).to(dtype).cpu()
            if module.get_base_layer().bias is not None:
                merged[f"{name}.bias"] = module.get_base_layer().bias.detach().to(dtype).cpu()
    for name, module in base.named_modules():
        if any(name.startswith(prefix) for prefix in lora_prefixes) or isinstance(module, LoraLayer):
            continue
        for param_name, param in module.named_parameters(recurse=False):
            key = f"{name}.{param_name}" if name else param_name
            value = dequantized_weight(module) if param_name == "weight" and is_quantized_linear(module) else param
            merged[key] = value.detach().to(dtype).cpu()
        for buffer_name, buffer in module.named_buffers(recurse=False):
            key = f"{name}.{buffer_name}" if name else buffer_name
            merged[key] = buffer.detach().cpu()
    return merged


def _merged_lora_weight(layer) -> torch.Tensor:
    """W + sum over active adapters of scaling * B @ A, in fp32."""
    base_layer = layer.get_base_layer()
    weight = dequantized_weight(base_layer)
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            continue
        if getattr(layer, "use_dora", {}).get(adapter, False):
            raise NotImplementedError("Merging DoRA adapters is not supported; save the adapter with save_lora.")
        a = layer.lora_A[adapter].weight.detach().float()  # [r, in]
        b = layer.lora_B[adapter].weight.detach().float()  # [out, r]
        delta = (b @ a) * layer.scaling[adapter]
        weight = weight + (delta.T if getattr(layer, "fan_in_fan_out", False) else delta)
    return weight


def save_merged(model, tokenizer, path, dtype: torch.dtype = torch.float16, overwrite: bool = False) -> str:
    """A plain transformers checkpoint with the adapter merged in, loadable by AutoModelForCausalLM."""
    from transformers import AutoModelForCausalLM

    base = model.get_base_model()
    config = base.config.__class__.from_dict(base.config.to_dict())
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = dtype
    state = merged_state_dict(model, dtype)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plain.load_state_dict(state, strict=False, assign=True)
    missing = [name for name, p in plain.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"merged checkpoint lacks {missing[:5]}...; please report this model architecture.")
    if plain.config.tie_word_embeddings:
        plain.tie_weights()
    if getattr(base, "generation_config", None) is not None:
        plain.generation_config = base.generation_config
    with _atomic_directory(path, overwrite) as staging:
        plain.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    return str(path)


def _save_pretrained_merged(self, path, tokenizer=None, save_method: str = "merged_16bit", overwrite: bool = False):
    """Unsloth-style convenience: save_method "lora", "merged_16bit" (fp16, or bf16 if trained in bf16) or
    "merged_32bit"."""
    if save_method not in SAVE_METHODS:
        raise ValueError(f"save_method must be one of {SAVE_METHODS}, got {save_method!r}.")
    if save_method == "lora":
        return save_lora(self, tokenizer, path, overwrite=overwrite)
    if save_method == "merged_32bit":
        dtype = torch.float32
    else:
        dtype = torch.bfloat16 if getattr(self, "dtype", None) == torch.bfloat16 else torch.float16
    return save_merged(self, tokenizer, path, dtype=dtype, overwrite=overwrite)


def attach_save_methods(model) -> None:
    model.save_pretrained_merged = types.MethodType(_save_pretrained_merged, model)
