"""slimrl's training step runs with cuDNN's SDPA backend off (its backward returns NaN at padded lengths 64 mod 128,
pytorch/pytorch#196678), scoped to the step, and the user's setting comes back afterwards."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from slimrl.ops.attention_backends import ALLOW_ENV, training_attention
from tests.trainers.grpo_harness import build_trainer, zero_reward


def recording_sdpa(monkeypatch) -> list[tuple[bool, bool]]:
    """Replace F.scaled_dot_product_attention by a spy (before slimrl wraps it) that records, per call, whether a mask
    was passed and whether cuDNN's backend was enabled during the call."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, *args, **kwargs):
        calls.append((attn_mask is not None, torch.backends.cuda.cudnn_sdp_enabled()))
        return real(query, key, value, attn_mask, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def test_masked_calls_run_without_cudnn_and_the_rest_as_before(monkeypatch):
    calls = recording_sdpa(monkeypatch)
    spy = F.scaled_dot_product_attention
    q = k = v = torch.randn(1, 2, 4, 8)
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    with training_attention():
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        F.scaled_dot_product_attention(q, k, v, mask)  # positional mask
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with training_attention():  # nested: wrapped once
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert torch.backends.cuda.cudnn_sdp_enabled(), "the flag is off only during a masked call"
    assert calls == [(True, False), (True, False), (False, True), (True, False)]
    assert F.scaled_dot_product_attention is spy, "the function comes back after the step"
    torch.backends.cuda.enable_cudnn_sdp(False)  # a user who turned cuDNN off keeps it off
    try:
        with training_attention():
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
    with pytest.raises(RuntimeError), training_attention():
        raise RuntimeError("a failing step")
    assert F.scaled_dot_product_attention is spy and torch.backends.cuda.cudnn_sdp_enabled()


def test_the_environment_can_leave_cudnn_on(monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "1")
    calls = recording_sdpa(monkeypatch)
    with training_attention():
        F.scaled_dot_product_attention(*(torch.randn(1, 2, 4, 8),) * 3, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    assert calls == [(True, True)]


def test_every_masked_attention_of_a_training_step_runs_without_cudnn(monkeypatch):
    """The scoring passes, the chunked forward and the backward of a GRPO step (prompts of different lengths, so
    left-padded: transformers passes a mask) all call SDPA with cuDNN off; the setting is back on afterwards."""
    from datasets import Dataset

    calls = recording_sdpa(monkeypatch)
    prompts = Dataset.from_list([{"prompt": "What is " + "1 + " * (i % 4) + "2?"} for i in range(16)])
    trainer = build_trainer("slimrl", reward_funcs=zero_reward, dataset=prompts, max_steps=1, num_chunks=2,
                            max_completion_length=4)  # fmt: skip
    trainer.train()
    masked = [cudnn for has_mask, cudnn in calls if has_mask]
    assert len(masked) > 4 and not any(masked), calls
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


@pytest.mark.cuda  # the cuDNN SDPA fault is a CUDA one
@pytest.mark.parametrize(("seq_len", "pad", "dead_row"), itertools.product([64, 192, 320], [0, 3], [False, True]))
def test_training_attention_gives_finite_gradients_at_the_shapes_that_break_cudnn(seq_len, pad, dead_row):
    with training_attention():
        grads = padded_attention_grads(seq_len, pad, dead_row)
    assert all(torch.isfinite(g).all() for g in grads)
