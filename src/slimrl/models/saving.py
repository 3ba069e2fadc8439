"""Saving: the LoRA adapter (peft format) and a merged 16-bit model that transformers loads back.

Non-finite weights are never written (`NonFiniteError`). Nothing is written in place: each save goes to a temporary
sibling directory that replaces the target only once complete, so an interrupted save never leaves a half-written
model where a good one was. A non-empty target is
replaced only if it is an earlier slimrl save (it holds `slimrl_save.json`) or `overwrite=True` is passed.

The live training model is never modified: the merged weights W + scale * B @ A are computed layer by layer into a
new state dict on the CPU (a 4/8-bit base weight dequantised first), so the GPU holds one layer's fp32 weight at a
time on top of the model.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from slimrl.models.quantization import dequantized_weight, is_quantized_linear
from slimrl.models.unwrap import hf_model
from slimrl.ops.finite import NonFiniteError, nonfinite_tensors, refuse_nonfinite_weights

SAVE_METHODS = ("lora", "merged_16bit", "merged_32bit")
MARKER = "slimrl_save.json"  # marks a directory slimrl wrote, which a later save may replace
MERGED_DTYPES = {
    "float16": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32,
}  # fmt: skip


def _is_slimrl_save(path: Path) -> bool:
    return (path / MARKER).is_file()


def _check_target(target: Path, overwrite: bool, model) -> None:
    """Refuse targets whose replacement would destroy something that is not a model save."""
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{target} is a file; choose a directory path to save into.")
    resolved = target.resolve()
    cwd = Path.cwd().resolve()
    if resolved == Path(resolved.anchor) or resolved == Path.home().resolve() or resolved in (cwd, *cwd.parents):
        raise ValueError(f"Refusing to save into {target}: it is the filesystem root, the home directory or (a parent "
                         "of) the working directory. Choose a new directory.")  # fmt: skip
    source = getattr(getattr(hf_model(model), "config", None), "_name_or_path", None)
    if source and Path(source).is_dir() and Path(source).resolve() == resolved:
        raise ValueError(f"Refusing to save into {target}: the model was loaded from there. Choose a new directory.")
    if target.is_dir() and any(target.iterdir()) and not overwrite and not _is_slimrl_save(target):
        raise FileExistsError(f"{target} exists, is not empty and is not an earlier slimrl save; pass overwrite=True "
                              "to replace it or choose another path.")  # fmt: skip


@contextmanager
def _atomic_directory(path, overwrite: bool, model, marker: dict):
    """Yield a temporary sibling directory that becomes `path` (with the slimrl marker) once the body succeeds."""
    target = Path(path).expanduser()
    _check_target(target, overwrite, model)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.saving-", dir=target.parent))
    try:
        yield staging
        (staging / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if target.exists():
            backup = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            backup.rmdir()  # only its unique name is wanted: rename needs a free path
            target.rename(backup)
            staging.rename(target)
            shutil.rmtree(backup, ignore_errors=True)
        else:
            staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _marker(kind: str, dtype: torch.dtype | None = None) -> dict:
    from slimrl import __version__

    marker = {"saved_by": "slimrl", "slimrl_version": __version__, "kind": kind}
    if dtype is not None:
        marker["dtype"] = str(dtype).removeprefix("torch.")
    return marker


def save_lora(model, tokenizer, path, overwrite: bool = False) -> str:
    """The adapter in peft's format (adapter_config.json + adapter_model.safetensors) and the tokenizer.

    Load it back with `PeftModel.from_pretrained(base_model, path)`.
    """
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise ValueError("save_lora needs a model with a LoRA adapter (from FastLanguageModel.get_peft_model); "
                         "save a plain model with save_merged.")  # fmt: skip
    refuse_nonfinite_weights(model, f"the adapter to {path}", trainable_only=True)
    with _atomic_directory(path, overwrite, model, _marker("lora")) as staging:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    return str(path)


def merged_dtype(dtype: torch.dtype | str) -> torch.dtype:
    resolved = dtype if isinstance(dtype, torch.dtype) else MERGED_DTYPES.get(str(dtype).removeprefix("torch."))
    if resolved not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"A merged model is saved in float16, bfloat16 or float32, not {dtype!r}.")
    return resolved


def merged_state_dict(model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The base model's state dict with every LoRA delta merged in and quantised weights dequantised, on the CPU.

    Keys are the plain transformers model's: LoRA layers contribute `<name>.weight` (and bias), modules_to_save their
    trained copy, everything else its own parameters and persistent buffers.
    """
    merged: dict[str, torch.Tensor] = {}
    _collect(hf_model(model), "", dtype, merged)
    return merged


