"""Tiled MLP against the model's own MLP: outputs, input gradients and LoRA weight gradients."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from slimrl.ops.tiled_mlp import disable_tiled_mlp, enable_tiled_mlp, tiled_mlp_forward
from slimrl.testing import tiny_model
from tests.tolerances import assert_close


@pytest.mark.parametrize("tokens,tile", [(123, 10), (64, 64), (5, 100), (97, 1)])
def test_tiled_forward_and_grads_equal_the_reference(tokens, tile):
    mlp = tiny_model().model.layers[0].mlp
    x = torch.randn(1, tokens, 64, requires_grad=True)
    reference = mlp(x)
    reference.sum().backward()
    expected_input_grad, expected_weight_grad = x.grad.clone(), mlp.down_proj.weight.grad.clone()
    x.grad, mlp.down_proj.weight.grad, mlp.gate_proj.weight.grad, mlp.up_proj.weight.grad = None, None, None, None
    out = tiled_mlp_forward(mlp.forward, x, tile)
    out.sum().backward()
    assert_close(out, reference, name="tiled MLP output")
    assert_close(x.grad, expected_input_grad, name="input grad")
    assert_close(mlp.down_proj.weight.grad, expected_weight_grad, name="down_proj weight grad")


def test_whole_lora_model_with_tiled_mlp_has_the_same_loss_and_lora_grads(arch):
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = get_peft_model(tiny_model(arch), config)
    ids = torch.randint(4, 260, (2, 37), generator=torch.Generator().manual_seed(1))

    def run():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = run()
    assert enable_tiled_mlp(model, tokens_per_tile=16) == 2
    tiled_loss, tiled_grads = run()
    assert_close(tiled_loss, loss, name="loss")
    for name, grad in grads.items():
        assert_close(tiled_grads[name], grad, name=name)
    disable_tiled_mlp(model)
    assert all("_slimrl_untiled_forward" not in vars(m) for m in model.modules())


def test_bad_tile_size_is_an_error():
    with pytest.raises(ValueError, match="tokens_per_tile must be positive"):
        enable_tiled_mlp(tiny_model(), tokens_per_tile=0)
