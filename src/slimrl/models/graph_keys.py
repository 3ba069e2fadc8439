"""What a captured layer pass (models/layer_graphs.py) depends on beyond the memory it reads: the keys a replay is
looked up by. A replay runs the captured kernels on whatever the same addresses hold, so everything that would make
an eager pass run other kernels, or read other memory, must be in the key: the shapes, dtypes and strides of the
inputs, the keyword arguments' values where they are not tensors, which parameters the layer has and where they are,
peft's switches (an adapter disabled for a reference pass, a merge, another active adapter, a changed scale or
dropout), the layer's mode, and the process-wide switches the layer's code reads (autocast, the SDPA backends,
deterministic algorithms)."""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from slimrl.models.recompute import _walk

PLAIN = (type(None), bool, int, float, str)


def tensor_signature(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.shape), tensor.dtype, tensor.stride(), tensor.device


def kwargs_signature(kwargs: dict) -> tuple | None:
    """The layer's keyword arguments as a key: tensors (or tuples of them) by shape, dtype, strides and device, plain
    values by value; None when one is neither (a cache object), which a graph cannot stand for."""
    items = []
    for name in sorted(kwargs):
        value = kwargs[name]
        if torch.is_tensor(value):
            items.append((name, "tensor", tensor_signature(value)))
        elif isinstance(value, tuple | list) and value and all(torch.is_tensor(v) for v in value):
            items.append((name, "tensors", tuple(tensor_signature(v) for v in value)))
        elif isinstance(value, PLAIN):
            items.append((name, "value", value))
        else:
            return None
    return tuple(items)


_LORA_MODULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> (its _Walk, its peft LoRA modules)


def _lora_modules(layer: torch.nn.Module) -> tuple:
    walk = _walk(layer)
    known = _LORA_MODULES.get(layer)
    if known is None or known[0] is not walk:
        found = tuple(m for m in layer.modules() if hasattr(m, "_active_adapter") and hasattr(m, "scaling"))
        _LORA_MODULES[layer] = known = (walk, found)
    return known[1]


def _peft_module_state(module) -> tuple:
    active = module._active_adapter
    dropouts = tuple((name, getattr(d, "p", None)) for name, d in module.lora_dropout.items())
    return (module._disable_adapters, len(module.merged_adapters), active if isinstance(active, str) else tuple(active),
            tuple(sorted(module.scaling.items())), dropouts, "_hf_hook" in module.__dict__)  # fmt: skip


def layer_state(layer: torch.nn.Module) -> tuple:
    """What a captured pass of `layer` depends on beyond its inputs' shapes: its parameters (a module or parameter
    registered or replaced changes which they are), each one's address and requires_grad (a weight moved or frozen),
    peft's state of each LoRA module, the layer's mode and attention implementation."""
    params = tuple((id(param), param.data_ptr(), param.requires_grad) for _, _, param in _walk(layer).params)
    peft = tuple(_peft_module_state(m) for m in _lora_modules(layer))
    attention = getattr(getattr(getattr(layer, "self_attn", None), "config", None), "_attn_implementation", None)
    return params, peft, layer.training, attention


def global_state(device: torch.device) -> tuple:
    """Process-wide switches a captured pass would not see change: autocast, the SDPA backends (and slimrl's guard
    of masked calls), the deterministic flag, and modules switched to or from fast LoRA's forwards."""
    from slimrl.models.fast_lora import switches  # fast_lora imports recompute, as this module does

    backends = torch.backends.cuda
    return (torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type), backends.cudnn_sdp_enabled(),
            backends.flash_sdp_enabled(), backends.mem_efficient_sdp_enabled(), backends.math_sdp_enabled(),
            getattr(F.scaled_dot_product_attention, "_slimrl_guarded", False),
            torch.are_deterministic_algorithms_enabled(), switches())  # fmt: skip
