"""Which SDPA backends slimrl's training forward and backward may use, chosen deliberately.

cuDNN's SDPA backward returns NaN gradients when an explicit attention mask is passed, the sequence length is 64 mod
128 and some query row's logsumexp is below about -88.7 (a fully masked row from left padding, or a head with huge
negative logits even under an all-True mask). Seen with torch 2.11 + cuDNN 9.19 on an H100 and reported for torch 2.13
(pytorch/pytorch#196678; huggingface/trl#7181 for DPO/KTO). The forward is finite, so nothing warns: the optimizer
writes the NaN into the weights. A call without a mask tensor (`is_causal=True`) is clean, and there cuDNN's kernels
are the fastest on Hopper (20% faster than the alternatives at 16k tokens in W1), so only masked calls avoid it.

`training_attention()` spans slimrl's whole training step (forward, gradient-checkpoint recompute, backward): inside
it, every `torch.nn.functional.scaled_dot_product_attention` call that passes an `attn_mask` runs with cuDNN's backend
off (the memory-efficient one, clean at those shapes, takes it; the backward follows the backend the forward chose),
and calls without a mask run as torch would. The user's backend settings are restored after each call, and the
function after the step.

No fixed torch release is known, so the guard applies to every version. Its cost is measured in docs/benchmarks.md.
`SLIMRL_ALLOW_CUDNN_SDPA=1` leaves cuDNN's backend on (for a torch where the bug is fixed:
tests/ops/test_attention_backends.py checks the shapes that break it).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F

ALLOW_ENV = "SLIMRL_ALLOW_CUDNN_SDPA"


def cudnn_sdpa_avoided() -> bool:
    """Whether `training_attention` keeps masked SDPA calls off cuDNN (unless SLIMRL_ALLOW_CUDNN_SDPA=1)."""
    return os.environ.get(ALLOW_ENV) != "1"


def _without_cudnn_when_masked(sdpa):
    """`sdpa` with cuDNN's backend off for the duration of each call that passes an attention mask."""

    @functools.wraps(sdpa)
    def guarded(query, key, value, attn_mask=None, *args, **kwargs):
        if attn_mask is None or not torch.backends.cuda.cudnn_sdp_enabled():
            return sdpa(query, key, value, attn_mask, *args, **kwargs)
        torch.backends.cuda.enable_cudnn_sdp(False)
        try:
            return sdpa(query, key, value, attn_mask, *args, **kwargs)
        finally:
            torch.backends.cuda.enable_cudnn_sdp(True)

    guarded._slimrl_guarded = True
    return guarded


@contextlib.contextmanager
def training_attention() -> Iterator[None]:
    """Masked SDPA calls off cuDNN inside the block (see the module docstring); the function is restored on exit.

    The block must span the forward and the backward of the step: gradient checkpointing recomputes attention during
    the backward, on autograd's own thread, which calls the same function."""
    original = F.scaled_dot_product_attention
    if not cudnn_sdpa_avoided() or getattr(original, "_slimrl_guarded", False):
        yield
        return
    F.scaled_dot_product_attention = _without_cudnn_when_masked(original)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
