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


def fused_ops(gemm: bool, dtype, head_dim: int = DIM):
    """A FusedDecode whose every group runs the Triton GEMM (gemm) or cuBLAS + epilogue, in K steps of 32."""
    from slimrl.rollout.fused_ops import FusedDecode, choices_for
    from slimrl.rollout.kernels.lora import GroupedLoRA

    choices, _ = choices_for(torch.device("cpu"))
    for choice in (c for buckets in choices.values() for c in buckets.values()):
        choice.gemm = gemm
        choice.block_k = 32  # HIDDEN = 96: three K steps, the last one partial for block_k 64
    lora = GroupedLoRA(tf32=False)
    return FusedDecode(HEADS, KV_HEADS, head_dim, lora, tf32=False, choices=choices), lora
