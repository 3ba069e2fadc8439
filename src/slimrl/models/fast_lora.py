"""Fast LoRA: the training forward's LoRA projections and gated MLPs through slimrl's fused Functions, and back.

`enable_fast_lora(model)` gives the modules of supported decoder layers (Llama, Qwen2, Qwen3, Mistral) an instance
forward that runs
- the MLP (gate, up, down all LoRA) as `ops.lora_mlp.lora_mlp`: one Function, the gated product in a Triton kernel;
- each attention projection (q, k, v, o) and any LoRA projection of an MLP that cannot be fused as
  `ops.lora_linear.lora_linear`;
- the two RMSNorms through `ops.kernels.rms_norm` where the kernels run (CUDA, or Triton's interpreter).
`disable_fast_lora(model)` removes those forwards again. Nothing is kept between calls: each call reads the adapter,
scale and base weight from the peft layer, so chunked steps, MLP tiles and the offloaded checkpoints' recompute
(`ops.fused.mlp_forward` and `norm_forward` call a switched module's own forward) compute what a plain call does.

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
import types

import torch

from slimrl.models import quantization
from slimrl.ops import kernels
from slimrl.ops.fused import FUSED_FORWARD, fusable_norm
from slimrl.ops.lora_linear import LoRAProjection, lora_linear
from slimrl.ops.lora_mlp import lora_mlp

logger = logging.getLogger(__name__)

SUPPORTED_LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "MistralDecoderLayer")
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
ACTIVATIONS = {"SiLU": "silu", "SiLUActivation": "silu", "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh"}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def enable_fast_lora(model, norms: bool = True) -> int:
    """Switch the supported modules of `model` (a peft model, or the transformers model inside one) to the fused
    Functions; `norms=False` leaves the RMSNorms as they are. Returns how many modules were switched; calling it
    again switches only what is not yet switched."""
    switched = 0
    for name, layer in model.named_modules():
        if type(layer).__name__ not in SUPPORTED_LAYERS:
            if type(layer).__name__.endswith("DecoderLayer"):
                logger.debug("fast LoRA: %s (%s) keeps peft's forward: not a supported decoder layer (%s)", name,
                             type(layer).__name__, ", ".join(SUPPORTED_LAYERS))  # fmt: skip
            continue
        switched += _switch_layer(name, layer, norms)
    return switched


def disable_fast_lora(model) -> int:
    """Give every switched module its previous forward back; returns how many."""
    restored = 0
    for module in model.modules():
        if FUSED_FORWARD in vars(module):
            inner = vars(module).pop(FUSED_FORWARD)
            del module.forward
            if inner is not None:  # an instance forward that was there before ours
                module.forward = inner
            restored += 1
    return restored


def describe_fast_lora(model) -> dict[str, int]:
    """How many modules run which fused forward: {"mlp": n, "linear": n, "norm": n}."""
    counts = {"mlp": 0, "linear": 0, "norm": 0}
    for module in model.modules():
        forward = getattr(vars(module).get("forward"), "__func__", None)
        for kind, function in (("mlp", _fast_mlp_forward), ("linear", _fast_linear_forward),
                               ("norm", _fast_norm_forward)):  # fmt: skip
            counts[kind] += forward is function
    return counts


def is_fast_lora(model) -> bool:
    return any(FUSED_FORWARD in vars(module) for module in model.modules())


def _switch_layer(name: str, layer, norms: bool) -> int:
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
    return switched


def _install(module, forward) -> int:
    if FUSED_FORWARD in vars(module):
        return 0
    vars(module)[FUSED_FORWARD] = vars(module).get("forward")  # None: the class's own forward
    module.forward = types.MethodType(forward, module)
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
    found = [_projection(getattr(mlp, attr)) for attr in MLP_PROJECTIONS]
    if x.dtype not in DTYPES or any(isinstance(p, str) for p in found):
        return _previous_forward(mlp)(x)
    return lora_mlp(x, *found, activation=ACTIVATIONS[type(mlp.act_fn).__name__])


def _fast_linear_forward(layer, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """One LoRA projection through the fused Function; peft's forward for anything else (extra arguments such as
    peft's adapter_names, a disabled adapter)."""
    found = _projection(layer)
    if args or kwargs or x.dtype not in DTYPES or isinstance(found, str):
        return _previous_forward(layer)(x, *args, **kwargs)
    return lora_linear(x, found)


def _fast_norm_forward(norm, hidden_states: torch.Tensor) -> torch.Tensor:
    """RMSNorm through the Triton kernels where they run; the norm's own forward elsewhere."""
    if not kernels.runs_here(hidden_states):
        return _previous_forward(norm)(hidden_states)
    from slimrl.ops.kernels.rms_norm import rms_norm

    return rms_norm(hidden_states, norm.weight, norm.variance_epsilon)
