"""Fast LoRA: the training forward's LoRA projections and gated MLPs through slimrl's fused Functions, and back.

`enable_fast_lora(model)` gives the modules of supported decoder layers (Llama, Qwen2, Qwen3, Mistral) an instance
forward that runs
- the MLP (gate, up, down all LoRA) as `ops.lora_mlp.lora_mlp`: one Function, the gated product in a Triton kernel;
- the attention block's q, k and v projections together as `ops.lora_qkv.lora_qkv` (one Function, the rotary
  embedding applied in place inside it), o and any projection that cannot go there (a q/k/v of a block whose other
  projections keep peft's forward, any LoRA projection of an MLP that cannot be fused) as `ops.lora_linear.lora_linear`;
- the two RMSNorms through `ops.kernels.rms_norm` where the kernels run (CUDA, or Triton's interpreter);
- the attention block (Llama, Qwen2, Qwen3, Mistral) as transformers writes it, but with the rotary embedding of q
  and k in one Triton launch each way (inside `lora_qkv`, or `ops.rope.rope` after Qwen3's q/k norms; eager's bits)
  instead of eager's ten element-wise kernels.
  A call with a KV cache (generation) takes the model's own forward.
`disable_fast_lora(model)` removes those forwards again. Each call uses the adapter, scale and base weight the peft
layer holds then (what was found at an earlier call is reused only while the layer's state, modules, parameters, scale
and dropout are as they were: `_kept_projection`), so chunked steps, MLP tiles and the offloaded checkpoints'
recompute (`ops.fused.mlp_forward` and `norm_forward` call a switched module's own forward) compute what a plain call
does.

The fused path covers plain LoRA: one active adapter, lora_dropout 0, no DoRA or other variant, no LoRA bias, a frozen
base that is an nn.Linear or a bitsandbytes Linear4bit (dequantised inside the Function), in fp16, bf16 or fp32. A
module outside that keeps peft's forward, with the reason in a debug log; a switched module whose state changes
(peft's `disable_adapter()` for a reference pass, a merge, another adapter set active) takes peft's forward for
that call.

slimrl's trainers switch it on through their config's `fast_lora` (on by default for one process or DDP on CUDA;
trainers/common/chunked_trainer.py).
"""

from __future__ import annotations

import functools
import logging
import sys
import types
import weakref
from typing import NamedTuple

import torch

from slimrl.models import attention_store, quantization
from slimrl.models.recompute import registrations, watch_registrations
from slimrl.ops import kernels
from slimrl.ops.fused import FUSED_FORWARD, fusable_norm
from slimrl.ops.lora_linear import LoRAProjection, lora_linear, remembered
from slimrl.ops.lora_mlp import lora_mlp
from slimrl.ops.lora_qkv import lora_qkv
from slimrl.ops.rope import rope

logger = logging.getLogger(__name__)

SUPPORTED_LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "MistralDecoderLayer")
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
QKV = ATTENTION_PROJECTIONS[:3]
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
ACTIVATIONS = {"SiLU": "silu", "SiLUActivation": "silu", "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh"}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# attention modules whose forward `_fast_attention_forward` reproduces, and where each takes its sliding window from
# (None: it passes none; "module": self.sliding_window; "config": config.sliding_window)
SLIDING_WINDOW = {"LlamaAttention": None, "MistralAttention": "config", "Qwen2Attention": "module",
                  "Qwen3Attention": "module"}  # fmt: skip


_SWITCHES = [0]  # modules switched either way since import (`switches`)

# what `describe_fast_lora` counts: each kind's fused forward (defined below)
FORWARDS = {"mlp": "_fast_mlp_forward", "linear": "_fast_linear_forward", "norm": "_fast_norm_forward",
            "attention": "_fast_attention_forward"}  # fmt: skip


def enable_fast_lora(model, norms: bool = True, attention: bool = True) -> int:
    """Switch the supported modules of `model` (a peft model, or the transformers model inside one) to the fused
    Functions; `norms=False` leaves the RMSNorms as they are, `attention=False` the attention blocks (their rotary
    embedding). Returns how many modules were switched; calling it again switches only what is not yet switched."""
    switched = 0
    for name, layer in model.named_modules():
        if type(layer).__name__ not in SUPPORTED_LAYERS:
            if type(layer).__name__.endswith("DecoderLayer"):
                logger.debug("fast LoRA: %s (%s) keeps peft's forward: not a supported decoder layer (%s)", name,
                             type(layer).__name__, ", ".join(SUPPORTED_LAYERS))  # fmt: skip
            continue
        switched += _switch_layer(name, layer, norms, attention)
    return switched


