"""bitsandbytes 4-bit (NF4, double quantisation) and 8-bit loading. The only module that imports bitsandbytes."""

from __future__ import annotations

import torch

INSTALL_HINT = "pip install 'slimrl[gpu]'  (or: pip install bitsandbytes)"


def require_bitsandbytes():
    try:
        import bitsandbytes
    except ImportError as error:
        raise ImportError(
            f"4-bit and 8-bit loading need bitsandbytes, which is not installed. Install it with: {INSTALL_HINT}. "
            "slimrl never falls back to a full-precision load silently."
        ) from error
    return bitsandbytes


def quantization_config(load_in_4bit: bool, load_in_8bit: bool, compute_dtype: torch.dtype):
    """transformers' BitsAndBytesConfig for the request, or None for a full-precision load."""
    if load_in_4bit and load_in_8bit:
        raise ValueError("load_in_4bit and load_in_8bit are exclusive; choose one.")
    if not (load_in_4bit or load_in_8bit):
        return None
    require_bitsandbytes()
    from transformers import BitsAndBytesConfig

    if load_in_4bit:
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype,
        )
    return BitsAndBytesConfig(load_in_8bit=True)


def is_quantized_linear(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return weight is not None and type(weight).__name__ in ("Params4bit", "Int8Params")


def dequantized_weight(module: torch.nn.Module) -> torch.Tensor:
    """The full-precision weight [out, in] of a Linear, 4-bit and 8-bit bitsandbytes layers included."""
    weight = module.weight
    kind = type(weight).__name__
    if kind == "Params4bit":
        bnb = require_bitsandbytes()
        return bnb.functional.dequantize_4bit(weight.data, weight.quant_state).float()
    if kind == "Int8Params":
        if getattr(weight, "SCB", None) is not None and weight.dtype == torch.int8:
            return weight.data.float() * weight.SCB.float().unsqueeze(1) / 127.0
        return weight.data.float()
    return weight.detach().float()
