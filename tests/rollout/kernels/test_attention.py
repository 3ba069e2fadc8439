"""Decode attention (`kernels.attention`) against SDPA with the additive mask, on CUDA and in Triton's interpreter; and
its reads of the cache through the address table."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slimrl.rollout.kernels.attention import can_run, decode_attention, launch_tiles
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

