"""Views of a live Llama-family model for the engine: which decoders it runs (`supports`), and what applying one
projection or norm means right now (`linear_spec`, `norm_spec`), read from the modules at call time so a LoRA
adapter updated by the optimizer is seen by the next rollout.

Projections come in two kinds:
- plain `nn.Linear`, and peft's LoRA `Linear` over a plain `nn.Linear` (vanilla LoRA, any number of active adapters):
  the engine applies `W x + b + sum(B (A x) * scale)` itself with the module's own tensors, in peft's order and dtypes
  (fp32 adapters on a bf16 base compute the update in fp32, as peft does). LoRA dropout is not applied: rollouts
  are inference, as in peft's eval mode.
- anything else (bitsandbytes `Linear4bit`/`Linear8bitLt`, LoRA over those, DoRA and other variants): the engine
  calls the module, which dequantises or applies its variant itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from slimrl.models.unwrap import unwrap_model

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
# RoPE types whose cos/sin depend on the position alone; "dynamic" and "longrope" also depend on the sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class LinearSpec(NamedTuple):
    """How to apply one projection right now: call `module`, or compute from the tensors."""

    module: nn.Module | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    loras: tuple  # ((A [r, in], B [out, r], scale), ...) for the active adapters


class NormSpec(NamedTuple):
    weight: torch.Tensor
    eps: float


def embed_tokens(module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The token embeddings of `ids`: a plain `nn.Embedding` is looked up from its weight, not called, so hooks on it
    (FSDP2's unshard/reshard, ZeRO-3's fetch/release, which would gather or free it mid-rollout) do not run; any
    other embedding module is called."""
    if isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward and module.max_norm is None:
        return torch.nn.functional.embedding(ids, module.weight)
    return module(ids)


def supports(model: nn.Module) -> tuple[bool, str]:
    """(True, "") when the engine can run `model`, else (False, why): the reason names what is missing."""
    try:
        check_supported(unwrap_model(model))
    except UnsupportedModel as err:
        return False, str(err)
    return True, ""


class UnsupportedModel(ValueError):
    """The model is not a Llama-family decoder this forward implements; the message says why."""


def check_supported(model: nn.Module) -> None:
    """Raise UnsupportedModel naming the first thing the engine's forward cannot run: the architecture and its
    settings, the placement of the weights, then each layer's modules."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(
            f"architecture {model_type!r} ({type(model).__name__}) is not one the rollout engine implements "
            f"({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    inner = getattr(model, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, name):
            raise UnsupportedModel(f"{type(model).__name__} has no model.{name}; not a standard decoder layout")
    if getattr(model, "lm_head", None) is None:
        raise UnsupportedModel(f"{type(model).__name__} has no lm_head")
    _check_settings(config, inner)
    _check_placement(model)
    for i, layer in enumerate(inner.layers):
        _check_layer(i, layer)


def _check_settings(config, inner: nn.Module) -> None:
    """The activation and the RoPE type."""
    act = getattr(config, "hidden_act", None)
    if act not in ("silu", "swish"):
        raise UnsupportedModel(f"hidden_act {act!r} is not supported (the engine implements silu)")
    rope_type = getattr(inner.rotary_emb, "rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedModel(
            f"rope type {rope_type!r} depends on the sequence length; supported: {', '.join(STATIC_ROPE_TYPES)}"
        )


def _check_placement(model: nn.Module) -> None:
    """All weights resident on one device."""
    device_map = getattr(model, "hf_device_map", None)
    if device_map and len({str(d) for d in device_map.values()}) > 1:
        raise UnsupportedModel("the model is spread over several devices (device_map); the engine needs one device")
    if any(p.device.type == "meta" for p in model.parameters()):
        raise UnsupportedModel("some weights are on the meta device (offloaded); the engine needs them resident")


def _check_layer(i: int, layer: nn.Module) -> None:
    """Layer i has the attention projections, the gated MLP and the RMSNorms `layer_modules` reads."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    if attn is None or mlp is None or not all(hasattr(attn, n) for n in names):
        raise UnsupportedModel(f"layer {i} lacks self_attn.q/k/v/o_proj or mlp")
    if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        raise UnsupportedModel(f"layer {i} has no gated MLP (gate_proj, up_proj, down_proj)")
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        if not (hasattr(norm, "weight") and hasattr(norm, "variance_epsilon")):
            raise UnsupportedModel(f"layer {i} has a norm that is not an RMSNorm ({type(norm).__name__})")


