"""slimrl's training step runs with cuDNN's SDPA backend off (its backward returns NaN at padded lengths 64 mod 128,
pytorch/pytorch#196678), scoped to the step, and the user's setting comes back afterwards."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from slimrl.ops.attention_backends import ALLOW_ENV, training_attention
from tests.trainers.grpo_harness import build_trainer, zero_reward


@pytest.mark.parametrize("before", [True, False])
def test_training_attention_turns_cudnn_off_and_restores_the_setting(before):
    torch.backends.cuda.enable_cudnn_sdp(before)
    try:
        with training_attention():
            assert not torch.backends.cuda.cudnn_sdp_enabled()
            with training_attention():  # nested: still off, and the outer block's state survives the inner exit
                pass
            assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.cudnn_sdp_enabled() is before
        with pytest.raises(RuntimeError), training_attention():
            raise RuntimeError("a failing step")
        assert torch.backends.cuda.cudnn_sdp_enabled() is before
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


def test_the_environment_can_leave_cudnn_on(monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "1")
    with training_attention():
        assert torch.backends.cuda.cudnn_sdp_enabled()


def test_every_forward_and_backward_of_a_training_step_runs_without_cudnn():
    """The scoring passes, the chunked forward and the backward of a GRPO step (the last chunk's backward runs in
    HF Trainer's training_step, after compute_loss) all see cuDNN's SDPA off; the setting is back on afterwards."""
    trainer = build_trainer("slimrl", reward_funcs=zero_reward, max_steps=1, num_chunks=2, max_completion_length=4)
    seen = []
    layer = trainer.model.get_base_model().model.layers[0].self_attn

    def record(*args):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())

    layer.register_forward_hook(lambda module, inputs, output: record())
    layer.register_full_backward_hook(lambda module, grad_in, grad_out: record())
    trainer.train()
    assert len(seen) > 4 and not any(seen), seen
    assert torch.backends.cuda.cudnn_sdp_enabled()


def padded_attention_grads(seq_len: int, pad: int, dead_row: bool) -> list[torch.Tensor]:
    """Gradients of SDPA with an explicit causal + left-padding mask, loss over kept rows (the trainers' shape)."""
    generator = torch.Generator(device="cuda").manual_seed(seq_len)
    shape = (16, 9, seq_len, 64)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator).requires_grad_()
               for _ in range(3))  # fmt: skip
    keep = torch.ones(16, seq_len, device="cuda", dtype=torch.bool)
    keep[::2, :pad] = False
    if dead_row:
        keep[1, :] = False
    mask = torch.ones(seq_len, seq_len, device="cuda", dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    (out.float() * keep[:, None, :, None]).sum().backward()
    return [q.grad, k.grad, v.grad]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuDNN SDPA fault is a CUDA one")
@pytest.mark.parametrize(("seq_len", "pad", "dead_row"), itertools.product([64, 192, 320], [0, 3], [False, True]))
def test_training_attention_gives_finite_gradients_at_the_shapes_that_break_cudnn(seq_len, pad, dead_row):
    with training_attention():
        grads = padded_attention_grads(seq_len, pad, dead_row)
    assert all(torch.isfinite(g).all() for g in grads)
