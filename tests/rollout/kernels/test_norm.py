"""The residual add + RMSNorm kernel against the eager norm."""

from __future__ import annotations

import pytest
import torch

from slimrl.rollout.model.reference import add_rms_norm, rms_norm
from tests.rollout.kernels.builders import DEVICE, HIDDEN, rand
from tests.tolerances import assert_close


@pytest.mark.parametrize(
    "dtype, weight_dtype, kind",
    [(torch.float32, torch.float32, "fp32_sum"), (torch.bfloat16, torch.bfloat16, "bf16"),
     (torch.bfloat16, torch.float32, "bf16")],
)  # fmt: skip
@pytest.mark.parametrize("add", [True, False])
def test_add_rms_norm_kernel_matches_the_eager_norm(dtype, weight_dtype, kind, add):
    from slimrl.rollout.kernels import norm

    g = torch.Generator(device=DEVICE).manual_seed(4)
    hidden = rand(g, 5, HIDDEN, dtype=dtype, std=3.0)
    delta = rand(g, 5, HIDDEN, dtype=dtype) if add else None
    weight = (1.0 + rand(g, HIDDEN, dtype=torch.float32, std=0.2)).to(weight_dtype)
    before = hidden.clone()
    got_hidden, got = norm.add_rms_norm(hidden, delta, weight, 1e-5)
    if add:
        want_hidden, want = add_rms_norm(hidden, delta, weight, 1e-5)
    else:
        want_hidden, want = hidden, rms_norm(hidden, weight, 1e-5)
    assert torch.equal(hidden, before), "the input hidden state was changed"
    assert torch.equal(got_hidden, want_hidden)  # one rounding of an fp32 sum, as eager
    assert got.dtype == want.dtype
    assert_close(got.float(), want.float(), kind, name="normed")

