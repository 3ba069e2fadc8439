"""The runner's compiled pieces (`options.compile`): the same bf16 numbers as the eager reference, bit for bit, so
that the engine's prefill and decode round where the training forward (the model's eager modules) rounds."""

import torch

from slimrl.rollout.model.reference import add_rms_norm, silu_mul
from slimrl.rollout.runner import Compiled


def test_compiled_pieces_round_bf16_as_the_eager_reference():
    # Inductor's default keeps fused bf16 chains in fp32: h + delta fed the norm unrounded and silu(gate) was not
    # rounded before the product, so about a quarter of these outputs differed in the last bit (measured on CPU).
    g = torch.Generator().manual_seed(0)
    hidden, delta = ((4 * torch.randn(16, 576, generator=g)).to(torch.bfloat16) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(576, generator=g)).to(torch.bfloat16)
    gate, up = ((3 * torch.randn(16, 1536, generator=g)).to(torch.bfloat16) for _ in range(2))
    compiled_norm, compiled_mul = Compiled(add_rms_norm), Compiled(silu_mul)
    for got, want in zip(compiled_norm(hidden, delta, weight, 1e-5), add_rms_norm(hidden, delta, weight, 1e-5),
                         strict=True):  # fmt: skip
        assert torch.equal(got, want)
    assert torch.equal(compiled_mul(gate, up), silu_mul(gate, up))
    assert not compiled_norm.failed and not compiled_mul.failed  # the compiled code ran, not the eager fallback
