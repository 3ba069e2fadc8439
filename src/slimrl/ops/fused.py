"""Element-wise pieces of a Llama-family layer, fused: the SwiGLU product and RMSNorm.

Each has a plain-PyTorch reference (the model's own formula) and a fast path with the same signature: the reference
compiled by torch.compile (inductor emits one Triton kernel for the forward and one for the backward, instead of a
chain of memory-bound kernels over [tokens, 8960] and fp32 [tokens, hidden] tensors). CPU runs the reference.

Tests run the fast path itself on the CPU (inductor's C++ backend compiles the same graph) by adding "cpu" to
`FAST_PATH_DEVICES` (`monkeypatch.setattr(fused, "FAST_PATH_DEVICES", ("cuda", "cpu"))`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Inductor computes a fused chain of bf16 ops in fp32 and rounds only what it stores, unless told to round where
# eager PyTorch rounds: without this, silu(gate) * up and RMSNorm's `.to(dtype)` come out of the compiled kernel more
# precise than the model's own eager forward (about a quarter of bf16 outputs differ in the last bit), so the
# engine's log-probs drift from the training forward's. With it, compiled and eager agree bit for bit.
EAGER_ROUNDING = {"emulate_precision_casts": True}
FAST_PATH_DEVICES = ("cuda",)  # device types whose tensors take the compiled path; the others run the reference
_compiled: dict[str, object] = {}


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's product act(gate) * up with act = SiLU, as LlamaMLP computes it."""
    return F.silu(gate) * up


def rms_norm_reference(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: normalise in fp32, cast back, then scale by the weight."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return weight * (hidden_states * torch.rsqrt(variance + eps)).to(input_dtype)


def _fast(name: str, reference):
    if name not in _compiled:
        _compiled[name] = torch.compile(reference, dynamic=True, fullgraph=True, options=EAGER_ROUNDING)
    return _compiled[name]


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.device.type in FAST_PATH_DEVICES:
        return _fast("silu_mul", silu_mul_reference)(gate, up)
    return silu_mul_reference(gate, up)


def rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if hidden_states.device.type in FAST_PATH_DEVICES:
        return _fast("rms_norm", rms_norm_reference)(hidden_states, weight, eps)
    return rms_norm_reference(hidden_states, weight, eps)


def fusable_mlp(mlp) -> bool:
    """A gated MLP with SiLU (Llama, Qwen2/3, Mistral), whose forward is down(silu(gate(x)) * up(x))."""
    act = type(getattr(mlp, "act_fn", None)).__name__
    return all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")) and act in ("SiLU", "SiLUActivation")


def fusable_norm(norm) -> bool:
    return type(norm).__name__ in ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")


def mlp_forward(mlp, hidden_states: torch.Tensor) -> torch.Tensor:
    if fusable_mlp(mlp):
        return mlp.down_proj(silu_mul(mlp.gate_proj(hidden_states), mlp.up_proj(hidden_states)))
    return mlp(hidden_states)


def norm_forward(norm, hidden_states: torch.Tensor) -> torch.Tensor:
    if fusable_norm(norm):
        return rms_norm(hidden_states, norm.weight, norm.variance_epsilon)
    return norm(hidden_states)
