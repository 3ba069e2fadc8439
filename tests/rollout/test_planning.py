"""Planning a rollout: request checks, graph-sharing shapes (batch buckets, cache lengths), waves and their bytes."""

from __future__ import annotations

import pytest

from slimrl.rollout import planning
from slimrl.rollout.engine import RolloutEngine
from slimrl.rollout.model.llama import Decoder
from slimrl.rollout.sampling import SamplingParams
from tests.rollout.helpers import GREEDY, PROMPTS, build


def test_prompts_and_lengths_are_validated():
    engine = RolloutEngine(build("llama"), max_seq_len=16)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], GREEDY, 4)
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[5, 9999]], GREEDY, 4)
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.generate([list(range(5, 21))], GREEDY, 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(PROMPTS, GREEDY)
    # a completion that would pass max_seq_len is cut there, with finish_reason "length"
    out = engine.generate([list(range(5, 15))], GREEDY, 100)
    assert len(out.completion_ids[0]) == 6 and out.finish_reason == ["length"]


def test_request_limits_worked_by_hand():
    params = SamplingParams(max_tokens=7)
    # max_tokens as the default; the third prompt (10 tokens) is capped at 16 - 10 = 6
    assert planning.request_limits([[1], [1, 2], list(range(10))], params, None, 50, 16) == [7, 7, 6]
    assert planning.request_limits([[1], [1, 2]], params, [3, 20], 50, 16) == [3, 14]
    with pytest.raises(ValueError, match="2 entries for 1 prompts"):
        planning.request_limits([[1]], params, [1, 2], 50, 16)


@pytest.mark.parametrize(("batch", "bucket"), [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (17, 24), (64, 64)])
def test_batch_buckets(batch, bucket):
    assert planning.bucket(batch) == bucket


CACHE_LENGTHS = [(10, 20, 4096, 128), (100, 28, 4096, 128), (100, 29, 4096, 256), (300, 500, 512, 800)]


@pytest.mark.parametrize(("prompt", "new", "limit", "length"), CACHE_LENGTHS)
def test_cache_lengths_round_up_to_128_within_max_seq_len(prompt, new, limit, length):
    # the last case: left padding lets prompt + completion pass max_seq_len; the cache still holds both
    assert planning.cache_length(prompt, new, limit) == length


def test_waves_take_as_many_rows_as_fit_longest_first():
    prompts = [[1] * n for n in (5, 9, 2, 7)]
    order = sorted(range(4), key=lambda i: -len(prompts[i]))  # 1, 3, 0, 2
    seen = []

    def fit(prompt_length, longest_limit, distinct):
        seen.append((prompt_length, longest_limit, distinct(3)))
        return 3

    assert list(planning.waves(order, prompts, [4, 4, 4, 4], fit)) == [[1, 3, 0], [2]]
    assert seen == [(9, 4, 3), (2, 4, 2)]  # the last wave: one prompt and idle rows


def test_distinct_prompts_counts_a_waves_first_rows_and_its_idle_rows():
    a, b, c = [1, 2], [3], [4, 5, 6]
    distinct = planning.DistinctPrompts([a, a, b, a, c, c])
    assert [distinct(rows) for rows in (1, 2, 3, 4, 5, 6)] == [1, 1, 2, 2, 3, 3]
    assert distinct(8) == 4, "two idle rows: one [pad] prompt more"


def test_bytes_per_row_counts_the_cache_and_the_step_buffers():
    decoder = Decoder(build("llama"))  # 2 layers, 2 kv heads of 16, fp32, vocabulary 264
    kv = 2 * 2 * 2 * 16 * 4  # K and V, layers, kv heads, head dim, fp32 bytes
    assert planning.bytes_per_row(decoder, 100) == 100 * (kv + 12) + 264 * 16
    assert planning.rows_that_fit(decoder, 100, 7, None, 0) == 7  # no budget on CPU: max_batch_size


def test_a_budget_takes_more_rows_when_their_prompts_are_held_once(monkeypatch):
    decoder = Decoder(build("llama"))  # 2 layers, 2 kv heads of 16, fp32, vocabulary 264
    kv = 2 * 2 * 2 * 16 * 4
    plain = planning.bytes_per_row(decoder, 1024 + 128)  # a 1,000-token prompt and 100 new tokens: 1,152 columns
    monkeypatch.setattr(planning, "device_memory", lambda device: (int(4.5 * plain), 0))  # 4 rows of copies fit
    assert planning.rows_that_fit(decoder, 1152, 64, 1.0, 0) == 4
    prompts = [[7, i] for i in range(8) for _ in range(8)]  # 8 prompts x 8 copies
    shared = planning.SharedPlan(1000, 100, planning.DistinctPrompts(prompts), 4096)
    # 16 rows: 2 prompts in the prefix of 1,024 columns, each row 128 own columns
    expected = 2 * 1024 * kv + 16 * (128 * kv + 12 * 1152 + 264 * 16)
    assert planning.shared_wave_bytes(decoder, 16, shared) == expected <= 4.5 * plain
    assert planning.shared_wave_bytes(decoder, 24, shared) > 4.5 * plain
    assert planning.rows_that_fit(decoder, 1152, 64, 1.0, 0, shared) == 16
    alone = planning.DistinctPrompts([[7, i] for i in range(64)])
    assert planning.rows_that_fit(decoder, 1152, 64, 1.0, 0, shared._replace(distinct=alone)) == 4  # none shared
    assert planning.rows_that_fit(decoder, 1152, 8, 1.0, 0, shared) == 8  # max_batch_size still bounds it


def test_the_engine_fits_a_wave_of_copies_where_the_per_row_cache_needs_two(monkeypatch):
    from slimrl.rollout.engine import RolloutEngine
    from tests.rollout.helpers import GREEDY, hf_greedy, no_eos, with_lora

    model = with_lora(no_eos(build("llama")))
    rows = [[5 + (i * k) % 200 for i in range(150)] for k in (1, 3) for _ in range(4)]  # 2 prompts x 4 copies
    shared, separate = (RolloutEngine(model, gpu_memory_utilization=1.0, share_prompt_cache=on) for on in (True, False))
    plain = planning.bytes_per_row(shared.decoder, planning.cache_length(150 + 8, 0, shared.max_seq_len))
    for engine in (shared, separate):  # room for 7 rows with a copy each (a bucket of 4); the engine's cache is all
        # the device holds
        monkeypatch.setattr(planning, "device_memory", lambda device, e=engine: (7 * plain, e.sessions.held_bytes()))
        out = engine.generate(rows, GREEDY, 8)
        assert out.completion_ids == hf_greedy(model, rows, 8, eos_token_id=None)
        assert out.stats["kv_cache_bytes"] <= 7 * plain
    assert shared.last_stats["waves"] == 1 and separate.last_stats["waves"] == 2  # waves of 8 rows against 4
