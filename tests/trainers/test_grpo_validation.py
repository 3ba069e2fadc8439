"""Settings and inputs TRL lets through but that cannot work: each is an error (or warning) that names the fix."""

from __future__ import annotations

import pytest

import slimrl
from slimrl.testing import tiny_prompt_dataset
from tests.trainers.grpo_harness import build_trainer, lora_tiny_model


def config(**overrides):
    settings = dict(output_dir="/tmp/slimrl-test-validation", report_to="none", bf16=False, use_cpu=True,
                    per_device_train_batch_size=4, num_generations=4)  # fmt: skip
    settings.update(overrides)
    return slimrl.GRPOConfig(**settings)


def test_generation_batch_not_divisible_by_num_generations():
    with pytest.raises(ValueError, match=r"holds 6 completions.*not a multiple of num_generations=4.*multiple of 4"):
        config(per_device_train_batch_size=3, steps_per_generation=2)


@pytest.mark.parametrize("config_cls", [slimrl.GRPOConfig, slimrl.RLOOConfig], ids=["grpo", "rloo"])
def test_a_world_size_that_does_not_divide_the_generation_batch(monkeypatch, config_cls):
    # 3 processes (as `accelerate launch --num_processes 3` would give) x 4 completions a micro-step = 12 a pass,
    # and a generation batch of 16 completions does not split into such passes
    monkeypatch.setattr(config_cls, "world_size", property(lambda self: 3))
    with pytest.raises(ValueError, match=r"generation_batch_size=16 cannot be split over 3 processes.*not a multiple "
                                         r"of 12.*multiple of 12.*steps_per_generation.*divides 4"):  # fmt: skip
        config_cls(output_dir="/tmp/slimrl-test-validation", report_to="none", bf16=False, use_cpu=True,
                   per_device_train_batch_size=4, num_generations=4, generation_batch_size=16)


def test_fewer_than_two_generations():
    with pytest.raises(ValueError, match=r"num_generations=1.*at least 2 generations.*Set num_generations to 2"):
        config(num_generations=1, per_device_train_batch_size=1)


@pytest.mark.parametrize("temperature", [0.0, -0.5])
def test_non_positive_temperature(temperature):
    with pytest.raises(ValueError, match=r"temperature=.*must be > 0.*Use e\.g\. 1\.0"):
        config(temperature=temperature)


def test_absurd_learning_rate_warns():
    with pytest.warns(UserWarning, match=r"learning_rate=0\.5 is far above what LoRA.*5e-6 to 5e-4"):
        config(learning_rate=0.5)


def test_negative_learning_rate_is_an_error():
    with pytest.raises(ValueError, match=r"learning_rate=-0\.001 must be positive"):
        config(learning_rate=-1e-3)


@pytest.mark.parametrize("bad", [0, -2, "many", True])
def test_num_chunks_range(bad):
    with pytest.raises(ValueError, match=r"num_chunks must be a positive integer or 'auto'"):
        config(num_chunks=bad)


def test_num_chunks_accepts_digit_strings_from_the_command_line():
    assert config(num_chunks="4").num_chunks == 4 and config(num_chunks="auto").num_chunks == "auto"


def test_max_completion_length_beyond_the_position_embeddings_warns():
    """transformers' RoPE runs past max_position_embeddings and TRL trains there, so it is a warning, not an error."""
    from slimrl.testing import tiny_tokenizer

    args = config(max_completion_length=600)
    with pytest.warns(UserWarning, match=r"max_completion_length=600 does not fit the model's context of 512.*Lower"):
        slimrl.GRPOTrainer(model=lora_tiny_model(), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                           args=args, train_dataset=tiny_prompt_dataset(), processing_class=tiny_tokenizer())


def test_max_completion_length_beyond_max_seq_length_is_an_error():
    model = lora_tiny_model()
    model.slimrl_options = type("Options", (), {"max_seq_length": 256})()  # as FastLanguageModel records it
    with pytest.raises(ValueError, match=r"max_completion_length=300 does not fit the model's context of 256 tokens "
                                         r"\(max_seq_length given to FastLanguageModel"):  # fmt: skip
        build_trainer("slimrl", model=model, max_completion_length=300)


# reward functions that raise or return what TRL cannot use: tests/trainers/test_reward_semantics.py (every trainer)


def test_dataset_without_prompt_column():
    dataset = tiny_prompt_dataset().rename_column("prompt", "question")
    with pytest.raises(ValueError, match=r"needs a 'prompt' column.*rename_column\('question', 'prompt'\)"):
        build_trainer("slimrl", dataset=dataset)


def test_default_precision_falls_back_to_fp32_without_a_bf16_gpu():
    """TRL defaults to bf16 and transformers then refuses to run on a CPU; slimrl's config picks fp32 there."""
    settings = dict(output_dir="/tmp/slimrl-test-validation", report_to="none", per_device_train_batch_size=4,
                    num_generations=4)  # fmt: skip
    assert slimrl.GRPOConfig(use_cpu=True, **settings).bf16 is False
    assert slimrl.GRPOConfig(use_cpu=True, bf16=True, **settings).bf16 is True  # an explicit request is honoured


def test_memory_saver_settings_are_validated():
    with pytest.raises(ValueError, match=r"mlp_tile_tokens must be >= 0"):
        config(mlp_tile_tokens=-1)
    with pytest.raises(ValueError, match=r"keep_attention_tokens must be >= 0"):
        config(keep_attention_tokens=-1)
    with pytest.raises(ValueError, match=r"offload_checkpoints=True.*gradient_checkpointing is False"):
        config(offload_checkpoints=True, gradient_checkpointing=False)
    # DDP's static graph fails on the chunked step's no_sync passes (tests/distributed/test_ddp_tiles.py)
    with pytest.raises(ValueError, match=r"ddp_static_graph=True cannot be honoured.*Set ddp_static_graph=False"):
        config(ddp_static_graph=True)
    assert config(ddp_static_graph=False).ddp_static_graph is False


def test_plain_trl_config_gets_slimrl_defaults():
    import trl

    from tests.trainers.grpo_harness import zero_reward

    args = trl.GRPOConfig(output_dir="/tmp/slimrl-test-validation", report_to="none", bf16=False, use_cpu=True,
                          per_device_train_batch_size=4, num_generations=4, max_completion_length=16)  # fmt: skip
    trainer = build_trainer("slimrl", reward_funcs=zero_reward)
    trainer = type(trainer)(model=lora_tiny_model(), reward_funcs=zero_reward, args=args,
                            train_dataset=tiny_prompt_dataset(), processing_class=trainer.processing_class)  # fmt: skip
    assert trainer.args.num_chunks == "auto" and trainer.args.mlp_tile_tokens == 8192
    assert trainer.args.offload_checkpoints is None
