"""share_prompt_prefill: a prompt that several rows hold (GRPO's G completions of one prompt) is prefilled once and
its K/V copied into each row's cache; the outputs are those of a prefill of every row (tiny models, CPU, fp32)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slimrl.rollout import runner
from slimrl.rollout.engine import RolloutEngine
from slimrl.rollout.sampling import SamplingParams
from slimrl.testing import tiny_tokenizer
from tests.rollout.helpers import GREEDY, build, hf_greedy, no_eos, with_lora
from tests.tolerances import assert_close

A, B, C, D = [5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34], [40, 41, 42, 43]
# duplicates interleaved with distinct prompts of other lengths: A x4, B x2, C x2, D x1
ROWS = [A, B, A, C, A, B, D, C, A]


@pytest.fixture(scope="module")
def model():
    return with_lora(no_eos(build("llama")))


def rollout(model, share: bool, params: SamplingParams, new_tokens: int, **engine_args):
    engine = RolloutEngine(model, share_prompt_prefill=share, **engine_args)
    torch.manual_seed(0)  # the multinomial sampler draws on torch's generator
    return engine, engine.generate(ROWS, params, max_new_tokens=new_tokens)


def test_group_rows_finds_each_prompt_and_the_rows_holding_it():
    distinct, members = runner.group_rows([[1, 2], [3], [1, 2], [1], [3], [1, 2]])
    assert distinct == [[1, 2], [3], [1]]
    assert members == [[0, 2, 5], [1, 4], [3]]


def test_greedy_is_unchanged_in_waves_and_small_prefill_blocks(model, monkeypatch):
    # waves of 4 rows split A's copies; blocks of 2 distinct prompts give rounds in which only some prompts have a
    # further row (the K/V picked out of the block)
    monkeypatch.setattr(runner, "PREFILL_TOKENS", 2 * len(A))
    shared = rollout(model, True, GREEDY, 10, max_batch_size=4)[1]
    separate = rollout(model, False, GREEDY, 10, max_batch_size=4)[1]
    assert shared.completion_ids == separate.completion_ids == hf_greedy(model, ROWS, 10, eos_token_id=None)
    assert shared.stats["waves"] == 3 and shared.stats["prefill_rows"] < separate.stats["prefill_rows"]
    assert_close(shared.logprobs, separate.logprobs, name="greedy log-probs")


@pytest.mark.parametrize("sampler", ["race", "multinomial"])
def test_seeded_sampling_draws_the_same_completions_and_stop_strings_cut_them_alike(model, sampler):
    tokenizer = tiny_tokenizer()
    params = SamplingParams(temperature=1.0, top_k=20, repetition_penalty=1.3, seed=7, sampler=sampler)
    free = rollout(model, False, params, 12, tokenizer=tokenizer)[1]
    text = tokenizer.decode(free.completion_ids[2], skip_special_tokens=True)
    # two whole characters from the middle of a completion (random bytes >= 128 decode to U+FFFD): it ends there
    start = next(i for i in range(2, len(text) - 1) if "\ufffd" not in text[i : i + 2])
    params = dataclasses.replace(params, stop=text[start : start + 2])
    shared = rollout(model, True, params, 12, tokenizer=tokenizer)[1]
    separate = rollout(model, False, params, 12, tokenizer=tokenizer)[1]
    assert shared.completion_ids == separate.completion_ids
    assert shared.finish_reason == separate.finish_reason and "stop" in shared.finish_reason
    assert_close([x for row in shared.logprobs for x in row], [x for row in separate.logprobs for x in row],
                 name="sampled log-probs")  # fmt: skip
    copies = [shared.completion_ids[r] for r, p in enumerate(ROWS) if p == A]
    assert len({tuple(c) for c in copies}) > 1, "each copy of a prompt draws its own completion"


def counted_tokens(engine) -> list[int]:
    """A list that gets the token count of every call of the engine's decoder forward."""
    seen, forward = [], engine.decoder.forward

    def counting(ids, *args, **kwargs):
        seen.append(ids.shape[0])
        return forward(ids, *args, **kwargs)

    engine.decoder.forward = counting
    return seen


def test_the_prefill_forward_runs_over_the_distinct_prompts_only(model):
    tokens = []
    for share in (True, False):
        engine = RolloutEngine(model, share_prompt_prefill=share)
        seen = counted_tokens(engine)
        out = engine.generate(ROWS, GREEDY, max_new_tokens=1)  # one token: the prefill is the only forward
        tokens.append((sum(seen), out.stats["prefill_rows"]))
        assert engine.describe()["share_prompt_prefill"] is share
    # one wave of 9 rows in a bucket of 16, prompts left-padded to 7 tokens; the 7 idle rows share one [pad] prompt
    assert tokens == [(5 * len(A), 5), (16 * len(A), 16)]


def test_every_copy_holds_the_cache_rows_of_a_separate_prefill(model):
    caches = []
    for share in (True, False):
        engine = rollout(model, share, GREEDY, 1)[0]
        cache = engine.sessions.current.cache
        caches.append([torch.stack(t)[:, :, :, : len(A)] for t in (cache.keys, cache.values)])  # [layers, rows, ...]
    (keys, values), (separate_keys, separate_values) = caches
    assert_close(keys, separate_keys, name="keys")
    assert_close(values, separate_values, name="values")
    order = sorted(range(len(ROWS)), key=lambda i: -len(ROWS[i]))  # the wave's rows: longest prompts first
    first = {}
    for row, i in enumerate(order):  # every later copy holds the first copy's K/V, bit for bit
        held = first.setdefault(tuple(ROWS[i]), row)
        assert torch.equal(keys[:, row], keys[:, held]) and torch.equal(values[:, row], values[:, held])
    assert len(set(first.values())) == 4 and not torch.equal(keys[:, first[tuple(A)]], keys[:, first[tuple(C)]])
