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
from slimrl.rollout.model.features import GEMMA_TYPES, SCALED_EMBEDDINGS, check_gemma_settings, is_gemma_norm
from slimrl.rollout.model.features import sandwich_norms as _gemma_norms
from slimrl.rollout.model.lengths import length_problem
from slimrl.rollout.model.moe import MOE_TYPES, is_sparse_block, sparse_problem

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", *GEMMA_TYPES, *MOE_TYPES)
# RoPE types whose cos/sin depend on the position alone; "dynamic" and "longrope" also depend on the sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SILU, GEMMA_ACTS = ("silu", "swish"), ("gelu_pytorch_tanh",)


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
    if type(module).__name__ in SCALED_EMBEDDINGS and module.max_norm is None:  # Gemma's forward: x * sqrt(hidden)
        return torch.nn.functional.embedding(ids, module.weight) * module.embed_scale.to(module.weight.dtype)
    return module(ids)


def supports(model: nn.Module, *, max_prompt_length: int | None = None, max_completion_length: int | None = None,
             max_seq_len: int | None = None) -> tuple[bool, str]:  # fmt: skip
    """(True, "") when the engine can run `model` for what the run will ask, else (False, why): the reason names what
    is missing and the fix. Given the longest prompt and/or `max_completion_length`, they must fit together in the
    cache the engine will allocate (max_seq_len, default the model's max_position_embeddings as `RolloutEngine`
    takes it); an unknown prompt length counts as one token. Everything refused here would otherwise fail (or be cut)
    at rollout time, mid-run."""
    causal_lm = unwrap_model(model)
    try:
        check_supported(causal_lm)
    except UnsupportedModel as err:
        return False, str(err)
    problem = length_problem(causal_lm, max_prompt_length, max_completion_length, max_seq_len)
    return (False, problem) if problem else (True, "")


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
    layer_windows(model)


def _check_settings(config, inner: nn.Module) -> None:
    """The activation and the RoPE type."""
    gemma = config.model_type in GEMMA_TYPES  # GeGLU with the tanh GELU (features.Recipe)
    act, acts = getattr(config, "hidden_activation" if gemma else "hidden_act", None), GEMMA_ACTS if gemma else SILU
    if act not in acts:
        raise UnsupportedModel(f"hidden_act {act!r} is not supported (the engine implements {acts[0]} here)")
    if gemma and (problem := check_gemma_settings(config)):
        raise UnsupportedModel(problem)
    rope_types = getattr(inner.rotary_emb, "rope_type", "default")
    for rope_type in rope_types.values() if isinstance(rope_types, dict) else (rope_types,):  # Gemma 3: per layer type
        if rope_type not in STATIC_ROPE_TYPES:
            raise UnsupportedModel(
                f"rope type {rope_type!r} depends on the sequence length; supported: {', '.join(STATIC_ROPE_TYPES)}"
            )
    rope = getattr(config, "rope_parameters", None)
    partial = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    if partial is not None and partial < 1:  # Phi-4-mini's 0.75, for one
        raise UnsupportedModel(f"partial rotary embeddings (partial_rotary_factor {partial}): the engine rotates "
                               "whole heads")  # fmt: skip


ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_windows(model: nn.Module) -> list[int | None]:
    """Each layer's sliding window (None: global attention), as transformers' masks apply it: a query at position p
    sees the keys at (p - window, p]. Qwen2/Qwen3/Gemma set `self_attn.sliding_window` per layer (from
    config.layer_types); Mistral, Phi-3 and Mixtral give every layer config.sliding_window. UnsupportedModel for a
    layer kind the engine does not implement (chunked, linear attention...) or a window that is not a positive int."""
    config, layers = model.config, model.model.layers
    kinds = getattr(config, "layer_types", None) or [None] * len(layers)
    windows = []
    for i, (layer, kind) in enumerate(zip(layers, kinds, strict=False)):
        if kind is not None and kind not in ATTENTION_LAYER_TYPES:
            raise UnsupportedModel(f"layer {i} is a {kind!r} layer; the engine implements "
                                   f"{' and '.join(ATTENTION_LAYER_TYPES)} layers")  # fmt: skip
        attn = layer.self_attn
        window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(config, "sliding_window", None)
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise UnsupportedModel(f"layer {i} has sliding window {window!r}; the engine needs a positive int or None")
        windows.append(window)
    return windows


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
    if attn is not None and hasattr(attn, "qkv_proj"):  # Phi-3: fused q/k/v and gate/up, read as row slices
        names, mlp_names = ("qkv_proj", "o_proj"), ("gate_up_proj", "down_proj")
        if mlp is not None and all(hasattr(mlp, n) for n in mlp_names):
            _check_fused_widths(i, attn, mlp)
    else:
        mlp_names = ("gate_proj", "up_proj", "down_proj")
    if mlp is not None and is_sparse_block(mlp):  # Qwen3-MoE / Mixtral: router and experts (moe.py)
        if problem := sparse_problem(mlp):
            raise UnsupportedModel(f"layer {i}: {problem}")
        mlp_names = ()
    if attn is None or mlp is None or not all(hasattr(attn, n) for n in names):
        raise UnsupportedModel(f"layer {i} lacks self_attn.{'/'.join(names)} or mlp")
    if not all(hasattr(mlp, n) for n in mlp_names):
        raise UnsupportedModel(f"layer {i} has no gated MLP ({', '.join(mlp_names)})")
    for norm in (layer.input_layernorm, layer.post_attention_layernorm, *_gemma_norms(layer)):
        if not (hasattr(norm, "weight") and (hasattr(norm, "variance_epsilon") or is_gemma_norm(norm))):
            raise UnsupportedModel(f"layer {i} has a norm that is not an RMSNorm ({type(norm).__name__})")


