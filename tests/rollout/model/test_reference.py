"""The plain-PyTorch pieces: grouped projections give each projection's own result."""

from __future__ import annotations

import torch

from slimrl.rollout.model.reference import add_lora_, apply_linear, project, rms_norm
from slimrl.rollout.model.views import linear_spec
from tests.rollout.helpers import build, with_lora


def test_project_applies_each_spec_as_apply_linear():
    model = with_lora(build("qwen2")).eval()
    attn = model.base_model.model.model.layers[0].self_attn
    specs = [linear_spec(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        grouped = project(x, specs, add_lora_)
        for got, spec in zip(grouped, specs, strict=True):
            assert torch.equal(got, apply_linear(x, spec))


def test_rms_norm_is_llamas():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(8, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 8))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert torch.equal(rms_norm(x, norm.weight.bfloat16(), 1e-5), norm.bfloat16()(x))
