"""share_prompt_cache: GRPO's G copies of a prompt keep one copy of its K/V (a shared prefix, `kv_cache`) and each row
only its completion's columns; the attention reads the prompt's columns from that copy. Tiny models with a live LoRA,
fp32, CPU (the Triton kernels in the interpreter): the same completions as transformers' generate and as the cache
with a copy per row, and the cache smaller by what the copies held. The attention kernel's prefix against SDPA:
kernels/test_attention.py; the whole CUDA path: test_engine_cuda.py."""

from __future__ import annotations

import pytest
import torch

from slimrl.rollout import planning
from slimrl.rollout.engine import RolloutEngine
from slimrl.rollout.kv_cache import kv_bytes_per_token
from slimrl.rollout.sampling import SamplingParams
from tests.rollout.helpers import GREEDY, KERNEL_DEVICE, build, hf_greedy, no_eos, with_lora
from tests.tolerances import assert_close

# three prompts past one 128-column prefix block, of different lengths (left padding inside the prefix), 4 copies
# each, interleaved as a wave sorted by length keeps them: 12 rows in a bucket of 16, 4 prefix rows (one for the
# idle rows' [pad])
LONG = [[5 + i % 200 for i in range(150)], [7 + (3 * i) % 190 for i in range(140)], [9 + i % 97 for i in range(131)]]
ROWS = [p for p in LONG for _ in range(4)]
NEW = 8


def engines(model, **flags):
    """The engine with the shared prompt cache (asked for: on the CPU the default keeps a copy per row, which the
    plain attention reads without a gather) and the engine with a copy per row."""
    return tuple(RolloutEngine(model, share_prompt_cache=shared, **flags) for shared in (True, False))


def prefix_of(engine) -> tuple[int, int]:
    session = engine.sessions.current
    return session.prefix_rows, session.prefix_len


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3", "gemma2", "gemma3", "qwen3_moe"])
def test_greedy_matches_generate_with_one_copy_of_each_prompt(arch):
    model = with_lora(no_eos(build(arch)))
    expected = hf_greedy(model, ROWS, NEW, eos_token_id=None)
    shared, separate = engines(model)
    got, plain = (e.generate(ROWS, GREEDY, NEW) for e in (shared, separate))
    assert got.completion_ids == plain.completion_ids == expected
    assert_close(got.logprobs, plain.logprobs, name="greedy log-probs")
    assert prefix_of(shared) == (4, 256) and prefix_of(separate) == (0, 0)
    d = shared.decoder
    per_token = kv_bytes_per_token(d.num_layers, d.kv_heads, d.head_dim, d.dtype)
    # 4 prefix rows of 256 columns and 16 rows of 128 own columns, against 16 rows of 256 columns
    assert got.stats["kv_cache_bytes"] == (4 * 256 + 16 * 128) * per_token
    assert plain.stats["kv_cache_bytes"] == 16 * 256 * per_token


@pytest.mark.parametrize("window", [4, 100])
def test_sliding_windows_reach_into_the_prefix_or_past_it(window):
    # a window of 100 starts inside the prompt's copy; one of 4 leaves it after a few tokens (the prefix unread)
    model = build("mistral")
    model.config.sliding_window = window
    model = no_eos(with_lora(model))
    expected = hf_greedy(model, ROWS, NEW, eos_token_id=None)
    shared, separate = engines(model)
    assert shared.generate(ROWS, GREEDY, NEW).completion_ids == expected
    assert separate.generate(ROWS, GREEDY, NEW).completion_ids == expected and prefix_of(shared)[1] == 256


def test_seeded_sampling_and_waves_draw_what_the_copies_draw():
    # waves of 8 rows split the prompts' copies over two waves; each copy still samples its own completion
    model = with_lora(no_eos(build("llama")))
    params = SamplingParams(temperature=1.0, top_k=20, seed=11)
    shared, separate = engines(model, max_batch_size=8)
    got, plain = shared.generate(ROWS, params, NEW), separate.generate(ROWS, params, NEW)
    assert got.completion_ids == plain.completion_ids and got.stats["waves"] == 2
    assert_close([x for r in got.logprobs for x in r], [x for r in plain.logprobs for x in r], name="log-probs")
    assert len({tuple(c) for c in got.completion_ids[:4]}) > 1, "each copy of a prompt draws its own completion"
    assert got.stats["kv_cache_bytes"] < plain.stats["kv_cache_bytes"]


