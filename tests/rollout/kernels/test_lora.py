"""The grouped LoRA kernels (`kernels.lora`) against peft's math (`model.reference.add_lora_`), on CUDA and in Triton's
interpreter at odd shapes (rows and ranks that do not fill a tile, partial K steps)."""

from __future__ import annotations

import pytest
import torch

from slimrl.rollout.kernels.lora import GroupedLoRA, can_fuse, lora_group_
from slimrl.rollout.model.reference import add_lora_
from tests.rollout.helpers import KERNEL_DEVICE
from tests.tolerances import TOLERANCES, assert_close

CUDA = KERNEL_DEVICE == "cuda"
# (features, rank, output widths): W1's q/k/v, gate/up and down groups on CUDA; odd small ones in the interpreter
SHAPES = ([(1536, 64, [1536, 256, 256]), (200, 8, [8960, 8960]), (8960, 16, [1536])] if CUDA else
          [(100, 8, [48, 16, 16]), (70, 4, [130, 130]), (260, 16, [24])])  # fmt: skip


def make_group(rows, features, rank, widths, out_dtype, adapter_dtype, seed=0):
    g = torch.Generator(device=KERNEL_DEVICE).manual_seed(seed)

    def rand(*shape, dtype, std=1.0):
        return (torch.randn(*shape, generator=g, device=KERNEL_DEVICE) * std).to(dtype)

    x = rand(rows, features, dtype=out_dtype)
    items = []
    for i, width in enumerate(widths):
        y = rand(rows, width, dtype=out_dtype)
        lora_a = rand(rank, features, dtype=adapter_dtype, std=features**-0.5)
        # LoRA-sized updates (|delta| well below |y|): with deltas of ~6, one bf16 ulp of the delta (0.03) or TF32
        # noise would exceed the bf16 tolerance on outputs that cancel to ~0.2, whatever the kernel
        lora_b = rand(width, rank, dtype=adapter_dtype, std=0.05)
        items.append((y, (lora_a, lora_b, 0.5 + i)))
    return x, items


@pytest.mark.parametrize("rows", [1, 64, 300] if CUDA else [1, 37, 300])  # 300: a prefill's 128-row tiles
@pytest.mark.parametrize(
    "out_dtype, adapter_dtype, tf32, kind",
    [
        (torch.float32, torch.float32, False, "fp32_sum"),  # an fp32 model: fp32 math, only summation order differs
        (torch.bfloat16, torch.float32, False, "bf16"),  # peft's default: fp32 adapters on a bf16 model
        (torch.bfloat16, torch.float32, True, "bf16"),
        (torch.bfloat16, torch.bfloat16, False, "bf16"),
    ],
)
def test_grouped_lora_kernels_match_peft_math(rows, out_dtype, adapter_dtype, tf32, kind):

    for features, rank, widths in SHAPES:
        x, items = make_group(rows, features, rank, widths, out_dtype, adapter_dtype)
        before = [y.clone() for y, _ in items]
        expected = [(y.clone(), lora) for y, lora in items]
        # the reference sums in fp32 (cuBLAS may otherwise reduce bf16 products in bf16, less exactly than the kernel)
        reduced = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        try:
            add_lora_(x, expected)
        finally:
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
        assert can_fuse(x, items)
        lora_group_(x, items, tf32=tf32)
        for i, ((got, _), (want, _)) in enumerate(zip(items, expected, strict=True)):
            name = f"output {i} ({features}x{rank}, {rows} rows)"
            if adapter_dtype == torch.float32:
                assert_close(got.float(), want.float(), kind, name=name)
                continue
            # bf16 adapters round lora_A(x) to bf16. The kernel's fp32 sum before that rounding is exact to ~1e-7;
            # cuBLAS's differs in the last bits, so a near-tie element can round the other way (seen on the H100:
            # one element of 76,800), and that step travels through B, the scale and two more bf16 roundings.
            # Bound: three bf16 steps of the largest of output, update and result, plus the bf16 atol.
            delta = (want.float() - before[i].float()).abs()
            largest = torch.maximum(torch.maximum(before[i].float().abs(), delta), want.float().abs())
            bound = 3 * 2**-8 * largest + TOLERANCES["bf16"][1]
            excess = float(((got.float() - want.float()).abs() - bound).max())
            assert excess <= 0, f"{name}: off by more than three bf16 steps of its largest term (excess {excess:.3g})"


def test_grouped_lora_shares_one_workspace_and_falls_back_where_it_cannot_fuse():

    x, items = make_group(4, 64, 8, [32, 32, 32, 32], torch.float32, torch.float32)  # four: two launches
    lora_a, lora_b, _ = items[0][1]
    odd = [(items[0][0].clone(), (lora_a, lora_b.t().contiguous().t(), 1.0))]  # B not contiguous
    assert not can_fuse(x, odd)
    expected = [(y.clone(), lora) for y, lora in items + odd]
    add_lora_(x, expected)
    add_lora = GroupedLoRA(tf32=False)
    add_lora.begin(rows=4, calls=2, rank=8, device=x.device)
    add_lora(x, items + odd)
    for (got, _), (want, _) in zip(items + odd, expected, strict=True):
        assert_close(got, want, "fp32_sum", name="output")
