"""The plain-PyTorch math of a Llama-family layer, as transformers and peft compute it: the reference every kernel of
the engine is tested against, and the engine's own eager path (on CPU, and where a kernel does not apply).

The math mirrors transformers' (`LlamaRMSNorm`, `apply_rotary_pos_emb`, position ids from the attention mask's
cumsum) and peft's `Linear.forward`, so that greedy decoding reproduces `model.generate` token for token in fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from slimrl.rollout.model.views import LinearSpec


def apply_linear(x: torch.Tensor, spec: LinearSpec) -> torch.Tensor:
    """`spec` applied to x [N, in]; for LoRA the same ops, order and dtypes as peft's `Linear.forward`."""
    if spec.module is not None:
        return spec.module(x)
    y = F.linear(x, spec.weight, spec.bias)
    if not spec.loras:
        return y
    out_dtype = y.dtype
    for lora_a, lora_b, scale in spec.loras:
        y = y + F.linear(F.linear(x.to(lora_a.dtype), lora_a), lora_b) * scale
    return y.to(out_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: normalise in fp32, round to the input dtype, then scale by the weight."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] rotated by cos/sin [N, D] of each token's position."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin


def add_rms_norm(hidden, delta, norm_weight, eps: float):
    """(hidden + delta, its RMSNorm): a residual add and the next norm, one kernel when compiled."""
    hidden = hidden + delta
    return hidden, rms_norm(hidden, norm_weight, eps)


def qk_norm_rope(query, key, q_norm, k_norm, cos, sin):
    """Qwen3's per-head q/k RMSNorm (when present), then RoPE. query [N, heads, D], key [N, kv_heads, D]."""
    if q_norm is not None:
        query = rms_norm(query, q_norm.weight, q_norm.eps)
        key = rms_norm(key, k_norm.weight, k_norm.eps)
    return apply_rope(query, cos, sin), apply_rope(key, cos, sin)


def silu_mul(gate, up):
    return F.silu(gate) * up


def add_lora_(x: torch.Tensor, items) -> None:
    """items: [(y [M, n], (A [r, K], B [n, r], scale))]; y += B(A(x)) * scale in place, as peft computes it."""
    for y, (lora_a, lora_b, scale) in items:
        y.copy_((y + F.linear(F.linear(x.to(lora_a.dtype), lora_a), lora_b) * scale).to(y.dtype))


class GroupedOps(NamedTuple):
    """The pieces of `Decoder.forward`: plain functions here; compiled ones and Triton LoRA on CUDA."""

    rms_norm: object
    add_rms_norm: object
    qk_norm_rope: object
    silu_mul: object
    add_lora: object  # add_lora(x, items), in place
    fused: object = None  # fused_ops.FusedDecode bound to a decode step, or None


EAGER_GROUPED = GroupedOps(rms_norm, add_rms_norm, qk_norm_rope, silu_mul, add_lora_)


def project(x: torch.Tensor, specs, add_lora) -> list[torch.Tensor]:
    """Apply projections that share the input x: base GEMMs, then one grouped LoRA update for all of them.

    Same values as `apply_linear` per spec (peft's math); several active adapters fall back to it, since peft keeps
    their running sum in the adapter dtype."""
    outs = [s.module(x) if s.module is not None else F.linear(x, s.weight, s.bias) for s in specs]
    single = [(y, s.loras[0]) for y, s in zip(outs, specs, strict=True) if s.module is None and len(s.loras) == 1]
    if single:
        add_lora(x, single)
    for i, s in enumerate(specs):
        if s.module is None and len(s.loras) > 1:
            outs[i] = apply_linear(x, s)
    return outs


def prefill_mask(real: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [b, 1, P, P]: causal over real (non-pad) keys. A pad query also sees itself, so that no row is
    all -inf (which gives NaN rows, and 0 * NaN would reach real tokens through the cache)."""
    length = real.shape[1]
    index = torch.arange(length, device=real.device)
    causal = index[None, :] <= index[:, None]  # [P(query), P(key)]
    allowed = (causal[None] & real[:, None, :]) | torch.eye(length, dtype=torch.bool, device=real.device)[None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=real.device)
    return mask.masked_fill_(~allowed, float("-inf"))[:, None]

