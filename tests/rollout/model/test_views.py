"""What the engine may run, and what applying a projection means right now (peft's math, read live)."""

from __future__ import annotations

import pytest
import torch

from slimrl.rollout.engine import RolloutEngine
from slimrl.rollout.model.reference import apply_linear
from slimrl.rollout.model.views import linear_spec, supports
from tests.rollout.helpers import build, with_lora


def test_unsupported_architectures_say_why():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    supported, why = supports(model)
    assert not supported and "gpt2" in why
    with pytest.raises(ValueError, match="gpt2"):
        RolloutEngine(model)
    assert supports(with_lora(build("qwen2"))) == (True, "")


@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16])
def test_lora_fast_path_equals_calling_the_peft_module(base_dtype):
    # peft keeps adapters in fp32 on a bf16 base (autocast_adapter_dtype): the fast path must do the same math
    model = with_lora(build("qwen2", dtype=base_dtype))
    module = model.base_model.model.model.layers[0].self_attn.q_proj
    spec = linear_spec(module)
    assert spec.module is None and len(spec.loras) == 1 and spec.loras[0][0].dtype == torch.float32
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).to(base_dtype)
    with torch.no_grad():
        assert torch.equal(apply_linear(x, spec), module(x))
        with model.disable_adapter():
            assert linear_spec(module).loras == ()
            assert torch.equal(apply_linear(x, linear_spec(module)), module(x))