def disable_fast_lora(model, kind: str | None = None) -> int:
    """Give every switched module (or only those of `kind`: "mlp", "linear", "norm", "attention", as
    `describe_fast_lora` names them) its previous forward back; returns how many."""
    if kind is not None and kind not in FORWARDS:
        raise ValueError(f"kind must be one of {', '.join(FORWARDS)} or None, got {kind!r}")
    restored = 0
    for module in model.modules():
        if FUSED_FORWARD not in vars(module) or (kind is not None and _kind_of(module) != kind):
            continue
        inner = vars(module).pop(FUSED_FORWARD)
        del module.forward
        if inner is not None:  # an instance forward that was there before ours
            module.forward = inner
        restored += 1
    _SWITCHES[0] += restored
    return restored


def switches() -> int:
    """Modules switched to or from the fused forwards since import: what a cache of a layer's behaviour (a captured
    CUDA graph, models/layer_graphs.py) compares to know the same code would run."""
    return _SWITCHES[0]


def describe_fast_lora(model) -> dict[str, int]:
    """How many modules run which fused forward: {"mlp": n, "linear": n, "norm": n, "attention": n}."""
    counts = dict.fromkeys(FORWARDS, 0)
    for module in model.modules():
        kind = _kind_of(module)
        if kind is not None:
            counts[kind] += 1
    return counts


def _kind_of(module) -> str | None:
    forward = getattr(vars(module).get("forward"), "__func__", None)
    return next((kind for kind, name in FORWARDS.items() if forward is globals()[name]), None)


def is_fast_lora(model) -> bool:
    return any(FUSED_FORWARD in vars(module) for module in model.modules())


def _switch_layer(name: str, layer, norms: bool, attention: bool) -> int:
    switched = 0
    mlp = getattr(layer, "mlp", None)
    reason = _mlp_reason(mlp)
    if reason is None:
        switched += _install(mlp, _fast_mlp_forward)
    else:
        logger.debug("fast LoRA: %s.mlp stays unfused: %s", name, reason)
    projections = [("self_attn", p) for p in ATTENTION_PROJECTIONS]
    if reason is not None:  # an MLP that cannot be fused whole may still have fusable LoRA projections
        projections += [("mlp", p) for p in MLP_PROJECTIONS]
    for parent, attr in projections:
        module = getattr(getattr(layer, parent, None), attr, None)
        found = _projection(module)
        if isinstance(found, str):
            logger.debug("fast LoRA: %s.%s.%s keeps peft's forward: %s", name, parent, attr, found)
        else:
            switched += _install(module, _fast_linear_forward)
    for attr in ("input_layernorm", "post_attention_layernorm") if norms else ():
        norm = getattr(layer, attr, None)
        if norm is not None and fusable_norm(norm) and not hasattr(norm, "_hf_hook"):
            switched += _install(norm, _fast_norm_forward)
    attn = getattr(layer, "self_attn", None)
    reason = _attention_reason(attn) if attention else None
    if attention and reason is None:
        switched += _install(attn, _fast_attention_forward)
    elif attention:
        logger.debug("fast LoRA: %s.self_attn keeps its forward: %s", name, reason)
    return switched


def _install(module, forward) -> int:
    if FUSED_FORWARD in vars(module):
        return 0
    vars(module)[FUSED_FORWARD] = vars(module).get("forward")  # None: the class's own forward
    module.forward = types.MethodType(forward, module)
    _SWITCHES[0] += 1
    return 1


def _previous_forward(module):
    return vars(module).get(FUSED_FORWARD) or functools.partial(type(module).forward, module)


def _projection(module) -> LoRAProjection | str:
    """The projection's LoRA as the fused ops take it, or why it cannot run fused now."""
    from peft.tuners.lora import LoraLayer

    if not isinstance(module, LoraLayer):
        return "not a peft LoRA layer"
    if hasattr(module, "_hf_hook"):
        return "it carries an accelerate hook (device placement) that the fused forward would skip"
    if module.disable_adapters or module.merged:
        return "adapters disabled or merged"
    active = [a for a in module.active_adapters if a in module.lora_A]
    if len(active) != 1:
        return f"{len(active)} active adapters (fused: exactly one)"
    adapter = active[0]
    dropout = module.lora_dropout[adapter]
    if not isinstance(dropout, torch.nn.Identity) and getattr(dropout, "p", 1.0) > 0:
        return "lora_dropout > 0"
    if adapter in getattr(module, "lora_variant", {}) or module.use_dora.get(adapter, False):
        return "a LoRA variant (DoRA or another)"
    if module.lora_bias.get(adapter, False) or getattr(module, "fan_in_fan_out", False):
        return "lora_bias or fan_in_fan_out"
    return _with_base(module, adapter)


def _current_projection(module) -> LoRAProjection | str:
    """`_projection(module)`, looked up once per layer pass of the offloaded checkpoints (`one_layer_pass`: the MLP's
    tiles ask again for each tile), and there and elsewhere taken from `_PROJECTIONS` while still current."""
    return remembered(("projection", id(module)), functools.partial(_kept_projection, module))


