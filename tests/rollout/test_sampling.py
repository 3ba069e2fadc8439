"""Logits processing and sampling: each function against transformers' LogitsProcessor of the same name, and the
sync-free sampler against the exact filtered distribution."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from slimrl.rollout.sampling import (
    SamplingParams,
    apply_filters,
    apply_min_p,
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
    choose_tokens,
    exponential_noise,
    sample,
)
from tests.tolerances import assert_close


def random_logits(rows=6, vocab=97, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator) * 3
    logits[0, :5] = logits[0, 5]  # ties at the top-k boundary
    return logits


def hf_filter(logits, params: SamplingParams):
    """transformers' warpers in generate's order: temperature, top-k, top-p, min-p."""
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    if params.temperature != 1.0:
        logits = TemperatureLogitsWarper(params.temperature)(ids, logits)
    if params.top_k_value:
        logits = TopKLogitsWarper(params.top_k_value)(ids, logits)
    if params.top_p < 1.0:
        logits = TopPLogitsWarper(params.top_p)(ids, logits)
    if params.min_p_value:
        logits = MinPLogitsWarper(params.min_p_value)(ids, logits)
    return logits


# -- parameters -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(max_tokens=-1), "max_tokens"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-3]), "stop_token_ids"),
        (dict(logprobs_mode="sampled"), "logprobs_mode"),
    ],
)
def test_bad_sampling_params_are_refused_by_name(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kwargs)


def test_temperature_zero_is_greedy_and_off_values_mean_off():
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    for k in (0, -1, None):
        assert SamplingParams(top_k=k).top_k_value == 0
    assert SamplingParams(min_p=None).min_p_value == 0.0
    assert SamplingParams(stop="###").stop_strings == ("###",)


# -- each filter against transformers -------------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [1, 3, 5, 40, 97, 500])
def test_top_k_matches_transformers(top_k):
    logits = random_logits()
    ids = torch.zeros(6, 1, dtype=torch.long)
    assert torch.equal(apply_top_k(logits, top_k), TopKLogitsWarper(top_k)(ids, logits))


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.9, 0.999, 1.0])
def test_top_p_matches_transformers(top_p):
    logits = random_logits()
    expected = logits if top_p == 1.0 else TopPLogitsWarper(top_p)(torch.zeros(6, 1, dtype=torch.long), logits)
    assert torch.equal(apply_top_p(logits, top_p), expected)


@pytest.mark.parametrize("min_p", [0.0, 0.01, 0.2, 1.0])
def test_min_p_matches_transformers(min_p):
    logits = random_logits()
    expected = logits if min_p == 0 else MinPLogitsWarper(min_p)(torch.zeros(6, 1, dtype=torch.long), logits)
    assert torch.equal(apply_min_p(logits, min_p), expected)


def test_repetition_penalty_matches_transformers_over_the_whole_sequence():
    logits = random_logits()
    generator = torch.Generator().manual_seed(1)
    sequence = torch.randint(0, 97, (6, 12), generator=generator)  # prompt + generated tokens, repeats included
    seen = torch.zeros(6, 97, dtype=torch.bool).scatter_(1, sequence, True)
    expected = RepetitionPenaltyLogitsProcessor(1.3)(sequence, logits.clone())
    assert torch.equal(apply_repetition_penalty(logits, seen, 1.3), expected)
    assert apply_repetition_penalty(logits, seen, 1.0) is logits


def test_filters_compose_in_transformers_order():
    logits = random_logits()
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05)
    assert torch.equal(apply_filters(logits, params), hf_filter(logits, params))


# -- sampling --------------------------------------------------------------------------------------------------------


def empirical(tokens, vocab):
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_k=6),
        SamplingParams(temperature=1.3, top_p=0.7),
        SamplingParams(temperature=0.9, min_p=0.1),
        SamplingParams(temperature=0.8, top_k=12, top_p=0.9, min_p=0.02),
    ],
)
def test_sampled_tokens_follow_the_filtered_distribution(params):
    vocab, draws = 24, 40000
    row = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3)) * 2
    exact = torch.softmax(hf_filter(row, params).double(), dim=-1)[0]
    generator = torch.Generator().manual_seed(0)
    noise = exponential_noise((draws, vocab), "cpu", generator)
    tokens, _ = choose_tokens(row.expand(draws, vocab), params, noise=noise)
    freq = empirical(tokens, vocab)
    assert freq[exact == 0].sum() == 0, "a filtered-out token was sampled"
    total_variation = 0.5 * (freq - exact).abs().sum().item()
    # with 40k draws over <= 24 tokens the sampling noise of the TV distance is about 0.01
    assert total_variation < 0.025, f"TV distance {total_variation:.4f} between samples and the filtered distribution"
    # chi-square over the kept tokens: its mean is (kept - 1); 4 standard deviations above that is far in the tail
    kept = exact > 0
    chi2 = (draws * (freq[kept] - exact[kept]) ** 2 / exact[kept]).sum().item()
    dof = int(kept.sum()) - 1
    assert chi2 < dof + 4 * (2 * max(dof, 1)) ** 0.5 + 10, f"chi-square {chi2:.1f} with {dof} degrees of freedom"


def test_sample_is_the_exponential_race_and_matches_multinomial_frequencies():
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]]).expand(30000, 4)
    drawn = sample(probs, generator=torch.Generator().manual_seed(5))
    freq = empirical(drawn, 4)
    assert freq[3] == 0
    assert (freq - torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)).abs().max() < 0.015
    # the same generator state gives the same draws: reproducible with a seed
    again = sample(probs, generator=torch.Generator().manual_seed(5))
    assert torch.equal(drawn, again)


def test_greedy_picks_the_argmax_of_the_penalised_logits():
    logits = random_logits()
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen[:, logits.argmax(-1)] = True
    params = SamplingParams(temperature=0.0, repetition_penalty=5.0)
    tokens, logprobs = choose_tokens(logits, params, seen=seen)
    penalised = apply_repetition_penalty(logits, seen, 5.0)
    assert torch.equal(tokens, penalised.argmax(-1))
    assert_close(logprobs, penalised.log_softmax(-1).gather(1, tokens[:, None])[:, 0], name="greedy logprobs")


def test_logprobs_modes_are_the_documented_distributions():
    logits = random_logits().to(torch.bfloat16)
    raw = logits.float()
    noise = exponential_noise(raw.shape, "cpu", torch.Generator().manual_seed(2))
    base = dict(temperature=0.7, top_k=10)
    tokens, processed = choose_tokens(logits, SamplingParams(**base), noise=noise)
    _, tempered = choose_tokens(logits, SamplingParams(**base, logprobs_mode="temperature"), noise=noise)
    _, unscaled = choose_tokens(logits, SamplingParams(**base, logprobs_mode="raw"), noise=noise)
    pick = tokens[:, None]
    filtered = hf_filter(raw, SamplingParams(**base))
    assert_close(processed, filtered.log_softmax(-1).gather(1, pick)[:, 0], name="processed logprobs")
    assert_close(tempered, (raw / 0.7).log_softmax(-1).gather(1, pick)[:, 0], name="temperature logprobs")
    assert_close(unscaled, raw.log_softmax(-1).gather(1, pick)[:, 0], name="raw logprobs")
    assert choose_tokens(logits, SamplingParams(**base, logprobs=False), noise=noise)[1] is None
