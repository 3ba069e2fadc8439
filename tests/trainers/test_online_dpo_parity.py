"""slimrl's online DPO trainer against unpatched TRL: for the same generated pairs, the same loss, LoRA gradients and
logged stats at every chunk count, for each loss type and each way to rank a pair; the options that change the step;
TRL's one-piece step where chunks cannot reproduce it; the same training curve; and PatchFastRL's rebinding."""

from __future__ import annotations

import inspect
import logging
import math

import pytest
import torch
import trl
from trl.experimental import online_dpo as trl_online_dpo

import slimrl
from slimrl.testing import tiny_model, tiny_prompt_dataset, tiny_tokenizer
from tests.trainers.online_dpo_harness import (
    EOS_BIAS,
    PAIRS,
    answer_reward,
    build_trainer,
    digit_reward,
    perturb_policy,
    prompt_batch,
    scripted_chosen_rows,
    scripted_generation,
    step,
)
from tests.trainers.step_compare import assert_same_step
from tests.trainers.trainer_cache import TrainerCache

RANKINGS = ("functions", "reward_model", "judge")
_trainers: dict[tuple[str, str], object] = TrainerCache()
_expected: dict[tuple[str, str], tuple] = {}


def _pair(ranking: str):
    """TRL's and slimrl's trainers for a ranking, built once, both generating the scripted completions."""
    for kind in ("trl", "slimrl"):
        if (ranking, kind) not in _trainers:
            trainer = _trainers[ranking, kind] = build_trainer(kind, ranking=ranking)
            trainer._generate = scripted_generation(trainer)
    return _trainers[ranking, "trl"], _trainers[ranking, "slimrl"]


