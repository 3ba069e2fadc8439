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

    def fit(seq_len):
        seen.append(seq_len)
        return 3

    assert list(planning.waves(order, prompts, [4, 4, 4, 4], fit)) == [[1, 3, 0], [2]]
    assert seen == [9 + 4, 2 + 4]


def test_bytes_per_row_counts_the_cache_and_the_step_buffers():
    decoder = Decoder(build("llama"))  # 2 layers, 2 kv heads of 16, fp32, vocabulary 264
    kv = 2 * 2 * 2 * 16 * 4  # K and V, layers, kv heads, head dim, fp32 bytes
    assert planning.bytes_per_row(decoder, 100) == 100 * (kv + 12) + 264 * 16
    assert planning.rows_that_fit(decoder, 100, 7, None, 0) == 7  # no budget on CPU: max_batch_size