class _Kept(NamedTuple):
    """A fusable projection found by `_projection`, with what it was found under."""

    state: tuple  # `_peft_state(module)` then
    found: LoRAProjection
    base: torch.nn.Module
    lora_a: torch.nn.Module
    lora_b: torch.nn.Module
    adapter: str
    dropout_p: float | None


_PROJECTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # peft LoRA layer -> _Kept


def _peft_state(module) -> tuple:
    """What peft changes without registering a module or parameter (enable/disable, merges, the active adapter, an
    accelerate hook), with the count of registrations under the modules a kept projection watches."""
    active = module._active_adapter
    return (registrations(), module._disable_adapters, len(module.merged_adapters),
            active if isinstance(active, str) else tuple(active), "_hf_hook" in module.__dict__)  # fmt: skip


def _kept_projection(module) -> LoRAProjection | str:
    """`_projection(module)` without its checks (tens of microseconds, 7 times per decoder layer and pass) while nothing
    it read has changed: peft's state (`_peft_state`), a module or parameter registered under the layer, its base,
    its LoRA weights or dropout (a new adapter, a replaced weight), a parameter swapped through `_parameters`, the
    scale, the dropout's p, the base weight made trainable. A reason not to fuse is looked up again at every call."""
    kept, state = _PROJECTIONS.get(module), _peft_state(module)
    if kept is not None and kept.state == state:
        found = kept.found
        if (kept.base._parameters.get("weight") is found.weight and kept.base._parameters.get("bias") is found.bias
                and kept.lora_a._parameters.get("weight") is found.lora_a
                and kept.lora_b._parameters.get("weight") is found.lora_b and not found.weight.requires_grad
                and module.scaling.get(kept.adapter) == found.scale
                and getattr(module.lora_dropout[kept.adapter], "p", None) == kept.dropout_p):  # fmt: skip
            return found
    found = _projection(module)
    if isinstance(found, str):
        _PROJECTIONS.pop(module, None)
        return found
    (adapter,) = module.active_adapters
    parts = dict(base=module.get_base_layer(), lora_a=module.lora_A[adapter], lora_b=module.lora_B[adapter])
    watch_registrations([module, module.lora_A, module.lora_B, module.lora_dropout, *parts.values()])
    dropout_p = getattr(module.lora_dropout[adapter], "p", None)
    _PROJECTIONS[module] = _Kept(state, found, adapter=adapter, dropout_p=dropout_p, **parts)
    return found


def _with_base(module, adapter: str) -> LoRAProjection | str:
    base = module.get_base_layer()
    weight = base.weight
    kind = type(weight).__name__
    if kind == "Params4bit":
        dequantize = functools.partial(_dequantize_4bit, quantization.require_bitsandbytes())
    elif type(base) is torch.nn.Linear and weight.dtype in DTYPES:
        dequantize = None
    else:
        return f"base layer {type(base).__name__} with a {kind} weight of {weight.dtype} (fused: nn.Linear, Linear4bit)"
    if weight.requires_grad:
        return "the base weight is trainable (fused: frozen)"
    lora_a, lora_b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
    return LoRAProjection(weight, base.bias, lora_a, lora_b, module.scaling[adapter], dequantize)


def _dequantize_4bit(bnb, weight: torch.Tensor) -> torch.Tensor:
    return bnb.functional.dequantize_4bit(weight.data, weight.quant_state)


def _mlp_reason(mlp) -> str | None:
    """Why this MLP cannot be fused whole (None: it can, as its modules are now)."""
    if mlp is None or not all(hasattr(mlp, p) for p in MLP_PROJECTIONS):
        return "not a gated MLP (gate_proj, up_proj, down_proj)"
    act = type(getattr(mlp, "act_fn", None)).__name__
    if act not in ACTIVATIONS:
        return f"activation {act} (fused: {', '.join(ACTIVATIONS)})"
    if hasattr(mlp, "_hf_hook"):
        return "it carries an accelerate hook (device placement) that the fused forward would skip"
    for attr in MLP_PROJECTIONS:
        found = _projection(getattr(mlp, attr))
        if isinstance(found, str):
            return f"{attr}: {found}"
    return None


def _fast_mlp_forward(mlp, x: torch.Tensor) -> torch.Tensor:
    """The MLP as one fused LoRA Function, or its previous forward when its LoRA cannot run fused now."""
    found = [_current_projection(getattr(mlp, attr)) for attr in MLP_PROJECTIONS]
    if x.dtype not in DTYPES or any(isinstance(p, str) for p in found):
        return _previous_forward(mlp)(x)
    return lora_mlp(x, *found, activation=ACTIVATIONS[type(mlp.act_fn).__name__])


