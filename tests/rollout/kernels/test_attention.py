"""Decode attention (`kernels.attention`) against SDPA with the additive mask, on CUDA and in Triton's interpreter; and
its reads of the cache through the address table."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slimrl.rollout.kernels.attention import (
    Prefix,
    SplitScratch,
    can_run,
    context_splits,
    decode_attention,
    launch_tiles,
)
from slimrl.rollout.kv_cache import StaticKVCache, table_entries
from tests.rollout.helpers import KERNEL_DEVICE
from tests.rollout.kernels.builders import DEVICE, DIM, HEADS, KV_HEADS, rand
from tests.tolerances import assert_close


def sdpa_reference(q, keys, values, starts, end, scale):
    """Plain attention of each row's query heads over its columns [start, end]."""
    batch, heads, dim = q.shape
    group = heads // keys.shape[1]
    columns = torch.arange(keys.shape[2], device=q.device)
    live = (columns[None, :] >= starts[:, None]) & (columns[None, :] <= end)
    mask = torch.zeros(live.shape, dtype=q.dtype, device=q.device).masked_fill_(~live, float("-inf"))
    k = keys.repeat_interleave(group, dim=1)
    v = values.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask[:, None, None], scale=scale)
    return out[:, :, 0]


@pytest.mark.parametrize("dtype, kind", [(torch.float32, "fp32_sum"), (torch.bfloat16, "bf16")])
@pytest.mark.parametrize("heads, kv_heads, dim", [(12, 2, 128), (4, 4, 64), (4, 2, 16), (4, 1, 256)])
def test_decode_attention_kernel_matches_masked_sdpa(dtype, kind, heads, kv_heads, dim):
    # with the launch settings the engine picks for the batch (Gemma 3's head_dim 256 among them: on an H100 its
    # tiles of 128 columns exceeded the shared memory at 64 rows)

    assert can_run(dim, dtype)
    g = torch.Generator(device=KERNEL_DEVICE).manual_seed(0)
    batch, length = (9, 300) if KERNEL_DEVICE == "cuda" else (3, 77)
    q = torch.randn(batch, heads, dim, generator=g, device=KERNEL_DEVICE).to(dtype)
    keys = torch.randn(batch, kv_heads, length, dim, generator=g, device=KERNEL_DEVICE).to(dtype)
    values = torch.randn(batch, kv_heads, length, dim, generator=g, device=KERNEL_DEVICE).to(dtype)
    starts = [0, 1, 63, 64, 65, 100, 200, 250, 250] if batch == 9 else [0, 13, 70]
    last = 250 if batch == 9 else 70
    starts, end = torch.tensor(starts, device=KERNEL_DEVICE), torch.tensor([last], device=KERNEL_DEVICE)
    got = decode_attention(q, keys, values, starts, end, dim**-0.5, **launch_tiles(batch, dtype, dim))
    assert_close(got.float(), sdpa_reference(q, keys, values, starts, last, dim**-0.5).float(), kind, name="attention")
    expected = {"block_s": 128, "num_warps": 8} if dtype == torch.bfloat16 and dim <= 128 else {}
    if dim == 256 and dtype == torch.float32:
        expected = {"block_s": 32}
    assert launch_tiles(batch, dtype, dim) == expected, "the tiles this batch was checked with"


def test_attention_kernel_reads_the_cache_through_the_table():
    g = torch.Generator(device=DEVICE).manual_seed(3)
    q = rand(g, 3, HEADS, DIM, dtype=torch.float32)
    cache = StaticKVCache(2, 3, KV_HEADS, 40, DIM, torch.float32, DEVICE)
    for t in (*cache.keys, *cache.values):
        t.copy_(rand(g, *t.shape, dtype=torch.float32))
    keys, values = cache.keys, cache.values
    anchor = torch.zeros(1, device=DEVICE)
    table = torch.tensor(table_entries(cache, anchor), device=DEVICE)
    starts, end = torch.tensor([0, 3, 20], device=DEVICE), torch.tensor([30], device=DEVICE)
    direct = decode_attention(q, keys[1], values[1], starts, end, DIM**-0.5)
    shape_only = torch.empty_like(keys[0])  # only its shape and strides are used
    via_table = decode_attention(q, shape_only, shape_only, starts, end, DIM**-0.5, 1, table, anchor)
    assert torch.equal(via_table, direct)


