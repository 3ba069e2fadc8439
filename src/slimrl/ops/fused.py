"""Element-wise pieces of a Llama-family layer, fused: the SwiGLU product and RMSNorm.

Each has a plain-PyTorch reference (the model's own formula) and a fast path with the same signature: the reference
compiled by torch.compile (inductor emits one Triton kernel for the forward and one for the backward, instead of a
chain of memory-bound kernels over [tokens, 8960] and fp32 [tokens, hidden] tensors). CPU runs the reference.

Tests run the fast path itself on the CPU (inductor's C++ backend compiles the same graph) by adding "cpu" to
`FAST_PATH_DEVICES` (`monkeypatch.setattr(fused, "FAST_PATH_DEVICES", ("cuda", "cpu"))`).

The fast path never stops a run. Each op meets several graphs (ranks: the model's [batch, seq, hidden], the tiled
MLP's [tokens, hidden]; a batch of 1; dtypes; grad on or off; frozen or trained weights), more than dynamo's default
recompile limit of 8, past which fullgraph=True raises: they may compile up to RECOMPILE_LIMIT graphs each, and when
torch.compile fails or runs out of graphs anyway, `Compiled` logs a warning once and runs the same math eagerly.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

# Inductor computes a fused chain of bf16 ops in fp32 and rounds only what it stores, unless told to round where
# eager PyTorch rounds: without this, silu(gate) * up and RMSNorm's `.to(dtype)` come out of the compiled kernel more
# precise than the model's own eager forward (about a quarter of bf16 outputs differ in the last bit), so the
# engine's log-probs drift from the training forward's. With it, compiled and eager agree bit for bit.
EAGER_ROUNDING = {"emulate_precision_casts": True}
RECOMPILE_LIMIT = 32  # graphs each fused op may compile (W5's SFT hit dynamo's default of 8 on an H100)
FAST_PATH_DEVICES = ("cuda",)  # device types whose tensors take the compiled path; the others run the reference
_compiled: dict[str, Compiled] = {}
# The attribute models/fast_lora.py sets on a module whose forward it switched to fused Functions (its value: the
# instance forward it replaced, or None): mlp_forward and norm_forward then call the module's own forward.
FUSED_FORWARD = "_slimrl_fused_forward"
logger = logging.getLogger(__name__)


class Compiled:
    """A torch.compile'd function; on a compile error (the recompile limit included) the eager function takes over
    for good, with one warning. Errors inside CUDA graph capture are raised: falling back there would record a
    different graph."""

    def __init__(self, fn, recompile_limit: int | None = None, **compile_kwargs):
        self.fn = fn
        self.compiled = torch.compile(fn, **{"options": EAGER_ROUNDING, **compile_kwargs})
        self.recompile_limit = recompile_limit  # None: dynamo's global setting
        self.failed = False

    def __call__(self, *args, **kwargs):
        if not self.failed:
            try:
                if self.recompile_limit is None:
                    return self.compiled(*args, **kwargs)
                with torch._dynamo.config.patch(recompile_limit=self.recompile_limit):
                    return self.compiled(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - any compiler failure falls back to the same math, eager
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise
                first_line = str(err).splitlines()[0] if str(err) else ""
                logger.warning("torch.compile failed for %s (%s: %s); running it eagerly from now on.",
                               self.fn.__name__, type(err).__name__, first_line)  # fmt: skip
                self.failed = True
        return self.fn(*args, **kwargs)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's product act(gate) * up with act = SiLU, as LlamaMLP computes it."""
    return F.silu(gate) * up


def rms_norm_reference(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: normalise in fp32, cast back, then scale by the weight."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return weight * (hidden_states * torch.rsqrt(variance + eps)).to(input_dtype)


def _fast(name: str, reference) -> Compiled:
    if name not in _compiled:
        _compiled[name] = Compiled(reference, recompile_limit=RECOMPILE_LIMIT, dynamic=True, fullgraph=True)
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
    if FUSED_FORWARD in vars(mlp):  # fast LoRA: the whole MLP is one fused Function
        return mlp(hidden_states)
    if fusable_mlp(mlp):
        return mlp.down_proj(silu_mul(mlp.gate_proj(hidden_states), mlp.up_proj(hidden_states)))
    return mlp(hidden_states)


def norm_forward(norm, hidden_states: torch.Tensor) -> torch.Tensor:
    if FUSED_FORWARD in vars(norm):  # fast LoRA's RMSNorm kernels
        return norm(hidden_states)
    if fusable_norm(norm):
        return rms_norm(hidden_states, norm.weight, norm.variance_epsilon)
    return norm(hidden_states)