def test_a_lora_update_reaches_the_next_rollout_through_the_shared_cache():
    model = with_lora(no_eos(build("qwen2")))
    engine = RolloutEngine(model, share_prompt_cache=True)
    before = engine.generate(ROWS, GREEDY, NEW).completion_ids
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn_like(param) * 0.5)
    after = engine.generate(ROWS, GREEDY, NEW).completion_ids
    assert after == hf_greedy(model, ROWS, NEW, eos_token_id=None) and after != before
    assert prefix_of(engine) == (4, 256)


def test_the_kernels_read_the_prompt_from_its_one_copy():
    # the fused q/k/v kernel writes the rows' own columns and the Triton attention reads the prefix through its
    # table (Triton's interpreter on the CPU); head dim 32, the kernels' least. Three tokens: the prefill's, then two
    # decode steps, the second reading the prefix and the own column the first wrote
    model = with_lora(no_eos(build("llama", num_attention_heads=2, num_key_value_heads=1, head_dim=32)))
    model = model.to(KERNEL_DEVICE)
    rows = [p[-130:] for p in LONG[:2] for _ in range(4)]  # 8 rows: a bucket of 8, 2 prefix rows of 256 columns
    flags = dict(max_seq_len=512, triton_lora=True, triton_attention=True, fused_decode=True)
    shared, separate = engines(model, **flags)
    got = shared.generate(rows, GREEDY, 3).completion_ids
    assert prefix_of(shared) == (2, 256)
    assert got == separate.generate(rows, GREEDY, 3).completion_ids == hf_greedy(model, rows, 3, eos_token_id=None)
    # each row's columns were split over programs (3 of the 384 shared columns, 2 of the 256 a copy per row needs:
    # `attention.context_splits`), their sums merged in split order
    for engine in (shared, separate):
        assert engine.sessions.current.scratch.holds(KERNEL_DEVICE, "attention")
    whole = RolloutEngine(model, share_prompt_cache=True, attention_splits=1, **flags)  # a program per row and head
    assert whole.generate(rows, GREEDY, 3).completion_ids == got
    assert not whole.sessions.current.scratch.holds(KERNEL_DEVICE, "attention")


def test_short_prompts_keep_a_copy_per_row():
    # a 3-token prompt rounded up to a 128-column prefix would hold more than the copies it saves
    assert planning.shared_prefix(16, 5, 3, 8, 512) is None
    assert planning.shared_prefix(16, 4, 150, 8, 512) == ((4, 256), 384)
    assert planning.shared_prefix(16, 16, 150, 8, 512) is None  # nothing shared
    model = with_lora(no_eos(build("llama")))
    engine = RolloutEngine(model, share_prompt_cache=True)
    engine.generate([[5, 6, 7]] * 8, GREEDY, 4)
    assert prefix_of(engine) == (0, 0)


def test_by_default_the_cache_is_shared_where_the_attention_kernel_reads_it_in_place():
    model = with_lora(no_eos(build("llama", num_attention_heads=2, num_key_value_heads=1, head_dim=32)))
    assert RolloutEngine(model).describe()["share_prompt_cache"] is False  # the CPU's SDPA would gather the rows
    kernel = RolloutEngine(model.to(KERNEL_DEVICE), max_seq_len=512, triton_attention=True)
    assert kernel.describe()["share_prompt_cache"] is True
    odd = with_lora(no_eos(build("llama", num_attention_heads=2, num_key_value_heads=1, head_dim=24)))
    assert RolloutEngine(odd.to(KERNEL_DEVICE), triton_attention=True).options.share_prompt_cache is False
    capped = with_lora(no_eos(build("gemma2")))  # soft-capped scores: eager attention over gathered rows
    assert RolloutEngine(capped.to(KERNEL_DEVICE), triton_attention=True).options.share_prompt_cache is False
