"""Builders the kernel tests share: random projection specs and a FusedDecode on chosen launch settings."""

from __future__ import annotations

import torch

from slimrl.rollout.model.views import LinearSpec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU the kernels run in Triton's interpreter
HEADS, KV_HEADS, DIM, HIDDEN, RANK = 4, 2, 32, 96, 8


def rand(g, *shape, dtype, std=1.0):
    return (torch.randn(*shape, generator=g, device=DEVICE) * std).to(dtype)


def make_spec(g, out_features, in_features, dtype, adapter_dtype, bias: bool, lora: bool, scale: float):
    weight = rand(g, out_features, in_features, dtype=dtype, std=in_features**-0.5)
    b = rand(g, out_features, dtype=dtype, std=0.1) if bias else None
    loras = ()
    if lora:
        lora_a = rand(g, RANK, in_features, dtype=adapter_dtype, std=in_features**-0.5)
        lora_b = rand(g, out_features, RANK, dtype=adapter_dtype, std=0.05)
        loras = ((lora_a, lora_b, scale),)
    return LinearSpec(None, weight, b, loras)


def fused_ops(gemm: bool, dtype, head_dim: int = DIM, ordered: bool = False):
    """A FusedDecode whose every group runs the Triton GEMM (gemm) or cuBLAS + epilogue, in K steps of 32; in a
    decode step (bound to a context with a scratch) each launch computes its own LoRA shrink in chunks of 64 input
    features (HIDDEN = 96: two, the last one partial). ordered: the deterministic engine's kernels."""
    from slimrl.rollout.fused_ops import FusedDecode, choices_for
    from slimrl.rollout.kernels.lora import GroupedLoRA

    choices, _ = choices_for(torch.device("cpu"))
    for choice in (c for buckets in choices.values() for c in buckets.values()):
        choice.gemm = gemm
        choice.block_k = 32  # HIDDEN = 96: three K steps, the last one partial for block_k 64
        choice.shrink_k = 64
    lora = GroupedLoRA(tf32=False, ordered=ordered)
    return FusedDecode(HEADS, KV_HEADS, head_dim, lora, tf32=False, ordered=ordered, choices=choices), lora


def bind_step(ops, rows: int, cache_len: int, column: int, dtype, scratch=None):
    """Bind `ops` to a decode step writing column `column` of a fresh one-layer cache of `rows` rows, read through its
    address table (as the engine's step does); returns the cache."""
    from slimrl.rollout.kv_cache import StaticKVCache, StepContext, table_entries

    cache = StaticKVCache(1, rows, KV_HEADS, cache_len, DIM, dtype, DEVICE)
    anchor = torch.zeros(1, dtype=dtype, device=DEVICE)
    table = torch.tensor(table_entries(cache, anchor), device=DEVICE)
    scratch = ops.new_scratch() if scratch is None else scratch
    ops.bind(StepContext(table, anchor, torch.tensor([column], device=DEVICE), cache_len, scratch))
    return cache


def separate_shrinks(choices: dict) -> dict:
    """choices with every decode launch taking its LoRA shrink from a `lora.shrink_` launch before it
    (`KernelChoice.shrink_k` 0), as before the projections computed their own."""
    for choice in (c for buckets in choices.values() for c in buckets.values()):
        choice.shrink_k = 0
    return choices
