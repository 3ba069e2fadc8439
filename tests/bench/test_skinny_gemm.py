"""bench/skinny_gemm.py's candidate kernel computes what it is timed for: x · Wᵀ (or SwiGLU of two), in either
orientation, with and without K splits, against fp32 matmuls (Triton's interpreter on the CPU, fp32 inputs: its
half-precision products are not exact)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "skinny_gemm.py"


def load():
    spec = importlib.util.spec_from_file_location("skinny_gemm", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("pair, split", [(False, 1), (False, 2), (True, 1)])
def test_candidate_kernel_matches_the_reference(swap, pair, split):
    bench = load()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(0)
    x, w, w2 = (torch.randn(*shape, generator=g, device=device) for shape in ((50, 256), (128, 256), (128, 256)))
    y = torch.zeros(50, 128, device=device)
    bench.candidate_fn(x, [w], [w2], [y], (False, swap, 64, 64, split, 2, 4), pair)()
    want = x @ w.t()
    if pair:
        want = torch.nn.functional.silu(want) * (x @ w2.t())
    torch.testing.assert_close(y, want, rtol=0, atol=2e-3 * float(want.abs().max()))  # (TF32 products on a GPU)
    assert bench.fits((False, swap, 64, 64, split, 4, 4), 64, 8960, 1536, pair)
    assert not bench.fits((False, False, 64, 64, 2, 4, 4), 64, 8960, 1536, True), "a split SwiGLU is not its product"
