"""models/lora.skip_input_casts_under_autocast: exact under autocast, fewer saved bytes, peft's cast everywhere else."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from slimrl.models.lora import skip_input_casts_under_autocast
from slimrl.testing import tiny_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(dropout: float = 0.0, **options):
    # a bf16 base with peft's default fp32 adapters, lora_B non-zero so the adapter changes the output
    model = get_peft_model(tiny_model(dtype=torch.bfloat16), LoraConfig(r=8, target_modules=TARGETS,
                                                                        lora_dropout=dropout, **options))  # fmt: skip
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn_like(param, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    return model


def step(model, autocast: bool):
    """Loss, LoRA gradients and the bytes of the distinct storages autograd saved for backward."""
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(5, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, sum(saved.values())


def test_under_autocast_the_step_is_bit_identical_and_saves_less():
    model = lora_model()
    loss, grads, saved = step(model, autocast=True)
    assert skip_input_casts_under_autocast(model) == 7 * 2  # seven projections in each of the two layers
    fast_loss, fast_grads, fast_saved = step(model, autocast=True)
    assert torch.equal(fast_loss, loss)
    assert grads.keys() == fast_grads.keys() and len(grads) == 2 * 7 * 2
    for name, grad in grads.items():
        assert torch.equal(fast_grads[name], grad), name
    # each LoRA matmul saved its own bf16 copy of the layer input before; now it saves the base layer's input
    assert fast_saved < saved


def test_without_autocast_peft_casts_as_before():
    model = lora_model()
    skip_input_casts_under_autocast(model)
    # bf16 input and fp32 adapter weights cannot meet in a matmul without the cast: this would raise if it were skipped
    loss, grads, _ = step(model, autocast=False)
    assert torch.isfinite(loss) and len(grads) == 2 * 7 * 2


@pytest.mark.parametrize("options", [{"dropout": 0.1}, {"use_dora": True}], ids=["dropout", "dora"])
def test_dropout_and_variants_keep_peft_cast(options):
    assert skip_input_casts_under_autocast(lora_model(**options)) == 0


def test_installing_twice_changes_nothing_more():
    model = lora_model()
    assert skip_input_casts_under_autocast(model) == 14
    assert skip_input_casts_under_autocast(model) == 0
