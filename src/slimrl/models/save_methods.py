"""Unsloth's save methods on a loaded model: `model.save_pretrained_merged(...)` (saving.py) and
`model.save_pretrained_gguf(...)` (gguf_export.py), bound by the loader to every model it returns."""

from __future__ import annotations

import types

import torch

from slimrl.models.gguf_export import save_pretrained_gguf
from slimrl.models.saving import SAVE_METHODS, save_lora, save_merged


def _save_pretrained_merged(
    self, save_directory, tokenizer=None, save_method: str = "merged_16bit", overwrite: bool = False,
    push_to_hub: bool = False,
) -> str:  # fmt: skip
    """Unsloth's `model.save_pretrained_merged(path, tokenizer, save_method=...)`.

    save_method: "lora" (the adapter), "merged_16bit" (bf16 if the model was loaded in bf16, else fp16) or
    "merged_32bit".
    """
    if push_to_hub:
        raise NotImplementedError("slimrl works offline and does not push to the hub; upload the saved directory "
                                  "with huggingface_hub.upload_folder where there is network.")  # fmt: skip
    if save_method not in SAVE_METHODS:
        raise ValueError(f"save_method must be one of {SAVE_METHODS}, got {save_method!r}.")
    if save_method == "lora":
        return save_lora(self, tokenizer, save_directory, overwrite=overwrite)
    if save_method == "merged_32bit":
        dtype = torch.float32
    else:
        options = getattr(self, "slimrl_options", None)
        loaded = getattr(options, "dtype", None) or getattr(self, "dtype", None)
        dtype = torch.bfloat16 if loaded == torch.bfloat16 else torch.float16
    return save_merged(self, tokenizer, save_directory, dtype=dtype, overwrite=overwrite)


def _save_pretrained_gguf(
    self, save_directory, tokenizer=None, quantization_method: str | list[str] = "q8_0", overwrite: bool = False,
    push_to_hub: bool = False,
) -> str | list[str]:  # fmt: skip
    """Unsloth's `model.save_pretrained_gguf(path, tokenizer, quantization_method=...)`; see gguf_export.py."""
    return save_pretrained_gguf(self, save_directory, tokenizer, quantization_method=quantization_method,
                                overwrite=overwrite, push_to_hub=push_to_hub)  # fmt: skip


def attach_save_methods(model) -> None:
    """Give the model Unsloth's `save_pretrained_merged` and `save_pretrained_gguf` methods, bound to the model."""
    model.save_pretrained_merged = types.MethodType(_save_pretrained_merged, model)
    model.save_pretrained_gguf = types.MethodType(_save_pretrained_gguf, model)
