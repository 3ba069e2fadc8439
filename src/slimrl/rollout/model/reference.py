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


# -- Gemma 2 / Gemma 3 (the forward's pieces for their recipe, see features.py) ----------------------------------


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: normalise and scale by (1 + weight) both in fp32, then round to the input dtype (Llama
    rounds before scaling)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).type_as(x)


def gemma_add_rms_norm(hidden, delta, norm_weight, eps: float):
    hidden = hidden + delta
    return hidden, gemma_rms_norm(hidden, norm_weight, eps)


def gemma_qk_norm_rope(query, key, q_norm, k_norm, cos, sin):
    """Gemma 3's per-head q/k norms (Gemma's RMSNorm; Gemma 2 has none), then RoPE."""
    if q_norm is not None:
        query = gemma_rms_norm(query, q_norm.weight, q_norm.eps)
        key = gemma_rms_norm(key, k_norm.weight, k_norm.eps)
    return apply_rope(query, cos, sin), apply_rope(key, cos, sin)


def gelu_tanh_mul(gate, up):
    """GeGLU's product with the tanh-approximated GELU (transformers' "gelu_pytorch_tanh")."""
    return F.gelu(gate, approximate="tanh") * up


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap), in transformers' order of ops (Gemma 2's attention scores and final logits)."""
    return torch.tanh(x / cap) * cap


def softcapped_attention(q, k, v, mask, scale: float, cap: float) -> torch.Tensor:
    """Gemma 2's eager attention: the scores soft-capped before the mask and softmax (SDPA cannot do it).

    q [b, heads, P, D], k/v [b, kv_heads, S, D], mask additive [b, 1, P, S] or None (causal, P == S). Returns
    [b, heads, P, D]. Same ops and dtypes as transformers' `eager_attention_forward`."""
    group = q.shape[1] // k.shape[1]
    if group > 1:  # query head h reads kv head h // group
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = softcap(torch.matmul(q, k.transpose(2, 3)) * scale, cap)
    if mask is None:
        length = q.shape[2]
        future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu_(1)
        mask = torch.zeros(length, length, dtype=scores.dtype, device=q.device).masked_fill_(future, float("-inf"))
    scores = scores + mask
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def pieces_for(norm: str, activation: str) -> tuple:
    """(rms_norm, add_rms_norm, qk_norm_rope, gated activation) of a `features.Recipe`'s norm and activation: the
    forward's `GroupedOps` pieces for an architecture whose recipe is not Llama's."""
    norms = {"llama": (rms_norm, add_rms_norm, qk_norm_rope),
             "gemma": (gemma_rms_norm, gemma_add_rms_norm, gemma_qk_norm_rope)}  # fmt: skip
    activations = {"silu": silu_mul, "swish": silu_mul, "gelu_pytorch_tanh": gelu_tanh_mul}
    return (*norms[norm], activations[activation])


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


def prefill_mask(real: torch.Tensor, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """Additive mask [b, 1, P, P]: causal over real (non-pad) keys, and with a sliding window only the keys at
    (query - window, query], as transformers' sliding-window mask (left padding keeps a row's real tokens contiguous,
    so columns count as positions). A pad query also sees itself, so that no row is all -inf (which gives NaN rows,
    and 0 * NaN would reach real tokens through the cache)."""
    length = real.shape[1]
    index = torch.arange(length, device=real.device)
    causal = index[None, :] <= index[:, None]  # [P(query), P(key)]
    if window is not None:
        causal &= index[None, :] > index[:, None] - window
    allowed = (causal[None] & real[:, None, :]) | torch.eye(length, dtype=torch.bool, device=real.device)[None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=real.device)
    return mask.masked_fill_(~allowed, float("-inf"))[:, None]


def window_mask(mask: torch.Tensor, column: torch.Tensor, window: int) -> torch.Tensor:
    """A decode step's additive mask [B, 1, 1, S] (real columns so far, the new one included) cut to a sliding
    window: the query at `column` ([1] tensor, no host sync) sees only the columns (column - window, column]."""
    columns = torch.arange(mask.shape[-1], device=mask.device)
    return mask.masked_fill(columns <= column - window, float("-inf"))


def window_starts(starts: torch.Tensor, column: torch.Tensor, window: int) -> torch.Tensor:
    """The first column each row's query at `column` reads under a sliding window: its first real column, or
    column - window + 1 once the window has moved past it (the decode kernel reads [start, column])."""
    return torch.maximum(starts, column - (window - 1))


def live_columns_mask(starts: torch.Tensor, column: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, 1, length] of each row's live cache columns [starts[b], column] during a decode step
    (what the runner's own mask holds when it keeps one); no host sync."""
    columns = torch.arange(length, device=starts.device)
    live = (columns[None, :] >= starts[:, None]) & (columns[None, :] <= column)
    mask = torch.zeros(live.shape, dtype=dtype, device=starts.device)
    return mask.masked_fill_(~live, float("-inf"))[:, None, None]