def _fast_linear_forward(layer, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """One LoRA projection through the fused Function; peft's forward for anything else (extra arguments such as
    peft's adapter_names, a disabled adapter)."""
    found = _current_projection(layer)
    if args or kwargs or x.dtype not in DTYPES or isinstance(found, str):
        return _previous_forward(layer)(x, *args, **kwargs)
    return lora_linear(x, found)


def _fast_norm_forward(norm, hidden_states: torch.Tensor) -> torch.Tensor:
    """RMSNorm through the Triton kernels where they run; the norm's own forward elsewhere."""
    if not kernels.runs_here(hidden_states):
        return _previous_forward(norm)(hidden_states)
    from slimrl.ops.kernels.rms_norm import rms_norm

    return rms_norm(hidden_states, norm.weight, norm.variance_epsilon)


def _rotated_qkv(attn, hidden_states: torch.Tensor, position_embeddings):
    """(query, key rotated, value) as [batch, tokens, heads, head_dim]: the three projections as one fused Function
    with the rotation in place (`ops.lora_qkv`) when all three run fused now, else each through its own forward; Qwen3's
    q/k norms go between the projections and the rotation."""
    normed = getattr(attn, "q_norm", None) is not None  # Qwen3: RMSNorm per head before the rotation
    found = _fused_qkv(attn, hidden_states)
    if found is not None:
        query, key, value = lora_qkv(hidden_states, *found, attn.head_dim, *(() if normed else position_embeddings))
    else:
        shape = (*hidden_states.shape[:-1], -1, attn.head_dim)
        query, key, value = (getattr(attn, name)(hidden_states).view(shape) for name in QKV)
    if normed:
        query, key = attn.q_norm(query), attn.k_norm(key)
    if normed or found is None:
        query, key = rope(query, key, *position_embeddings)
    return query, key, value


def _fused_qkv(attn, hidden_states: torch.Tensor) -> list[LoRAProjection] | None:
    """The q, k and v projections as `lora_qkv` takes them, when each is switched to the fused forward, has no forward
    hook that a direct call would skip, and can run fused now; else None."""
    if hidden_states.dtype not in DTYPES:
        return None
    found = []
    for name in QKV:
        module = getattr(attn, name)
        if FUSED_FORWARD not in vars(module) or module._forward_hooks or module._forward_pre_hooks:
            return None
        projection = _current_projection(module)
        if isinstance(projection, str):
            return None
        found.append(projection)
    return found


def _attention_reason(attn) -> str | None:
    """Why this attention block keeps its own forward (None: `_fast_attention_forward` reproduces it)."""
    kind = type(attn).__name__
    if kind not in SLIDING_WINDOW:
        return f"{kind} (reproduced: {', '.join(SLIDING_WINDOW)})"
    if hasattr(attn, "_hf_hook"):
        return "it carries an accelerate hook (device placement) that the fused forward would skip"
    missing = [a for a in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "attention_dropout")
               if not hasattr(attn, a)]  # fmt: skip
    if missing:
        return f"it lacks {', '.join(missing)} (another transformers version?)"
    if not hasattr(_attention_functions(), "get_interface"):
        return "this transformers has no ALL_ATTENTION_FUNCTIONS.get_interface"
    return None


def _attention_functions():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS


def _fast_attention_forward(attn, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, *args,
                            **kwargs):  # fmt: skip
    """The attention block as transformers' Llama/Qwen2/Qwen3/Mistral forward computes it (projections, Qwen3's
    q/k norms, rotary embedding, the configured attention function, o_proj), with `ops.rope.rope` for the rotary
    step; the block's own forward for a call with a KV cache or arguments it does not know."""
    cached = kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
    if args or cached or position_embeddings is None:
        return _previous_forward(attn)(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
    kwargs = {key: value for key, value in kwargs.items() if key not in ("cache", "past_key_values")}
    query, key, value = _rotated_qkv(attn, hidden_states, position_embeddings)
    where = SLIDING_WINDOW[type(attn).__name__]
    if where is not None:
        kwargs["sliding_window"] = attn.sliding_window if where == "module" else getattr(attn.config,
                                                                                          "sliding_window", None)
    eager = sys.modules[type(attn).__module__].eager_attention_forward
    interface = _attention_functions().get_interface(attn.config._attn_implementation, eager)
    call = interface if attn.config._attn_implementation == "eager" else functools.partial(attention_store.attention,
                                                                                             interface)  # fmt: skip
    out, weights = call(attn, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attention_mask,
                        dropout=0.0 if not attn.training else attn.attention_dropout, scaling=attn.scaling, **kwargs)
    out = out.reshape(*hidden_states.shape[:-1], -1).contiguous()
    return attn.o_proj(out), weights
