"""The engine on a GPU: deterministic rollouts, and captured graphs kept across shapes that alternate."""

from __future__ import annotations

import pytest
import torch

from slimrl.rollout.engine import RolloutEngine
from slimrl.rollout.sampling import SamplingParams
from tests.rollout.test_engine import build, no_eos, with_lora

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the Triton kernels need CUDA")


def bf16_lora_model(layers: int = 2):
    model = with_lora(no_eos(build("qwen2", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=512, num_hidden_layers=layers)))  # fmt: skip
    return model.to("cuda", torch.bfloat16)


def prompts(count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(count)
    return [torch.randint(4, 250, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]  # fmt: skip


@pytest.mark.parametrize("rows", [8, 64])
def test_deterministic_engine_repeats_its_rollouts_bit_for_bit(rows):
    model = bf16_lora_model()
    engine = RolloutEngine(model, deterministic=True)
    params = SamplingParams(temperature=1.0, seed=5)
    batch = prompts(rows)
    first = engine.generate(batch, params, max_new_tokens=48)
    for _ in range(3):
        again = engine.generate(batch, params, max_new_tokens=48)
        assert again.completion_ids == first.completion_ids
        assert again.logprobs == first.logprobs
    fresh = RolloutEngine(model, deterministic=True).generate(batch, params, max_new_tokens=48)
    assert fresh.completion_ids == first.completion_ids and fresh.logprobs == first.logprobs


def test_alternating_shapes_replay_their_kept_graphs():
    model = bf16_lora_model()
    engine = RolloutEngine(model)
    params = SamplingParams(temperature=1.0, seed=1)
    batch = prompts(8)
    shapes = [20, 300, 20, 300, 20]  # cache lengths 128 and 384 after rounding
    captures = []
    for new_tokens in shapes:
        out = engine.generate(batch, params, max_new_tokens=new_tokens)
        engine.release()
        captures.append(out.stats.get("captures", 0))
    assert captures == [1, 1, 0, 0, 0], captures
