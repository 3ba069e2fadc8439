"""Sliding-window attention in the engine's forward, per layer, as transformers applies it (a query at position p sees
the keys at (p - window, p]): fp32 greedy output equal to `model.generate`'s with a live LoRA, windows shorter than
prompt + completion, left-padded prompts of different lengths; on the SDPA path and through the Triton decode kernel
(its starts moved up to the window; Triton's interpreter on the CPU)."""

from __future__ import annotations

import os

import pytest
import torch

from slimrl.rollout.engine import RolloutEngine
from slimrl.rollout.model.llama import Decoder
from slimrl.rollout.model.reference import prefill_mask, window_mask, window_starts
from slimrl.testing import tiny_model
from tests.rollout.helpers import GREEDY, KERNEL_DEVICE, PROMPTS, build, hf_greedy, left_pad, no_eos, with_lora

NEW = 12  # with the 7-token prompt, 19 tokens: far past every window below


def windowed_mistral(window: int | None):
    model = build("mistral")
    model.config.sliding_window = window  # MistralConfig: every layer; transformers' mask reads it at each forward
    return no_eos(with_lora(model))


@pytest.mark.parametrize("window", [4, 6])
def test_mistral_window_matches_generate(window):
    model = windowed_mistral(window)
    assert Decoder(model).windows == [window, window]
    expected = hf_greedy(model, PROMPTS, NEW)
    got = RolloutEngine(model, max_seq_len=64).generate(PROMPTS, GREEDY, NEW).completion_ids
    assert got == expected
    model.config.sliding_window = None
    assert hf_greedy(model, PROMPTS, NEW) != expected, "the window changes the output: the test sees it"


def test_mixed_global_and_windowed_layers_match_generate():
    # Qwen2: layers from max_window_layers on are windowed (config.layer_types), the first stays global
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1).eval()
    model = no_eos(with_lora(model))
    assert Decoder(model).windows == [None, 4]
    expected = hf_greedy(model, PROMPTS, NEW)
    assert RolloutEngine(model, max_seq_len=64).generate(PROMPTS, GREEDY, NEW).completion_ids == expected


def test_triton_decode_kernel_reads_only_the_window():
    model = windowed_mistral(5)
    expected = hf_greedy(model, PROMPTS, NEW)
    engine = RolloutEngine(model.to(KERNEL_DEVICE), max_seq_len=64, triton_attention=True)
    assert engine.runner.attention is not None
    assert engine.generate(PROMPTS, GREEDY, NEW).completion_ids == expected


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["mistral", "mixed"])
def test_cuda_engine_honours_windows(arch):
    # the whole CUDA path (captured graph, Triton attention with the windowed starts, fused decode where it applies)
    if arch == "mistral":
        model = windowed_mistral(5).cuda()
    else:
        model = tiny_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1).eval()
        model = no_eos(with_lora(model)).cuda()
    ids, mask = left_pad(PROMPTS)
    with torch.no_grad():
        ref = model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=NEW, do_sample=False,
                             pad_token_id=0)  # fmt: skip
    engine = RolloutEngine(model, compile=os.environ.get("TRITON_INTERPRET", "0") != "1")
    assert engine.options.cuda_graphs and engine.options.triton_attention
    assert engine.generate(PROMPTS, GREEDY, NEW).completion_ids == ref[:, ids.shape[1] :].tolist()


def test_masks_worked_by_hand():
    real = torch.tensor([[False, True, True, True, True]])  # one pad column, then four real tokens
    allowed = prefill_mask(real, torch.float32, window=2)[0, 0] == 0
    expected = torch.tensor([[1, 0, 0, 0, 0],  # the pad query sees itself only
                             [0, 1, 0, 0, 0],
                             [0, 1, 1, 0, 0],
                             [0, 0, 1, 1, 0],  # (3 - 2, 3]: columns 2 and 3
                             [0, 0, 0, 1, 1]], dtype=torch.bool)  # fmt: skip
    assert torch.equal(allowed, expected)
    step = torch.zeros(2, 1, 1, 8)
    step[0, ..., :3] = float("-inf")  # row 0's first real column is 3, row 1's is 0
    cut = window_mask(step, torch.tensor([6]), 3)[:, 0, 0] == 0
    assert cut.tolist() == [[False] * 4 + [True] * 4, [False] * 4 + [True] * 4]
    starts = window_starts(torch.tensor([3, 0]), torch.tensor([4]), 3)
    assert starts.tolist() == [3, 2]  # row 0's padding still ends later than the window starts