def _check_fused_widths(i: int, attn: nn.Module, mlp: nn.Module) -> None:
    """The fused projections' outputs split as Phi-3 splits them: q, k, v heads; gate and up halves."""
    widths = _qkv_widths(attn)
    if _out_features(attn.qkv_proj) != sum(widths):
        raise UnsupportedModel(f"layer {i}'s qkv_proj gives {_out_features(attn.qkv_proj)} outputs, not the "
                               f"{' + '.join(map(str, widths))} of its q, k and v heads")  # fmt: skip
    if _out_features(mlp.gate_up_proj) % 2:
        raise UnsupportedModel(f"layer {i}'s gate_up_proj has an odd output width; it must hold gate and up halves")


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
    if isinstance(module, FusedRows):
        return module.spec()
    if is_plain_linear(module):
        return LinearSpec(None, module.weight, module.bias, ())
    spec = _lora_linear_spec(module)
    return spec if spec is not None else LinearSpec(module, None, None, ())


def norm_spec(module: nn.Module) -> NormSpec:
    return NormSpec(module.weight, float(module.eps if is_gemma_norm(module) else module.variance_epsilon))


def layer_modules(layer: nn.Module) -> LayerModules:
    """The modules of one decoder layer that the engine's forward reads (checked by `_check_layer`)."""
    attn, mlp = layer.self_attn, layer.mlp
    if hasattr(attn, "qkv_proj"):
        return _fused_layer_modules(layer)
    if is_sparse_block(mlp):  # Qwen3-MoE / Mixtral: no dense projections; moe.sparse_spec reads `sparse`
        return LayerModules(layer.input_layernorm, attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                            getattr(attn, "q_norm", None), getattr(attn, "k_norm", None),
                            layer.post_attention_layernorm, None, None, None, sparse=mlp)  # fmt: skip
    modules = LayerModules(
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
    if _gemma_norms(layer):  # Gemma: post_attention_layernorm is on the attention output, pre_feedforward before MLP
        pre_mlp, modules.mlp_out_norm = _gemma_norms(layer)
        modules.attn_out_norm, modules.post_norm = modules.post_norm, pre_mlp
    return modules


def _fused_layer_modules(layer: nn.Module) -> LayerModules:
    """Phi-3's layer: q/k/v rows of qkv_proj, gate/up halves of gate_up_proj (gate first, as `Phi3MLP` chunks)."""
    attn, mlp = layer.self_attn, layer.mlp
    q, k, v = FusedRows.split(attn.qkv_proj, _qkv_widths(attn))
    half = _out_features(mlp.gate_up_proj) // 2
    gate, up = FusedRows.split(mlp.gate_up_proj, (half, half))
    return LayerModules(
        input_norm=layer.input_layernorm, q=q, k=k, v=v, o=attn.o_proj, q_norm=None, k_norm=None,
        post_norm=layer.post_attention_layernorm, gate=gate, up=up, down=mlp.down_proj,
    )


def _qkv_widths(attn: nn.Module) -> tuple[int, int, int]:
    heads, kv_heads = attn.config.num_attention_heads, attn.num_key_value_heads
    return heads * attn.head_dim, kv_heads * attn.head_dim, kv_heads * attn.head_dim


def _out_features(module: nn.Module) -> int:
    """Output width of a Linear, a peft LoRA layer or a bitsandbytes layer (each keeps `out_features`)."""
    width = getattr(module, "out_features", None)
    return width if width is not None else module.base_layer.out_features


class FusedRows:
    """Rows [start, stop) of a fused projection's output (Phi-3's qkv_proj, gate_up_proj), read live from the fused
    module. Its spec is row views of the fused weight, bias and LoRA B with LoRA A shared (peft puts one adapter on
    the fused Linear as a whole), so the forward and the kernels that take q/k/v or gate/up specs run on it
    unchanged, and an optimizer step on the adapter is seen by the next rollout. A fused module that must be called
    (bitsandbytes base, DoRA, a merged adapter switched off) is called once per input for all of its slices."""

    def __init__(self, fused: nn.Module, start: int, stop: int, call: _CallOnce):
        self.fused, self.start, self.stop, self._call = fused, start, stop, call

    @classmethod
    def split(cls, fused: nn.Module, widths) -> list[FusedRows]:
        call, bounds, start = _CallOnce(fused, len(widths)), [], 0
        for width in widths:
            bounds.append((start, start + width))
            start += width
        return [cls(fused, a, b, call) for a, b in bounds]

    def spec(self) -> LinearSpec:
        whole = linear_spec(self.fused)
        if whole.module is not None:
            return LinearSpec(self, None, None, ())
        rows = slice(self.start, self.stop)
        bias = None if whole.bias is None else whole.bias[rows]
        loras = tuple((lora_a, lora_b[rows], scale) for lora_a, lora_b, scale in whole.loras)
        return LinearSpec(None, whole.weight[rows], bias, loras)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._call.rows(x, self.start, self.stop)


class _CallOnce:
    """Calls a fused module once for the slices of one group: they are applied to the same input in turn (q, k, v),
    and the output is let go once each has taken its rows."""

    def __init__(self, module: nn.Module, parts: int):
        self.module, self.parts = module, parts
        self._input = self._output = None
        self._left = 0

    def rows(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        if self._input is not x:  # held until let go, so `is` cannot match a new tensor at a reused address
            self._input, self._output, self._left = x, self.module(x), self.parts
        out = self._output[..., start:stop].contiguous()
        self._left -= 1
        if self._left == 0:
            self._input = self._output = None
        return out


@dataclass
class LayerModules:
    input_norm: nn.Module
    q: nn.Module | FusedRows
    k: nn.Module | FusedRows
    v: nn.Module | FusedRows
    o: nn.Module
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    post_norm: nn.Module
    gate: nn.Module | FusedRows
    up: nn.Module | FusedRows
    down: nn.Module
    attn_out_norm: nn.Module | None = None  # sandwich norms (Gemma): on the attention / MLP output, before the add
    mlp_out_norm: nn.Module | None = None
    sparse: nn.Module | None = None  # a mixture-of-experts block (moe.py); gate, up and down are None then


def spec_identity(spec: LinearSpec):
    if spec.module is not None:
        return ("module", id(spec.module))
    bias = None if spec.bias is None else spec.bias.data_ptr()
    loras = tuple((a.data_ptr(), b.data_ptr(), a.dtype, b.dtype, scale) for a, b, scale in spec.loras)
    return (spec.weight.data_ptr(), spec.weight.dtype, bias, loras)