@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize("dtype, kind", [(torch.float32, "fp32_sum"), (torch.bfloat16, "bf16")])
def test_split_columns_merge_to_the_masked_sdpa_and_the_same_bits_every_launch(splits, dtype, kind):
    # rows whose columns fill every split, and rows starting so late that the first splits' runs are empty
    g = torch.Generator(device=KERNEL_DEVICE).manual_seed(11)
    batch, heads, kv_heads, dim, length = 4, 6, 2, 32, 200
    q = torch.randn(batch, heads, dim, generator=g, device=KERNEL_DEVICE).to(dtype)
    keys, values = (torch.randn(batch, kv_heads, length, dim, generator=g, device=KERNEL_DEVICE).to(dtype)
                    for _ in range(2))  # fmt: skip
    starts, end = torch.tensor([0, 31, 32, 180], device=KERNEL_DEVICE), torch.tensor([190], device=KERNEL_DEVICE)
    scratch = SplitScratch()
    got = decode_attention(q, keys, values, starts, end, dim**-0.5, block_s=32, splits=splits, scratch=scratch)
    assert_close(got.float(), sdpa_reference(q, keys, values, starts, 190, dim**-0.5).float(), kind,
                 name=f"attention over {splits} splits")  # fmt: skip
    counts = scratch.take(q.device, 1, 1, purpose="attention")[1]
    assert not counts.any(), "each tile's last program zeroes its count for the next launch"
    again = decode_attention(q, keys, values, starts, end, dim**-0.5, block_s=32, splits=splits, scratch=scratch)
    assert torch.equal(again, got), "the splits meet in split order, whichever finishes first"
    unsplit = decode_attention(q, keys, values, starts, end, dim**-0.5, block_s=32, splits=splits)
    assert_close(unsplit.float(), got.float(), kind, name="without a scratch: one program per row and kv head")


def test_context_splits_fill_the_gpu_with_runs_of_at_least_a_tile():
    cpu = torch.device("cpu")  # the interpreter takes an H100's 132 SMs
    assert context_splits(8, 2, 1536, cpu) == 8  # W3: 8 rows of a 2-kv-head model, 1,024 new tokens past the prompt
    assert context_splits(8, 2, 512, cpu) == 4  # a short cache: runs of at least 128 columns
    assert context_splits(16, 2, 4096, cpu) == 4  # within one program per SM
    assert context_splits(64, 2, 512, cpu) == 1  # 128 programs fill the GPU already (W2 at 64 rows)
    assert context_splits(1, 1, 1 << 20, cpu) == 32  # at most MAX_SPLITS


@pytest.mark.parametrize("dtype, kind", [(torch.float32, "fp32_sum"), (torch.bfloat16, "bf16")])
@pytest.mark.parametrize("via_table", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
def test_attention_kernel_with_a_prefix_matches_sdpa_over_the_gathered_rows(dtype, kind, via_table, splits):
    g = torch.Generator(device=KERNEL_DEVICE).manual_seed(5)
    batch, heads, kv_heads, dim, prefix_len, own = 6, 4, 2, 32, 64, 40
    cache = StaticKVCache(2, batch, kv_heads, own, dim, dtype, KERNEL_DEVICE, prefix_rows=3, prefix_len=prefix_len)
    for t in cache.tensors():
        t.copy_(torch.randn(t.shape, generator=g, device=KERNEL_DEVICE).to(dtype))
    q = torch.randn(batch, heads, dim, generator=g, device=KERNEL_DEVICE).to(dtype)
    source = torch.tensor([2, 2, 0, 1, 1, 0], device=KERNEL_DEVICE)
    # rows starting in the prefix's first tile, its second, and past it (a sliding window's start)
    starts = torch.tensor([0, 5, 33, 63, 64, 70], device=KERNEL_DEVICE)
    end = prefix_len + 30
    keys, values = cache.rows(1, source)
    expected = sdpa_reference(q, keys, values, starts, end, dim**-0.5)
    end = torch.tensor([end], device=KERNEL_DEVICE)
    prefix = Prefix(source, prefix_len, cache.prefix_keys[1], cache.prefix_values[1])
    if via_table:
        anchor = torch.zeros(1, dtype=dtype, device=KERNEL_DEVICE)
        table = torch.tensor(table_entries(cache, anchor), device=KERNEL_DEVICE)
        prefix = prefix._replace(table=torch.tensor(table_entries(cache, anchor, prefix=True), device=KERNEL_DEVICE))
        got = decode_attention(q, torch.empty_like(cache.keys[0]), torch.empty_like(cache.keys[0]), starts, end,
                               dim**-0.5, 1, table, anchor, block_s=32, prefix=prefix, splits=splits,
                               scratch=SplitScratch())  # fmt: skip
    else:
        got = decode_attention(q, cache.keys[1], cache.values[1], starts, end, dim**-0.5, block_s=32, prefix=prefix,
                               splits=splits, scratch=SplitScratch())  # fmt: skip
    assert_close(got.float(), expected.float(), kind, name="attention over the prefix and the rows' own columns")
    with pytest.raises(ValueError, match="multiple of block_s"):
        decode_attention(q, cache.keys[1], cache.values[1], starts, end, dim**-0.5, block_s=128, prefix=prefix)
