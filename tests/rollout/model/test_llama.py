"""The engine's one decoder forward against transformers' own forward of the same model (fp32)."""

from __future__ import annotations

import pytest
import torch

from slimrl.rollout.model.llama import Decoder
from tests.rollout.helpers import build, prefill_logits, with_lora
from tests.tolerances import assert_close


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_forward_gives_transformers_logits_and_fills_the_cache(arch):
    model = with_lora(build(arch))
    decoder = Decoder(model)
    ids = torch.tensor([[5, 9, 11, 4, 7, 8, 13]])
    length = ids.shape[1]
    ours, cache = prefill_logits(decoder, ids)
    ours = ours.float()
    with torch.no_grad():
        theirs = model(input_ids=ids).logits[0].float()
    assert_close(ours, theirs, "fp32_sum", name=f"{arch} logits")
    assert cache.keys[0][0, :, :length].abs().sum() > 0 and cache.keys[0][0, :, length:].abs().sum() == 0
