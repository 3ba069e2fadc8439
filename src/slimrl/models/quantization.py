"""bitsandbytes 4-bit (NF4, double quantisation) and 8-bit loading. The only module of slimrl that imports bitsandbytes.

bitsandbytes 0.50 runs both on the CPU as well as on CUDA (NF4 matmuls and LLM.int8() through its CPU backend), so the
quantised path is exercised by the CPU tests; on the CPU it is slow and meant for testing.
"""

from __future__ import annotations

import torch

INSTALL_HINT = "pip install 'slimrl[gpu]'  (or: pip install bitsandbytes)"


def require_bitsandbytes():
    """Import bitsandbytes, or fail with the install command: a quantised load never falls back to full precision."""
    try:
        import bitsandbytes
    except ImportError as error:
        raise ImportError(
            f"4-bit and 8-bit loading need bitsandbytes, which is not installed. Install it with: {INSTALL_HINT}. "
            "slimrl never falls back to a full-precision load silently."
        ) from error
    return bitsandbytes


def quantization_config(load_in_4bit: bool, load_in_8bit: bool, compute_dtype: torch.dtype):
    """transformers' BitsAndBytesConfig for the request, or None for a full-precision load.

    4-bit is NF4 with double quantisation (the quantisation constants are quantised too: about 0.4 bits per weight
    less); its matmuls run in `compute_dtype`, the dtype the rest of the model is loaded in.
    """
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


def is_quantized_model(model) -> bool:
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


def is_quantized_linear(module: torch.nn.Module) -> bool:
    """A bitsandbytes Linear4bit / Linear8bitLt (recognised by its weight class, without importing bitsandbytes)."""
    weight = getattr(module, "weight", None)
    return weight is not None and type(weight).__name__ in ("Params4bit", "Int8Params")


def keep_cpu_4bit_layout(model) -> None:
    """Keep bitsandbytes' 4-bit layers in their serialised layout on the CPU. On a CPU with AVX512-BF16, bitsandbytes
    (0.50) repacks a Linear4bit's weight at its first gradient-free forward in eval mode into a layout of its own bf16
    kernel, and packs it back when the state is saved, quantising the absmax constants again: the saved state then
    differs from the loaded one, and the layer computes in another precision than on a CPU without those
    instructions. slimrl's 4-bit CPU path is for tests, so it stays the same on every CPU."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def prepare_for_kbit_training(model) -> None:
    """What LoRA training on a 4/8-bit base needs, and nothing more.

    peft's `prepare_model_for_kbit_training` also casts every non-quantised parameter (embeddings, LM head, norms)
    to fp32. That doubles the largest tensors of a small model (a 151936 x 1536 embedding: +0.47 GB) for no gain:
    the base is frozen, so there is no fp32 master copy to keep, and LoRA's own weights are already fp32. Here the
    base is frozen and the embeddings' output made to require grad, so that checkpointed layers see a grad-requiring
    input and backpropagate into their LoRA weights.
    """
    for param in model.parameters():
        param.requires_grad_(False)
    enable_input_grads(model)


def enable_input_grads(model) -> None:
    """`enable_input_require_grads` once: each call registers another hook, and for_training runs every step."""
    if getattr(model, "_require_grads_hooks", None) or getattr(model, "_require_grads_hook", None) is not None:
        return
    model.enable_input_require_grads()


def dequantized_weight(module: torch.nn.Module) -> torch.Tensor:
    """The full-precision weight [out, in] (fp32, on the module's device) of a Linear, bitsandbytes layers included."""
    weight = module.weight
    kind = type(weight).__name__
    if kind == "Params4bit":
        bnb = require_bitsandbytes()
        return bnb.functional.dequantize_4bit(weight.data, weight.quant_state).float()
    if kind == "Int8Params" and weight.dtype == torch.int8:
        # LLM.int8() keeps one absmax scale per output row; it sits on the weight until the first forward moves it
        # to the layer's state
        scales = getattr(weight, "SCB", None)
        if scales is None:
            scales = getattr(getattr(module, "state", None), "SCB", None)
        if scales is None:
            raise RuntimeError(f"8-bit layer {module} has int8 weights but no row scales (SCB); cannot dequantise.")
        bnb = require_bitsandbytes()
        return bnb.functional.int8_vectorwise_dequant(weight.data, scales).float()
    return weight.detach().float()