# -- live views of the model's tensors --------------------------------------------------------------------------


def _lora_linear_spec(module: nn.Module) -> LinearSpec | None:
    """The spec of a vanilla peft LoRA Linear over a plain nn.Linear, or None when the module must be called."""
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:  # peft is a dependency, but a model without adapters needs none of it
        return None
    if not isinstance(module, LoraLinear):
        return None
    base = module.base_layer
    if not is_plain_linear(base) or getattr(module, "fan_in_fan_out", False):
        return None
    if module.merged:
        # peft unmerges inside forward when adapters are disabled; let it
        return None if module.disable_adapters else LinearSpec(None, base.weight, base.bias, ())
    if module.disable_adapters:
        return LinearSpec(None, base.weight, base.bias, ())
    loras = []
    variants = getattr(module, "lora_variant", {}) or {}
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        lora_a, lora_b = module.lora_A[name], module.lora_B[name]
        if name in variants or not is_plain_linear(lora_a) or lora_b.bias is not None:
            return None
        loras.append((lora_a.weight, lora_b.weight, float(module.scaling[name])))
    return LinearSpec(None, base.weight, base.bias, tuple(loras))


def is_plain_linear(module: nn.Module) -> bool:
    """An `nn.Linear` whose forward is torch's own: nn.Linear itself, or the class FSDP2's `fully_shard` derives from
    it (whose hooks must not run mid-rollout); bitsandbytes' layers and other subclasses with their own forward are
    not."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def linear_spec(module: nn.Module) -> LinearSpec:
    """What applying `module` means at this moment (adapters enabled or not, merged or not, which are active)."""
    if is_plain_linear(module):
        return LinearSpec(None, module.weight, module.bias, ())
    spec = _lora_linear_spec(module)
    return spec if spec is not None else LinearSpec(module, None, None, ())


def norm_spec(module: nn.Module) -> NormSpec:
    return NormSpec(module.weight, float(module.variance_epsilon))


def layer_modules(layer: nn.Module) -> LayerModules:
    """The modules of one decoder layer that the engine's forward reads (checked by `_check_layer`)."""
    attn, mlp = layer.self_attn, layer.mlp
    return LayerModules(
        input_norm=layer.input_layernorm,
        q=attn.q_proj,
        k=attn.k_proj,
        v=attn.v_proj,
        o=attn.o_proj,
        q_norm=getattr(attn, "q_norm", None),
        k_norm=getattr(attn, "k_norm", None),
        post_norm=layer.post_attention_layernorm,
        gate=mlp.gate_proj,
        up=mlp.up_proj,
        down=mlp.down_proj,
    )


@dataclass
class LayerModules:
    input_norm: nn.Module
    q: nn.Module
    k: nn.Module
    v: nn.Module
    o: nn.Module
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    post_norm: nn.Module
    gate: nn.Module
    up: nn.Module
    down: nn.Module


def spec_identity(spec: LinearSpec):
    if spec.module is not None:
        return ("module", id(spec.module))
    bias = None if spec.bias is None else spec.bias.data_ptr()
    loras = tuple((a.data_ptr(), b.data_ptr(), a.dtype, b.dtype, scale) for a, b, scale in spec.loras)
    return (spec.weight.data_ptr(), spec.weight.dtype, bias, loras)

