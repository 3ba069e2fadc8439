"""What the engine cannot serve is decided when the backend is chosen, before training: `supports()` refuses, with the
reason, an architecture it does not implement, a layer kind or window it cannot honour, and prompt + completion
lengths past the cache it will allocate; "auto" then falls back to TRL's path with one log line naming the reason, and
an explicit "engine" (or fast_inference) raises with it. A prompt longer than anything supports() was told about still
fails at rollout time with its length, the limit and the fix, never a silently shorter completion."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from slimrl.rollout.engine import RolloutEngine, supports
from slimrl.testing import tiny_model
from slimrl.trainers.rollouts.generation import choose_backend
from tests.rollout.helpers import GREEDY, build, no_eos, with_lora

CONTEXT = 512  # the tiny models' max_position_embeddings: the engine's cache length unless max_seq_len says
NO_ROOM = "a prompt of even one token plus max_completion_length=512 pass the engine's max_seq_len=512"


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=264, pad_token_id=0))


def choose(requested, model, **kwargs):
    return choose_backend(requested, model, use_vllm=False, use_continuous_batching=False, **kwargs)


def test_an_architecture_the_engine_does_not_implement_is_refused():
    supported, why = supports(gpt2(), max_completion_length=8)
    assert not supported and why.startswith("architecture 'gpt2' (GPT2LMHeadModel) is not one the rollout engine")


def test_prompt_plus_completion_past_max_seq_len_is_refused():
    model = with_lora(build("llama"))
    assert supports(model, max_prompt_length=9, max_completion_length=7, max_seq_len=16) == (True, "")
    supported, why = supports(model, max_prompt_length=10, max_completion_length=7, max_seq_len=16)
    assert not supported
    assert why.startswith("prompts of up to 10 tokens plus max_completion_length=7 pass the engine's max_seq_len=16")
    assert "lower max_completion_length or the prompt length, or raise max_seq_length" in why


def test_a_completion_leaving_no_room_for_a_prompt_is_refused_against_the_model_context():
    # no prompt bound (TRL 1.16's GRPO has none): a prompt has one token at least; the cache defaults to the context
    model = build("llama")
    assert supports(model, max_completion_length=CONTEXT - 1) == (True, "")
    supported, why = supports(model, max_completion_length=CONTEXT)
    assert not supported and why.startswith(NO_ROOM)


def test_a_prompt_alone_filling_max_seq_len_is_refused():
    supported, why = supports(build("llama"), max_prompt_length=16, max_seq_len=16)
    assert not supported
    assert why.startswith("prompts of up to 16 tokens leave no room for a completion in the engine's max_seq_len=16")


def test_a_layer_kind_the_engine_cannot_honour_is_refused():
    model = tiny_model("qwen2")
    model.config.layer_types = ["full_attention", "chunked_attention"]
    supported, why = supports(model)
    assert not supported
    assert why == (
        "layer 1 is a 'chunked_attention' layer; the engine implements full_attention and sliding_attention layers"
    )


def test_a_window_that_is_not_a_positive_int_is_refused():
    model = build("mistral")
    model.config.sliding_window = 0
    assert supports(model) == (False, "layer 0 has sliding window 0; the engine needs a positive int or None")
    model.config.sliding_window = 4  # a real window is honoured (tests/rollout/model/test_sliding_window.py)
    assert supports(model, max_completion_length=12) == (True, "")


def test_auto_falls_back_with_the_reason_and_an_explicit_engine_raises_it(monkeypatch):
    model = build("llama")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # where "auto" would pick the engine
    assert choose("auto", model, max_completion_length=64)[0] == "engine"
    backend, reason = choose("auto", model, max_completion_length=CONTEXT)
    assert backend == "transformers" and reason.startswith(NO_ROOM)
    with pytest.raises(ValueError, match=r"^generation_backend='engine' cannot serve this run: a prompt of even one"):
        choose("engine", model, max_completion_length=CONTEXT)
    with pytest.raises(ValueError, match=r"^fast_inference=True asks for slimrl's rollout engine, which cannot serve"):
        choose("auto", model, max_completion_length=CONTEXT, fast_inference=True)


def test_the_cache_is_the_max_seq_length_from_pretrained_recorded():
    model = build("llama")
    model.slimrl_options = SimpleNamespace(max_seq_length=64)  # FastLanguageModel.from_pretrained(max_seq_length=64)
    with pytest.raises(ValueError, match="max_completion_length=64 pass the engine's max_seq_len=64"):
        choose("engine", model, max_completion_length=64)
    assert choose("engine", model, max_completion_length=63)[0] == "engine"
    with pytest.raises(ValueError, match="prompts of up to 20 tokens plus max_completion_length=50 pass"):
        choose("engine", model, max_prompt_length=20, max_completion_length=50)


def test_grpo_auto_falls_back_with_one_log_line_and_engine_raises(caplog):
    from tests.trainers.grpo_harness import build_trainer

    caplog.set_level(logging.INFO, logger="slimrl")
    trainer = build_trainer("slimrl", max_completion_length=CONTEXT)
    lines = [r.getMessage() for r in caplog.records if "not slimrl's engine" in r.getMessage()]
    assert trainer._generation_backend == "transformers" and len(lines) == 1 and NO_ROOM in lines[0]
    with pytest.raises(ValueError, match=r"generation_backend='engine' cannot serve this run: a prompt of even one"):
        build_trainer("slimrl", generation_backend="engine", max_completion_length=CONTEXT)


def test_ppo_passes_its_response_length():
    from tests.trainers.test_ppo_trainer import build as build_ppo

    with pytest.raises(ValueError, match=r"generation_backend='engine' cannot serve this run: a prompt of even one"):
        build_ppo(generation_backend="engine", response_length=CONTEXT)


def test_a_prompt_past_what_supports_was_told_fails_at_rollout_time_never_cut():
    # the trainers' engine (generation.local_engine) does not cap completions: a prompt that would leave its
    # completion short of max_new_tokens is an error naming it
    engine = RolloutEngine(no_eos(build("llama")), max_seq_len=16, cap_completions=False)
    assert [len(c) for c in engine.generate([list(range(5, 14))], GREEDY, 7).completion_ids] == [7]  # 9 + 7 fit
    with pytest.raises(ValueError, match=r"prompt 1 has 10 tokens: with max_new_tokens=7 that is 17, past the "
                                         r"engine's max_seq_len=16, .*truncate prompts to 9 tokens"):  # fmt: skip
        engine.generate([[5, 6], list(range(5, 15))], GREEDY, 7)
    with pytest.raises(ValueError, match=r"prompt 0 has 16 tokens, leaving no room under max_seq_len=16; truncate "
                                         r"prompts or raise max_seq_len \(FastLanguageModel"):  # fmt: skip
        engine.generate([list(range(5, 21))], GREEDY, 7)


def test_the_trainers_engine_does_not_cap_completions():
    from slimrl.trainers.rollouts.generation import local_engine

    assert local_engine(build("llama"), None, deterministic=False).cap_completions is False