@pytest.mark.parametrize("num_chunks", [1, 2, 8])
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
@pytest.mark.parametrize("ranking", RANKINGS)
def test_chunked_step_matches_trl(ranking, loss_type, num_chunks, monkeypatch):
    """Rewards from functions (with the dataset's answer column), a sequence-classifier reward model, or a pairwise
    judge: the same pairs ranked, then TRL's loss, gradients and every stat, whatever the chunk count (8 > 4 pairs:
    one pair per chunk), each chunk scored through the fused LM head."""
    reference, ours = _pair(ranking)
    reference.args.loss_type = ours.args.loss_type = loss_type
    ours.args.num_chunks = num_chunks
    if (ranking, loss_type) not in _expected:
        _expected[ranking, loss_type] = step(reference, prompt_batch())
    expected = _expected[ranking, loss_type]
    chunk_pairs = _spy(monkeypatch, ours, "_chunk_loss", lambda *args: args[3].rows.numel())
    trl_forwards = _spy(monkeypatch, ours, "_forward")
    assert_same_step(expected, step(ours, prompt_batch()), f"{ranking}, {loss_type}, num_chunks={num_chunks}")
    assert sorted(chunk_pairs) == [PAIRS // min(num_chunks, PAIRS)] * min(num_chunks, PAIRS), "chunks of pairs"
    assert not trl_forwards, "a chunk ran TRL's forward (full logits) instead of the fused head"
    chosen = scripted_chosen_rows(reference, prompt_batch())
    assert min(chosen) < PAIRS <= max(chosen), f"{ranking}: chosen rows {chosen} are all in one half"
    assert expected[2]["objective/kl"] != 0.0, "the policy equals the reference: nothing to compare"


def _spy(monkeypatch, trainer, method: str, record=lambda *args: args) -> list:
    """Records (what `record` makes of the arguments of) every call of `trainer.<method>`."""
    calls, original = [], getattr(trainer, method)

    def spy(*args, **kwargs):
        calls.append(record(*args, **kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(trainer, method, spy)
    return calls


# (case id, config, move the policy off a deep-copied reference model)
OPTION_CASES = [
    ("reference_model_copy", dict(peft="model"), True),  # a PeftModel without peft_config: TRL copies it
    ("missing_eos_penalty", dict(missing_eos_penalty=1.0), False),
    ("grad_accumulation", dict(gradient_accumulation_steps=2), False),  # TRL backpropagates the undivided loss
    ("beta_schedule_first_epoch", dict(beta=[0.3, 0.1]), False),
    ("prompt_cut_on_the_left", dict(max_length=20), False),  # prompt + completion > max_length
    ("prompt_cut_away", dict(max_length=16), False),  # completions fill max_length: TRL's own forward per chunk
    ("gradient_checkpointing", dict(gradient_checkpointing=True), False),
]


@pytest.mark.parametrize("case_id,config,perturb", OPTION_CASES, ids=[c[0] for c in OPTION_CASES])
def test_options_match_trl(case_id, config, perturb, monkeypatch):
    reference, ours = build_trainer("trl", **config), build_trainer("slimrl", num_chunks=3, **config)
    for trainer in (reference, ours):
        trainer._generate = scripted_generation(trainer)
        if perturb:
            perturb_policy(trainer)
    expected = step(reference, prompt_batch())
    trl_forwards = _spy(monkeypatch, ours, "_forward")
    assert_same_step(expected, step(ours, prompt_batch()), case_id)
    # policy and reference, 3 chunks each, when the prompt is cut away; else the fused head only
    assert len(trl_forwards) == (6 if case_id == "prompt_cut_away" else 0), f"{case_id}: TRL's forward calls"
    assert expected[2]["objective/kl"] != 0.0, f"{case_id}: the policy equals the reference"
    if case_id == "missing_eos_penalty":  # one of the 8 scripted completions has no EOS
        unpenalised = step(_pair("functions")[0], prompt_batch())[2]["objective/scores"]
        assert expected[2]["objective/scores"] == pytest.approx(unpenalised - 1.0 / 8)
    if case_id == "beta_schedule_first_epoch":
        assert expected[2]["beta"] == 0.3


def test_active_dropout_runs_trls_step_and_matches(caplog):
    """LoRA dropout left on (disable_dropout=False): chunked forwards would draw other masks, so TRL's one-piece step
    runs, with one warning naming the reason, and gives TRL's results from the same RNG state."""
    config = dict(disable_dropout=False, lora_dropout=0.3)
    reference, ours = build_trainer("trl", **config), build_trainer("slimrl", num_chunks=2, **config)
    for trainer in (reference, ours):
        trainer._generate = scripted_generation(trainer)
    expected = step(reference, prompt_batch(), seed=3)
    with caplog.at_level(logging.WARNING, logger="slimrl.trainers"):
        actual = step(ours, prompt_batch(), seed=3)
    assert "one piece (TRL's path) because dropout is active" in caplog.text
    assert_same_step(expected, actual, "active dropout")


def test_unknown_loss_type_fails_as_in_trl(caplog):
    reference, ours = _pair("functions")
    try:
        reference.args.loss_type = ours.args.loss_type = "hinge"
        with pytest.raises(NotImplementedError, match="invalid loss type hinge"):
            step(reference, prompt_batch())
        with caplog.at_level(logging.WARNING, logger="slimrl.trainers"):
            with pytest.raises(NotImplementedError, match="invalid loss type hinge"):
                step(ours, prompt_batch())
    finally:
        reference.args.loss_type = ours.args.loss_type = "sigmoid"
    assert "because loss_type 'hinge' is not one slimrl knows how to chunk" in caplog.text


def assert_same_logs(reference: list[dict], ours: list[dict]) -> None:
    assert len(ours) == len(reference) and reference
    for index, (expected, actual) in enumerate(zip(reference, ours, strict=True)):
        assert set(expected) <= set(actual), f"entry {index}: missing {set(expected) - set(actual)}"
        for name, value in expected.items():
            if name in ("train_runtime", "train_samples_per_second", "train_steps_per_second"):
                continue
            if isinstance(value, float) and math.isnan(value):
                assert math.isnan(actual[name]), f"entry {index}: {name}"
            elif isinstance(value, (int, float)):
                # three optimizer steps carry the first step's fp32 summation-order difference forward through Adam
                assert actual[name] == pytest.approx(value, rel=1e-4, abs=1e-6), f"entry {index}: {name}"


def test_train_curve_patched_equals_unpatched():
    """trl.experimental.online_dpo's trainer before and after PatchFastRL("online_dpo") (then slimrl's, in 3
    chunks): 3 optimizer steps of sampled pairs (TRL's generate), 2 micro-batches each, give the same log."""
    config = dict(max_steps=3, logging_steps=1, learning_rate=5e-3, seed=7, max_new_tokens=8,
                  gradient_accumulation_steps=2, generation_kwargs=EOS_BIAS,
                  reward_funcs=[answer_reward, digit_reward])  # fmt: skip
    logs = {}
    for patched in (False, True):
        if patched:
            slimrl.PatchFastRL("online_dpo")
        try:
            trainer = build_trainer("trl", **config)
            if patched:
                assert isinstance(trainer, slimrl.OnlineDPOTrainer)
                trainer.args.num_chunks = 3
            trainer.train()
        finally:
            slimrl.unpatch("online_dpo")
        logs[patched] = trainer.state.log_history
    assert_same_logs(logs[False], logs[True])
    losses = [entry["loss"] for entry in logs[False] if "loss" in entry]
    assert len(losses) == 3 and any(entry.get("objective/kl", 0.0) != 0.0 for entry in logs[False])


def test_patch_fast_rl_rebinds_and_unpatch_restores():
    from trl.experimental.online_dpo import online_dpo_config, online_dpo_trainer

    originals = (trl_online_dpo.OnlineDPOTrainer, trl_online_dpo.OnlineDPOConfig)
    modules = (trl_online_dpo, online_dpo_trainer, online_dpo_config)
    slimrl.PatchFastRL("online_dpo")
    slimrl.PatchFastRL("online_dpo")  # idempotent
    try:
        assert trl_online_dpo.OnlineDPOTrainer is slimrl.OnlineDPOTrainer
        assert online_dpo_trainer.OnlineDPOTrainer is slimrl.OnlineDPOTrainer
        assert trl_online_dpo.OnlineDPOConfig is online_dpo_config.OnlineDPOConfig is slimrl.OnlineDPOConfig
        assert issubclass(slimrl.OnlineDPOTrainer, originals[0]) and issubclass(slimrl.OnlineDPOConfig, originals[1])
    finally:
        slimrl.unpatch("online_dpo")
    assert (trl_online_dpo.OnlineDPOTrainer, trl_online_dpo.OnlineDPOConfig) == originals
    assert online_dpo_trainer.OnlineDPOTrainer is originals[0] and online_dpo_config.OnlineDPOConfig is originals[1]
    slimrl.PatchFastRL("all")
    try:
        assert all(module.OnlineDPOTrainer is slimrl.OnlineDPOTrainer for module in modules[:2])
    finally:
        slimrl.unpatch()
    assert trl_online_dpo.OnlineDPOTrainer is originals[0]


def test_constructor_takes_trls_arguments_and_config(tmp_path, monkeypatch):
    """TRL's signature; a plain TRL config gains slimrl's fields at their defaults, and args=None (on which TRL
    fails) gets slimrl's config."""
    monkeypatch.chdir(tmp_path)  # args=None writes to ./<model name>-OnlineDPO
    ours = inspect.signature(slimrl.OnlineDPOTrainer.__init__)
    theirs = inspect.signature(trl_online_dpo.OnlineDPOTrainer.__init__)
    assert [(p.name, p.default, p.kind) for p in ours.parameters.values()] == [
        (p.name, p.default, p.kind) for p in theirs.parameters.values()
    ]
    args = trl_online_dpo.OnlineDPOConfig(output_dir="/tmp/slimrl-test-online-dpo", use_cpu=True, bf16=False,
                                          report_to="none")  # fmt: skip
    trainer = slimrl.OnlineDPOTrainer(tiny_model(), reward_funcs=digit_reward, args=args,
                                      train_dataset=tiny_prompt_dataset(),
                                      processing_class=tiny_tokenizer())  # fmt: skip
    assert (trainer.args.num_chunks, trainer.args.generation_backend) == ("auto", "auto")
    assert trainer.generation_backend == "transformers" or torch.cuda.is_available()
    default = slimrl.OnlineDPOTrainer(tiny_model(), reward_funcs=digit_reward, train_dataset=tiny_prompt_dataset(),
                                      processing_class=tiny_tokenizer())  # fmt: skip
    assert isinstance(default.args, slimrl.OnlineDPOConfig) and default.args.num_chunks == "auto"
    assert default.args.output_dir.endswith("-OnlineDPO")
    assert trl.__version__.startswith("1.16")


def test_on_nonfinite_skip_drops_a_nan_step_and_logs_it_in_trls_stats(monkeypatch):
    """Online DPO logs through `self.stats`, not `_metrics`: a skipped step is counted there too."""
    trainer = build_trainer("slimrl", max_steps=3, logging_steps=1, learning_rate=5e-3, seed=7, max_new_tokens=8,
                            generation_kwargs=EOS_BIAS, reward_funcs=[answer_reward, digit_reward], num_chunks=2,
                            on_nonfinite="skip")  # fmt: skip
    chunk_loss = trainer._chunk_loss

    def poisoned(*args, **kwargs):  # every chunk of the second optimizer step has a NaN loss
        loss, stats = chunk_loss(*args, **kwargs)
        return (loss * math.nan if trainer.state.global_step == 1 else loss), stats

    monkeypatch.setattr(trainer, "_chunk_loss", poisoned)
    trainer.train()
    skipped = [entry["nonfinite_skipped"] for entry in trainer.state.log_history if "nonfinite_skipped" in entry]
    assert skipped == [0.0, 1.0, 0.0], skipped
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
