"""The rollout engine against transformers' `generate` and a full forward, on tiny models (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

from slimrl.rollout.engine import RolloutEngine
from slimrl.rollout.sampling import SamplingParams
from slimrl.testing import tiny_model, tiny_tokenizer
from tests.rollout.helpers import (
    GREEDY,
    PROMPTS,
    build,
    full_forward_logprobs,
    hf_greedy,
    left_pad,
    likely_eos,
    no_eos,
    sampled_by_generate,
    with_lora,
)
from tests.tolerances import assert_close

# -- greedy parity with transformers --------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_batch_matches_generate_with_left_padding(arch):
    model = no_eos(build(arch))
    out = RolloutEngine(model).generate(PROMPTS, GREEDY, max_new_tokens=16)
    assert out.completion_ids == hf_greedy(model, PROMPTS, 16, eos_token_id=None)
    assert out.finish_reason == ["length"] * 3 and out.prompt_ids == PROMPTS


def test_greedy_matches_generate_with_rope_scaling():
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    model = no_eos(build("llama", rope_parameters=rope))
    out = RolloutEngine(model).generate(PROMPTS, GREEDY, max_new_tokens=12)
    assert out.completion_ids == hf_greedy(model, PROMPTS, 12, eos_token_id=None)


def test_greedy_with_lora_matches_generate_through_the_peft_model(arch):
    model = with_lora(no_eos(build(arch)))
    engine = RolloutEngine(model)
    out = engine.generate(PROMPTS, GREEDY, max_new_tokens=16)
    assert out.completion_ids == hf_greedy(model, PROMPTS, 16, eos_token_id=None)
    with model.disable_adapter():  # TRL's reference model: the same engine sees the base weights
        base = engine.generate(PROMPTS, GREEDY, max_new_tokens=16).completion_ids
        assert base == hf_greedy(model, PROMPTS, 16, eos_token_id=None)
    assert base != out.completion_ids, "the adapter should change the greedy output"


def test_an_optimizer_step_on_the_adapter_reaches_the_next_rollout(arch):
    model = with_lora(no_eos(build(arch)))
    engine = RolloutEngine(model)
    before = engine.generate(PROMPTS, GREEDY, max_new_tokens=12).completion_ids
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    ids_before = [id(p) for p in lora]
    optimizer = torch.optim.SGD(lora, lr=20.0)
    ids, mask = left_pad(PROMPTS)
    model.train()
    loss = -model(input_ids=ids, attention_mask=mask).logits[:, -1, 77].mean()  # push every prompt towards token 77
    loss.backward()
    optimizer.step()
    model.eval()
    after = engine.generate(PROMPTS, GREEDY, max_new_tokens=12).completion_ids
    assert after == hf_greedy(model, PROMPTS, 12, eos_token_id=None)
    assert after != before
    assert [id(p) for p in model.parameters() if p.requires_grad] == ids_before  # nothing replaced or copied


def test_repetition_penalty_matches_generate():
    model = no_eos(build("llama"))
    prompts = [[5, 6, 7, 5, 6, 7], [9, 9, 8, 8, 7, 7]]  # equal lengths: transformers would also penalise pad ids
    params = SamplingParams(temperature=0.0, repetition_penalty=1.8)
    out = RolloutEngine(model).generate(prompts, params, max_new_tokens=20)
    assert out.completion_ids == hf_greedy(model, prompts, 20, eos_token_id=None, repetition_penalty=1.8)


def test_4bit_model_matches_generate(tmp_path):
    pytest.importorskip("bitsandbytes")
    from slimrl import FastLanguageModel

    tiny_model("llama").save_pretrained(tmp_path / "tiny")
    tiny_tokenizer().save_pretrained(tmp_path / "tiny")
    # fp32 compute: exact greedy parity is a statement about the same math (bf16 on a GPU flips near-ties)
    model, _ = FastLanguageModel.from_pretrained(str(tmp_path / "tiny"), load_in_4bit=True, dtype=torch.float32)
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    model = no_eos(model.eval())
    out = RolloutEngine(model).generate(PROMPTS, GREEDY, max_new_tokens=8)
    assert out.completion_ids == hf_greedy(model, PROMPTS, 8, eos_token_id=None)


# -- log-probs -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [0, 7])
def test_returned_logprobs_equal_a_full_forward(arch, top_k):
    model = with_lora(no_eos(build(arch)))
    params = SamplingParams(temperature=0.7, top_k=top_k, seed=3)
    out = RolloutEngine(model).generate(PROMPTS, params, max_new_tokens=10)
    expected = full_forward_logprobs(model, PROMPTS, out.completion_ids, 0.7, top_k)
    for r, (got, want) in enumerate(zip(out.logprobs, expected, strict=True)):
        assert_close(torch.tensor(got), want, name=f"logprobs of sequence {r}")


def test_sampling_through_the_engine_follows_the_model_distribution():
    model = no_eos(build("llama"))
    prompt, draws = [5, 6, 7, 8], 3000
    params = SamplingParams(temperature=0.5, top_k=5, seed=0)
    out = RolloutEngine(model, max_batch_size=draws).generate([prompt] * draws, params, max_new_tokens=1)
    first = torch.tensor([c[0] for c in out.completion_ids])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1] / 0.5
    logits = logits.masked_fill(logits < logits.topk(5).values[-1], float("-inf"))
    exact = logits.double().softmax(-1)
    freq = torch.bincount(first, minlength=exact.numel()).double() / draws
    assert freq[exact == 0].sum() == 0
    assert 0.5 * (freq - exact).abs().sum() < 0.05  # sampling noise of the TV distance here is about 0.015


def test_a_seed_makes_rollouts_reproducible():
    model = no_eos(build("qwen2"))
    engine = RolloutEngine(model)
    params = SamplingParams(temperature=1.0, seed=11)
    first = engine.generate(PROMPTS, params, max_new_tokens=10).completion_ids
    assert engine.generate(PROMPTS, params, max_new_tokens=10).completion_ids == first
    other = engine.generate(PROMPTS, SamplingParams(temperature=1.0, seed=12), max_new_tokens=10).completion_ids
    assert other != first


# -- stopping --------------------------------------------------------------------------------------------------------


def test_eos_ends_a_sequence_and_is_included():
    model = no_eos(build("llama"))
    free = hf_greedy(model, PROMPTS, 16, eos_token_id=None)
    stop = free[0][5]  # a token the first sequence produces; the others may or may not
    model.generation_config.eos_token_id = [stop, 250]  # several EOS ids, as in generation_config
    out = RolloutEngine(model).generate(PROMPTS, GREEDY, max_new_tokens=16)
    for row, completion in enumerate(free):
        end = completion.index(stop) + 1 if stop in completion else 16
        assert out.completion_ids[row] == completion[:end]
        assert out.finish_reason[row] == ("stop" if stop in completion else "length")
        assert len(out.logprobs[row]) == end
    ignored = RolloutEngine(model).generate(PROMPTS, SamplingParams(temperature=0, ignore_eos=True), 16)
    assert ignored.completion_ids == free


def test_stop_token_ids_and_per_sequence_max_tokens():
    model = no_eos(build("qwen2"))
    free = hf_greedy(model, PROMPTS, 12, eos_token_id=None)
    stop = free[1][2]
    params = SamplingParams(temperature=0.0, stop_token_ids=[stop])
    out = RolloutEngine(model).generate(PROMPTS, params, max_new_tokens=[4, 12, 1])
    for row, limit in enumerate([4, 12, 1]):
        completion = free[row][:limit]
        end = completion.index(stop) + 1 if stop in completion else limit
        assert out.completion_ids[row] == completion[:end]
        assert out.finish_reason[row] == ("stop" if stop in completion else "length")


def test_stop_strings_end_at_the_token_that_completes_them():
    tokenizer = tiny_tokenizer()
    model = no_eos(build("llama"))
    free = hf_greedy(model, PROMPTS, 20, eos_token_id=None)
    text = tokenizer.decode(free[2], skip_special_tokens=True)
    # two characters from the middle of the third completion that are whole characters (random bytes >= 128 decode
    # to U+FFFD), so it occurs in that completion and may or may not in the others
    start = next(i for i in range(2, len(text) - 1) if "\ufffd" not in text[i : i + 2])
    stop = text[start : start + 2]
    out = RolloutEngine(model, tokenizer=tokenizer).generate(PROMPTS, SamplingParams(temperature=0, stop=stop), 20)
    for row, completion in enumerate(free):
        # reference: the shortest prefix whose text contains the stop string (vLLM keeps that token's id)
        ends = [n for n in range(1, 21) if stop in tokenizer.decode(completion[:n], skip_special_tokens=True)]
        end = ends[0] if ends else 20
        assert out.completion_ids[row] == completion[:end]
        assert out.finish_reason[row] == ("stop" if ends else "length")
    assert out.finish_reason[2] == "stop"


def test_stop_strings_need_a_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        RolloutEngine(build("llama")).generate(PROMPTS, SamplingParams(stop="x"), 4)


def test_more_prompts_than_max_batch_size_run_in_waves():
    model = no_eos(build("llama"))
    prompts = PROMPTS * 3
    engine = RolloutEngine(model, max_batch_size=4)
    out = engine.generate(prompts, GREEDY, max_new_tokens=6)
    assert out.stats["waves"] == 3
    assert out.completion_ids == hf_greedy(model, prompts, 6, eos_token_id=None)


def test_release_frees_the_cache_and_the_next_rollout_allocates_again():
    model = no_eos(build("llama"))
    engine = RolloutEngine(model)
    first = engine.generate(PROMPTS, GREEDY, 6).completion_ids
    assert engine.sessions.held_bytes() > 0 and engine.describe()["kv_cache_bytes"] == engine.sessions.held_bytes()
    engine.release()
    assert engine.sessions.current is None and engine.sessions.held_bytes() == 0
    assert engine.generate(PROMPTS, GREEDY, 6).completion_ids == first


# -- what the engine runs ---------------------------------------------------------------------------------------------


INTERPRETER_ONLY = ("runs the kernels in the interpreter on a CPU model; on CUDA they are covered at W1's shapes "
                    "(kernels/test_w1_shapes.py) and through the engine (test_fused_ops.py)")


@pytest.mark.skipif(torch.cuda.is_available(), reason=INTERPRETER_ONLY)
def test_triton_lora_matches_generate(arch):
    # the grouped LoRA kernels of CUDA (two launches per group of projections sharing an input), here in Triton's
    # interpreter; every decode step launches them at the same shapes, so three steps after the prefill's (a
    # launch per group there too) show them as well as fifteen
    model = with_lora(no_eos(build(arch)))
    engine = RolloutEngine(model, triton_lora=True)
    out = engine.generate(PROMPTS, GREEDY, max_new_tokens=4)
    assert out.completion_ids == hf_greedy(model, PROMPTS, 4, eos_token_id=None)
    # the tokens tell only a large error; the log-probs of a sampled run tell a small one at every step (a LoRA term
    # 2% off passes greedy decoding of these few tokens on qwen2)
    sampled = engine.generate(PROMPTS, SamplingParams(temperature=0.7, seed=3), max_new_tokens=4)
    expected = full_forward_logprobs(model, PROMPTS, sampled.completion_ids, 0.7)
    for r, (got, want) in enumerate(zip(sampled.logprobs, expected, strict=True)):
        assert_close(torch.tensor(got), want, name=f"logprobs of sequence {r}")


# -- what the engine hands back is checked ---------------------------------------------------------------------------


def test_non_finite_weights_give_a_clear_error_instead_of_garbage():
    from slimrl.rollout.engine import EngineOutputError

    model = with_lora(no_eos(build("llama")))
    name, param = next((n, p) for n, p in model.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        param.fill_(float("nan"))
    engine = RolloutEngine(model)
    with pytest.raises(EngineOutputError, match=f"weights hold NaN or infinite values \\({name}"):
        engine.generate(PROMPTS, SamplingParams(temperature=1.0, seed=0), max_new_tokens=4)


def test_rollouts_of_alternating_shapes_keep_their_results():
    """Shapes alternate as completion lengths change from step to step: each shape's results stay those of a fresh
    engine (on CUDA each keeps its captured graph, tests/rollout/test_engine_cuda.py)."""
    model = no_eos(build("qwen2"))
    engine = RolloutEngine(model, max_seq_len=512)
    short = engine.generate(PROMPTS, GREEDY, max_new_tokens=4).completion_ids
    long = engine.generate(PROMPTS, GREEDY, max_new_tokens=200).completion_ids
    assert engine.generate(PROMPTS, GREEDY, max_new_tokens=4).completion_ids == short
    assert RolloutEngine(model, max_seq_len=512).generate(PROMPTS, GREEDY, max_new_tokens=200).completion_ids == long


@pytest.mark.parametrize("filters", [{}, {"top_k": 20, "top_p": 0.9, "temperature": 0.7}])
def test_multinomial_sampler_draws_what_transformers_generate_draws(filters):
    """sampler="multinomial": torch.multinomial on torch's generator in prompt order, one draw per row and step,
    so the same seed gives the same completions as generate(do_sample=True), and leaves the generator where
    generate leaves it (rows of different lengths, some ending at EOS)."""
    prompts = PROMPTS + [[40, 41], [50, 51, 52, 53, 54, 55, 56, 57]]
    model = likely_eos(with_lora(build("llama")), prompts)
    torch.manual_seed(123)
    expected = sampled_by_generate(model, prompts, 12, **filters)
    after_generate = torch.randint(0, 2**30, (1,)).item()
    torch.manual_seed(123)
    out = RolloutEngine(model).generate(prompts, SamplingParams(sampler="multinomial", **filters), max_new_tokens=12)
    assert torch.randint(0, 2**30, (1,)).item() == after_generate, "the engine drew as often as generate"
    assert out.completion_ids == expected
    assert any(len(c) < 12 for c in expected) and any(len(c) == 12 for c in expected), [len(c) for c in expected]
