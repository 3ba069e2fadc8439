"""The decode step's Triton kernels at W1's shapes (Qwen2.5-1.5B: hidden 1536, 12 query heads of 128, 2 kv heads,
intermediate 8960, LoRA r=64, vocabulary 151936), on a GPU: what bench/rollout.py once checked before timing (and
switched off on failure), now tests. Triton's interpreter runs the same kernels at small odd shapes (the other
modules here, tests/rollout/test_fused_ops.py); these take the real tile counts, split-K shares and sampler slices.

- each fused projection group on the GPU's shipped settings (`fused_ops.choices_for`) at 8, 64 and 256 rows, on the
  ordinary and the deterministic path, by the check bench/tune_decode.py gates every tuned setting with (largest error
  under 2% of the largest reference magnitude against the unfused path), and on the deterministic path the same bits
  on every launch;
- decode attention through the cache's address table, with the default launch and the one the runner takes for up
  to 64 bf16 rows (128 columns, 8 warps), whole or with each row's columns split over several programs, against SDPA
  with the additive mask, and the same bits on every launch;
- grouped LoRA on each projection group of a layer, rank 64, against peft's math;
- the fused sampler at W1's vocabulary, 8 / 64 / 256 rows, against its plain statement given the same uniforms.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from slimrl.rollout.sampling import SamplingParams
from tests.tolerances import assert_close

# W1's shapes need a GPU (the interpreter runs these kernels at small shapes in the other tests)
pytestmark = pytest.mark.cuda

TUNER = Path(__file__).resolve().parents[3] / "bench" / "tune_decode.py"
VOCAB = 151936
# (input features, output widths) of each group of projections that share an input, in W1's layer
LORA_GROUPS = {"qkv": (1536, [1536, 256, 256]), "o": (1536, [1536]), "gate_up": (1536, [8960, 8960]),
               "down": (8960, [1536])}  # fmt: skip
TOKEN_AGREEMENT = 0.98  # the sampler's key takes the hardware's approximate log: a near-tie may break the other way


@pytest.fixture(scope="module")
def tuner():
    """bench/tune_decode.py: W1's layer, its unfused reference and the check that gates every tuned setting."""
    spec = importlib.util.spec_from_file_location("bench_tune_decode", TUNER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("ordered", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("rows", [8, 64, 256])
def test_fused_projections_on_the_shipped_settings_match_the_unfused_path(tuner, rows, ordered):
    from slimrl.rollout.fused_ops import choices_for

    choices, path = choices_for(torch.device("cuda"))
    errors = tuner.group_errors(tuner.W1_LAYER, rows, choices, "cuda", ordered=ordered)
    wrong = {group: round(error, 5) for group, error in errors.items() if not error < tuner.TOLERANCE}
    assert not wrong, f"{path.name}, {rows} rows: relative errors over {tuner.TOLERANCE}: {wrong} (all: {errors})"


@pytest.mark.parametrize("rows", [8, 64, 256])
def test_deterministic_projections_on_the_shipped_settings_give_the_same_bits_every_time(tuner, rows):
    """Each group's deterministic launch on the GPU's shipped settings (its LoRA shrink computed by its own producers,
    their K chunks added in chunk order, or by an ordered `shrink_` launch before it; split-K shares added in split
    order), three times: the programs finish in another order each run, the bits of the outputs (and of q/k/v's cache
    columns) may not change."""
    from slimrl.rollout.fused_ops import choices_for

    choices, path = choices_for(torch.device("cuda"))
    case = tuner.layer_case(tuner.W1_LAYER, rows, "cuda")  # every group's weights and inputs, built once
    for group in tuner.GROUPS:
        call = tuner.fused_call(tuner.W1_LAYER, case, group, choices, ordered=True)
        with torch.no_grad():
            runs = [tuple(t.clone() for t in call()) for _ in range(3)]
        for i, run in enumerate(runs[1:], 1):
            for first, again in zip(runs[0], run, strict=True):
                assert torch.equal(first, again), f"{path.name}: {group} at {rows} rows, run {i} gave other bits"


@pytest.mark.parametrize("rows, block_s, num_warps, splits", [(64, 64, 4, 1), (64, 128, 8, 1), (256, 64, 4, 1),
                                                             (8, 128, 8, 4), (64, 128, 8, 3), (8, 64, 4, 7)])
def test_decode_attention_through_the_table_matches_masked_sdpa(rows, block_s, num_warps, splits):
    from slimrl.rollout.kernels.attention import SplitScratch, decode_attention
    from slimrl.rollout.kv_cache import StaticKVCache, table_entries
    from tests.rollout.kernels.test_attention import sdpa_reference

    g = torch.Generator(device="cuda").manual_seed(rows)
    q = torch.randn(rows, 12, 128, generator=g, device="cuda").bfloat16()
    cache = StaticKVCache(1, rows, 2, 512, 128, torch.bfloat16, "cuda")
    keys, values = cache.keys[0].normal_(generator=g), cache.values[0].normal_(generator=g)
    anchor = torch.zeros(1, dtype=torch.bfloat16, device="cuda")
    table = torch.tensor(table_entries(cache, anchor), device="cuda")
    starts = torch.randint(0, 60, (rows,), generator=g, device="cuda")  # left padding of each row
    end = torch.tensor([400], device="cuda")
    scratch = SplitScratch()
    got = decode_attention(q, keys, values, starts, end, 128**-0.5, 0, table, anchor, block_s, num_warps,
                           splits=splits, scratch=scratch)  # fmt: skip
    want = sdpa_reference(q, keys, values, starts, 400, 128**-0.5)
    assert_close(got.float(), want.float(), "bf16", name=f"attention, {rows} rows, block_s {block_s}, {splits} splits")
    for _ in range(3):  # the splits meet in split order: the same bits whichever program finishes last
        assert torch.equal(decode_attention(q, keys, values, starts, end, 128**-0.5, 0, table, anchor, block_s,
                                            num_warps, splits=splits, scratch=scratch), got)  # fmt: skip


@pytest.mark.parametrize("rows", [8, 64, 256])
@pytest.mark.parametrize("group", list(LORA_GROUPS))
def test_grouped_lora_matches_peft_math(group, rows):
    from slimrl.rollout.kernels.lora import lora_group_
    from slimrl.rollout.model.reference import add_lora_
    from tests.rollout.kernels.test_lora import make_group

    features, widths = LORA_GROUPS[group]
    x, items = make_group(rows, features, 64, widths, torch.bfloat16, torch.float32)  # peft's fp32 adapters
    expected = [(y.clone(), lora) for y, lora in items]
    add_lora_(x, expected)
    lora_group_(x, items, tf32=True)  # as the engine runs a bf16 model: TF32 adapter products
    for i, ((got, _), (want, _)) in enumerate(zip(items, expected, strict=True)):
        assert_close(got.float(), want.float(), "bf16", name=f"{group} output {i}, {rows} rows")


@pytest.mark.parametrize("rows", [8, 64, 256])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)],
                         ids=["t1", "greedy"])  # fmt: skip
def test_fused_sampler_at_w1_vocabulary_matches_its_plain_statement(params, rows):
    from slimrl.rollout.kernels import sampler

    g = torch.Generator(device="cuda").manual_seed(rows)
    logits = (torch.randn(rows, VOCAB, generator=g, device="cuda") * 4).bfloat16()
    seed, step = torch.tensor([99], device="cuda"), torch.tensor([3], device="cuda")
    tokens, logprobs = sampler.choose(logits, params, seed, step)
    want, want_logprobs = sampler.reference_choice(logits, params, sampler.uniforms(seed, step, rows, VOCAB))
    same = tokens == want
    assert float(same.float().mean()) >= TOKEN_AGREEMENT, f"{int((~same).sum())} of {rows} tokens differ"
    assert_close(logprobs[same], want_logprobs[same], "fp32_sum", name="log-probs of the same tokens")
