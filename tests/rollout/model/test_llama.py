"""The engine's one decoder forward against transformers' own forward of the same model (fp32)."""

from __future__ import annotations

import pytest
import torch

from slimrl.rollout.kv_cache import StaticKVCache
from slimrl.rollout.model.llama import Decoder, prefill_attention
from tests.rollout.helpers import build, with_lora
from tests.tolerances import assert_close


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_forward_gives_transformers_logits_and_fills_the_cache(arch):
    model = with_lora(build(arch))
    decoder = Decoder(model)
    ids = torch.tensor([[5, 9, 11, 4, 7, 8, 13]])
    length = ids.shape[1]
    cache = StaticKVCache(decoder.num_layers, 1, decoder.kv_heads, 16, decoder.head_dim, decoder.dtype, "cpu")
    cos, sin = decoder.rope_tables(length)

    def attend(layer, q, k, v):
        return prefill_attention(decoder, cache, layer, slice(0, 1), q, k, v, None, 1, length)

    with torch.no_grad():
        ours = decoder.logits(decoder.forward(ids.reshape(-1), cos, sin, attend)).float()
        theirs = model(input_ids=ids).logits[0].float()
    assert_close(ours, theirs, "fp32_sum", name=f"{arch} logits")
    assert cache.keys[0][0, :, :length].abs().sum() > 0 and cache.keys[0][0, :, length:].abs().sum() == 0
