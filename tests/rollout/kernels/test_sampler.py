"""The fused sampler (`kernels.sampler`) against its plain statement given the same uniforms, its sampled
frequencies against softmax(z), and the engine with it on: log-probs equal a full forward, a seed reproduces.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import math

import pytest
import torch

from slimrl.rollout.sampling import SamplingParams
from tests.rollout.helpers import PROMPTS, build, full_forward_logprobs, no_eos, with_lora
from tests.tolerances import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0), SamplingParams(1.3, logprobs_mode="raw")],
    ids=["t0.7", "greedy", "raw"],
)
def test_kernel_equals_its_plain_statement_given_the_same_uniforms(dtype, params):
    from slimrl.rollout.kernels import sampler as sampling_kernel

    g = torch.Generator(device=DEVICE).manual_seed(0)
    batch, vocab = 5, 5000  # several slices per row, the last one partial
    assert sampling_kernel.splits_for(batch, vocab) > 1
    logits = (torch.randn(batch, vocab, generator=g, device=DEVICE) * 3).to(dtype)
    logits[1, 17] = logits[1, 4000] = logits[1].max() + 1  # a tie: the first index wins, as argmax
    seed, step = torch.tensor([1234], device=DEVICE), torch.tensor([7], device=DEVICE)
    tokens, logprobs = sampling_kernel.choose(logits, params, seed, step)
    uniforms = sampling_kernel.uniforms(seed, step, batch, vocab)
    want_tokens, want_logprobs = sampling_kernel.reference_choice(logits, params, uniforms)
    assert tokens.tolist() == want_tokens.tolist()
    assert_close(logprobs, want_logprobs, "fp32_sum", name="log-probs")
    if params.greedy:
        assert tokens[1].item() == 17


def test_kernel_with_fewer_slices_than_a_power_of_two():
    """A vocabulary whose slices do not fill the power-of-two tile (W1's 151936 at batch 64 is such a case): the
    missing slices must not poison the log-probs."""
    from slimrl.rollout.kernels import sampler as sampling_kernel

    batch, vocab = 2, 5 * sampling_kernel.BLOCK + 1
    splits = sampling_kernel.splits_for(batch, vocab)
    per_split = math.ceil(math.ceil(vocab / splits) / sampling_kernel.BLOCK) * sampling_kernel.BLOCK
    assert math.ceil(vocab / per_split) < splits  # the case at hand
    g = torch.Generator(device=DEVICE).manual_seed(1)
    logits = torch.randn(batch, vocab, generator=g, device=DEVICE) * 2
    seed, step = torch.tensor([3], device=DEVICE), torch.tensor([0], device=DEVICE)
    params = SamplingParams(temperature=1.0)
    tokens, logprobs = sampling_kernel.choose(logits, params, seed, step)
    want_tokens, want_logprobs = sampling_kernel.reference_choice(
        logits, params, sampling_kernel.uniforms(seed, step, batch, vocab)
    )
    assert tokens.tolist() == want_tokens.tolist()
    assert_close(logprobs, want_logprobs, "fp32_sum", name="log-probs")


def test_sampled_frequencies_follow_the_softmax():
    from slimrl.rollout.kernels import sampler as sampling_kernel

    # the draws: the rows at step 0 and the same rows at step 1 (a new Philox key), which must differ from step 0's
    # (the next step draws afresh) and, independent of them, count towards the frequencies too. The CPU interpreter
    # runs a program per row: 400 draws there (chi-square power ~1 against a key of z - E, z + U or z + log E, 0.33
    # against the temperature applied after the noise; p < 0.004 of a false failure, in simulation)
    rows, temperature = (2000 if DEVICE == "cuda" else 200), 0.8
    row = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0, 0.5, 1.2, -0.5, 0.2, -9.0, 1.9], device=DEVICE)
    logits = row.repeat(rows, 1)  # every row gets its own Philox counters: independent draws
    params = SamplingParams(temperature=temperature)
    tokens, logprobs = sampling_kernel.choose(logits, params, torch.tensor([5], device=DEVICE),
                                              torch.tensor([0], device=DEVICE))  # fmt: skip
    other, other_logprobs = sampling_kernel.choose(logits, params, torch.tensor([5], device=DEVICE),
                                                   torch.tensor([1], device=DEVICE))  # fmt: skip
    # (200 rows tell a fresh draw from a repeated one: two independent draws differ with probability 0.81 here)
    assert (other != tokens).float().mean() > 0.5, "the next step must draw afresh"
    drawn, drawn_logprobs = torch.cat([tokens, other]).cpu(), torch.cat([logprobs, other_logprobs]).cpu()
    draws = drawn.numel()
    exact = (row / temperature).double().softmax(-1).cpu()
    freq = torch.bincount(drawn, minlength=row.numel()).double() / draws
    chi2 = float(((freq - exact) ** 2 / exact).sum() * draws)
    assert chi2 < 31.3, f"chi-square {chi2:.1f} over 11 degrees of freedom (p = 0.001 bound 31.3)"
    assert_close(drawn_logprobs.double(), exact.log()[drawn], "fp32_sum", name="log-probs")


def test_engine_with_fused_sampling_returns_the_forward_logprobs_and_reproduces(arch):
    from slimrl.rollout.engine import RolloutEngine

    model = with_lora(no_eos(build(arch))).to(DEVICE)
    engine = RolloutEngine(model, fused_sampling=True)
    params = SamplingParams(temperature=0.7, seed=3)
    out = engine.generate(PROMPTS, params, max_new_tokens=8)
    assert engine.sessions.current.fused_sampling and engine.sessions.current.noise is None
    expected = full_forward_logprobs(model.cpu(), PROMPTS, out.completion_ids, 0.7, 0)
    for r, (got, want) in enumerate(zip(out.logprobs, expected, strict=True)):
        assert_close(torch.tensor(got), want, "engine_logprobs", name=f"logprobs of sequence {r}")
    model.to(DEVICE)
    assert engine.generate(PROMPTS, params, max_new_tokens=8).completion_ids == out.completion_ids
    filtered = engine.generate(PROMPTS, SamplingParams(temperature=0.7, top_k=3, seed=3), max_new_tokens=8)
    assert not engine.sessions.current.fused_sampling and len(filtered.completion_ids) == len(PROMPTS)