def _collect(module: torch.nn.Module, prefix: str, dtype: torch.dtype, out: dict) -> None:
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    if isinstance(module, LoraLayer):
        base_layer = module.get_base_layer()
        out[prefix + "weight"] = merged_lora_weight(module).to(dtype).cpu()
        if getattr(base_layer, "bias", None) is not None:
            out[prefix + "bias"] = base_layer.bias.detach().to(dtype).cpu()
        return
    if isinstance(module, ModulesToSaveWrapper):
        active = module.active_adapters[0] if module.active_adapters else None
        trained = module.modules_to_save[active] if active in module.modules_to_save else module.original_module
        _collect(trained, prefix, dtype, out)
        return
    if isinstance(module, AuxiliaryTrainingWrapper):
        raise NotImplementedError(f"Merging {type(module).__name__} ({prefix.rstrip('.')}) is not supported; save "
                                  "the adapter with save_lora instead.")  # fmt: skip
    for name, param in module.named_parameters(recurse=False):
        value = dequantized_weight(module) if name == "weight" and is_quantized_linear(module) else param.detach()
        out[prefix + name] = value.to(dtype).cpu()
    for name, buffer in module.named_buffers(recurse=False):
        if name not in module._non_persistent_buffers_set:
            out[prefix + name] = buffer.detach().cpu()
    for name, child in module.named_children():
        _collect(child, f"{prefix}{name}.", dtype, out)


def merged_lora_weight(layer) -> torch.Tensor:
    """W + sum over the active, not yet merged adapters of scaling * B @ A; fp32, on the layer's device."""
    weight = dequantized_weight(layer.get_base_layer())
    already_merged = set(getattr(layer, "merged_adapters", []))
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A and adapter not in getattr(layer, "lora_embedding_A", {}):
            continue
        if adapter in already_merged:
            continue  # peft's merge_adapter put it into the base weight already
        if getattr(layer, "use_dora", {}).get(adapter, False):
            raise NotImplementedError("Merging DoRA adapters is not supported; save the adapter with save_lora.")
        weight = weight + layer.get_delta_weight(adapter).float()
    return weight


def save_merged(model, tokenizer, path, dtype: torch.dtype | str = torch.float16, overwrite: bool = False) -> str:
    """A plain transformers checkpoint with the adapter merged in, loadable by AutoModelForCausalLM.from_pretrained.

    Works on a model without an adapter too (a 4/8-bit one is then saved dequantised).
    """
    from transformers import AutoModelForCausalLM

    dtype = merged_dtype(dtype)
    base = hf_model(model)
    config = base.config.__class__.from_dict(base.config.to_dict())
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = dtype
    state = merged_state_dict(model, dtype)
    bad = nonfinite_tensors(state)
    if bad:
        raise NonFiniteError(f"Refusing to save the merged model to {path}: these merged weights hold NaN or infinite "
                             f"values: {', '.join(bad)}. Resume from the last good checkpoint.")  # fmt: skip
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    result = plain.load_state_dict(state, strict=False, assign=True)
    missing = [name for name, p in plain.named_parameters() if p.is_meta]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"The merged state dict does not fit {type(plain).__name__}: missing {missing[:5]}, "
                           f"unexpected {result.unexpected_keys[:5]}. Please report this model architecture; "
                           "save_lora still works.")  # fmt: skip
    if getattr(config.get_text_config(), "tie_word_embeddings", False):
        plain.tie_weights()  # one tensor for the embedding and the LM head, as the config says
    if getattr(base, "generation_config", None) is not None:
        plain.generation_config = base.generation_config
    with _atomic_directory(path, overwrite, model, _marker("merged", dtype)) as staging:
        plain.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    return str(path)
