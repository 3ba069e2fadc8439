"""The one tolerance table of the test suite, and a comparison that says where it failed."""

from __future__ import annotations

import torch

# name -> (rtol, atol). Anything looser than the fp32 default carries its reason.
TOLERANCES = {
    "fp32": (1e-5, 1e-6),  # the parity bar: same math, different summation order
    "exact": (0.0, 0.0),
    # the engine's own decoder (KV cache, one token at a time) against one full forward: fp32 sums in another order
    "engine_logprobs": (1e-4, 1e-4),
    # gradients divided by their tensor's largest magnitude: 1e-5 of that scale is the summation-order noise of
    # fp32 sums over a few hundred terms, which differ in order when the batch is chunked
    "grad_fp32": (1e-5, 1e-5),
    # fp32 sums of thousands of O(1) products taken in another order (split-K with atomic adds, online softmax):
    # absolute noise of a few 1e-6 where terms cancel
    "fp32_sum": (1e-5, 1e-5),
    "bf16": (1.6e-2, 1e-2),  # bf16 keeps 8 mantissa bits: one rounding step is 2**-8
    # a bf16 sum over a few dozen O(1) terms (RMSNorm's weight gradient over the tokens) whose terms were rounded at
    # different points: the absolute noise grows like sqrt(terms) * 2**-8
    "bf16_sum": (1.6e-2, 3e-2),
    "fp16": (2e-3, 1e-3),  # fp16 keeps 11 mantissa bits
    "nf4": (2e-2, 2e-3),  # NF4 dequantisation on CPU and a reference matmul round differently
    # a GGUF export reloaded by transformers against the live LoRA model: the weights are rounded once to the file's
    # type, then two layers of a tiny model (logits up to ~0.7, LoRA B ~ N(0, 0.02^2)) carry it to the logits; the
    # largest differences measured over Llama and Qwen2 with three seeds each are 4e-4, 3e-3 and 7.5e-3
    "gguf_f16": (2e-3, 2e-3),  # fp16 keeps 11 mantissa bits
    "gguf_bf16": (1.6e-2, 1e-2),  # bf16 keeps 8
    "gguf_q8_0": (3e-2, 2e-2),  # q8_0 stores each weight to 1/254 of the largest magnitude in its block of 32
}


def assert_close(actual, expected, kind: str = "fp32", name: str = "tensor") -> None:
    """torch.testing-style comparison with the table's tolerance; the message names the worst element."""
    rtol, atol = TOLERANCES[kind]
    actual = torch.as_tensor(actual).detach().double().cpu()
    expected = torch.as_tensor(expected).detach().double().cpu()
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    diff = (actual - expected).abs()
    bound = atol + rtol * expected.abs()
    bad = ~(diff <= bound) | (actual.isnan() != expected.isnan())
    bad &= ~(actual.isnan() & expected.isnan())
    if bad.any():
        worst = int(torch.argmax(torch.where(bad, diff - bound, torch.full_like(diff, -1.0)).nan_to_num(1e30)))
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), diff.shape)) if diff.dim() else ()
        raise AssertionError(
            f"{name} differs beyond {kind} tolerance (rtol={rtol}, atol={atol}) at {int(bad.sum())} of "
            f"{diff.numel()} elements; largest excess at {index}: actual {actual.flatten()[worst].item():.9g}, "
            f"expected {expected.flatten()[worst].item():.9g}, |diff| {diff.flatten()[worst].item():.3g}"
        )
