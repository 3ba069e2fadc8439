"""slimrl's BCOTrainer (trainers/bco/trainer.py): the chunked step against a plain one-piece BCO step written here
(every log-prob from full logits), the running shift across steps and in evaluation, a short training run that
improves BCO's own objective, and the errors for inputs it cannot use."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from trl.trainer.utils import use_adapter

from slimrl.testing import tiny_model, tiny_tokenizer
from slimrl.trainers.bco.loss import RunningMoments
from slimrl.trainers.bco.trainer import BCOConfig, BCOTrainer
from tests.tolerances import assert_close
from tests.trainers import step_compare
from tests.trainers.grpo_harness import lora_tiny_model
from tests.trainers.kto_harness import kto_dataset, shift_reference_adapter

BETA = 0.5
HISTORY = dict(mean=0.3, var=0.5, std=0.75, count=5.0)  # a running shift as if 5 rewards had been seen


def build(dataset=None, model=None, trainer_kwargs: dict | None = None, **config) -> BCOTrainer:
    settings = dict(output_dir="/tmp/slimrl-test-bco", per_device_train_batch_size=8, report_to="none",
                    save_strategy="no", bf16=False, use_cpu=True, disable_tqdm=True, gradient_checkpointing=False,
                    logging_steps=1, beta=BETA)  # fmt: skip
    settings.update(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' renamed gradient-checkpointing methods
        return BCOTrainer(lora_tiny_model() if model is None else model, args=BCOConfig(**settings),
                          train_dataset=kto_dataset() if dataset is None else dataset,
                          processing_class=tiny_tokenizer(), **(trainer_kwargs or {}))  # fmt: skip


@pytest.fixture(scope="module")
def trainer():
    trainer = build(num_chunks=1)
    shift_reference_adapter(trainer.model)  # policy and reference differ, so the rewards are not all zero
    return trainer


def first_batch(trainer) -> dict:
    return trainer.data_collator([trainer.train_dataset[i] for i in range(8)])


def plain_bco_step(trainer, batch, weights: torch.Tensor | None = None):
    """BCO's step as TRL 0.2x wrote it, from full logits: rewards, the shift folded with them, the mean loss (each
    row's term times its UDM weight when `weights` [N] are given) and its backward. Returns (loss, gradients,
    rewards [N], new shift)."""
    model, mask = trainer.model, batch["completion_mask"][:, 1:]
    model.zero_grad(set_to_none=True)

    def completion_logps():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        token_logps = logits.float().log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
        return (token_logps * mask).sum(-1)  # [N]

    with torch.no_grad(), use_adapter(model, adapter_name="ref"):
        ref_logps = completion_logps()
    rewards = BETA * (completion_logps() - ref_logps)
    n = rewards.numel()
    delta = (HISTORY["mean"] * HISTORY["count"] + rewards.detach().sum()) / (HISTORY["count"] + n)  # a plain mean
    desirable = batch["label"].bool()
    losses = torch.where(desirable, -F.logsigmoid(rewards - delta), -F.logsigmoid(-(rewards - delta)))
    loss = (losses if weights is None else losses * weights).mean()
    loss.backward()
    return loss.detach(), step_compare.trainable_grads(model), rewards.detach(), delta.item()


@pytest.mark.parametrize("num_chunks", [1, 2, 8])
def test_chunked_step_matches_the_one_piece_step(trainer, num_chunks):
    batch = first_batch(trainer)
    trainer.model.train()
    loss_e, grads_e, rewards, delta = plain_bco_step(trainer, step_compare.cloned(batch))
    assert rewards.abs().min() > 1e-4, "the reference must differ from the policy on every row"
    trainer.args.num_chunks = num_chunks
    trainer.running = RunningMoments(**HISTORY)
    loss, grads, metrics = step_compare.loss_grads_metrics(trainer, batch)
    assert grads_e, "the one-piece step gave no gradients"
    step_compare.assert_same_loss_and_grads((loss_e, grads_e), (loss, grads), "one-piece step", nonzero_reference=True)
    desirable = batch["label"].bool()
    assert metrics["delta"] == pytest.approx(delta, rel=1e-5) and trainer.running.mean == pytest.approx(delta, rel=1e-5)
    assert trainer.running.count == pytest.approx(HISTORY["count"] + 8)
    # rewards are differences of log-probs near -80: fp32 leaves them ~1e-5 apart in absolute terms
    assert metrics["rewards/chosen"] == pytest.approx(rewards[desirable].mean().item(), abs=5e-5)
    assert metrics["rewards/rejected"] == pytest.approx(rewards[~desirable].mean().item(), abs=5e-5)
    assert metrics["rewards/margins"] == pytest.approx(metrics["rewards/chosen"] - metrics["rewards/rejected"])
    assert {"logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected"} <= set(metrics)


def test_evaluation_reads_the_shift_without_moving_it(trainer):
    trainer.args.num_chunks = 2
    trainer.running = RunningMoments(**HISTORY)
    loss, grads, metrics = step_compare.loss_grads_metrics(trainer, first_batch(trainer), train=False)
    assert trainer.running == RunningMoments(**HISTORY)
    assert metrics["delta"] == pytest.approx(HISTORY["mean"]) and not grads and torch.isfinite(loss)


def test_running_shift_is_saved_with_a_checkpoint_and_restored(trainer, tmp_path):
    trainer.running = RunningMoments(**HISTORY)
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    trainer._save_optimizer_and_scheduler(str(tmp_path))
    trainer.running = RunningMoments()
    trainer._load_optimizer_and_scheduler(str(tmp_path))
    assert trainer.running == RunningMoments(**HISTORY)


def test_short_training_run_separates_thumbs_up_from_thumbs_down():
    """Eight steps: on the training rows, the rewards of thumbs-up completions rise above those of thumbs-down ones
    (they start equal: the reference is the policy's own initial adapter), and BCO's loss falls below its starting
    value log 2. Evaluation reads the shift the run left."""
    trainer = build(learning_rate=1e-3, max_steps=8, num_chunks=2, logging_steps=4)
    before = trainer.evaluate(trainer.train_dataset)
    trainer.train()
    after = trainer.evaluate(trainer.train_dataset)
    assert before["eval_rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert before["eval_loss"] == pytest.approx(0.6931472, abs=1e-5)
    assert after["eval_rewards/margins"] > 0.3, after
    assert after["eval_loss"] < before["eval_loss"] - 0.05, (before, after)
    assert trainer.running.count == pytest.approx(8 * 8) and after["eval_delta"] == pytest.approx(trainer.running.mean)


def test_prompts_and_completions_are_cut_to_their_limits_and_precomputed_references_are_read():
    """max_length=8 with prompts of 12 tokens: cut to max_prompt_length=5 first, the examples are kept (TRL alone
    would drop them); the precomputed reference is the untrained policy, so every reward is 0 and each loss log 2."""
    rows = [{"prompt": "P" * 12, "completion": "c" * 9, "label": i % 2 == 0} for i in range(4)]
    trainer = build(dataset=Dataset.from_list(rows), model=tiny_model(), max_length=8, max_prompt_length=5,
                    max_completion_length=2, precompute_ref_log_probs=True)  # fmt: skip
    row, full = trainer.train_dataset[0], tiny_tokenizer()("P" * 12)["input_ids"]
    assert len(full) == 12 and row["prompt_ids"] == full[-5:]  # keep_end: the prompt's last tokens
    assert len(row["completion_ids"]) == 2 and len(trainer.train_dataset) == 4
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    loss, _, metrics = step_compare.loss_grads_metrics(trainer, batch)
    assert loss.item() == pytest.approx(0.6931472, abs=1e-5) and metrics["rewards/chosen"] == pytest.approx(0, abs=1e-5)


def test_prompts_filling_max_length_are_dropped_with_a_warning():
    rows = [{"prompt": "P" * (12 if i < 2 else 3), "completion": "c", "label": i % 2 == 0} for i in range(4)]
    with pytest.warns(UserWarning, match=r"2 of 4 examples of the train dataset were dropped .* max_length=8 tokens"):
        trainer = build(dataset=Dataset.from_list(rows), max_length=8)
    assert len(trainer.train_dataset) == 2


def test_precompute_pass_in_chunks_matches_one_piece(trainer):
    batch = first_batch(trainer)
    trainer.args.num_chunks = 1
    whole, _ = trainer.compute_ref_log_probs(trainer.model, batch)
    trainer.args.num_chunks = 3
    rows_per_forward = []
    embeddings = trainer.model.get_input_embeddings()
    hook = embeddings.register_forward_hook(lambda module, args, out: rows_per_forward.append(args[0].size(0)))
    try:
        chunked, none = trainer.compute_ref_log_probs(trainer.model, batch)
    finally:
        hook.remove()
    assert rows_per_forward == [3, 3, 2], "8 rows in 3 chunks: no forward holds more than 3"
    assert none is None and whole.shape == (8,)
    assert_close(chunked, whole, name="reference log-probs")


# -- errors ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("rows", "message"), [
    ([{"prompt": "a", "completion": "b"}], r"without \['label'\]. BCO needs an unpaired dataset with 'prompt'"),
    ([{"prompt": "a", "chosen": "b", "rejected": "c"}], r"paired columns .*unpair_preference_dataset\(train_dataset\)"),
    ([{"prompt": "a", "completion": "b", "label": "good"}], r"'label' column holds 'good' \(str\); BCO needs a"),
    ([{"question": "a", "completion": "b", "label": True}], r"without \['prompt'\]"),
])  # fmt: skip
def test_wrong_columns_are_named_with_the_fix(rows, message):
    with pytest.raises(ValueError, match=message):
        build(dataset=Dataset.from_list(rows), model=tiny_model())


@pytest.mark.parametrize(("setting", "message"), [
    (dict(loss_type="kto"), r"one loss, 'bco'.*slimrl.KTOConfig"),
    (dict(desirable_weight=2.0), r"desirable_weight=2.0 is a KTO setting.*Leave desirable_weight at 1.0"),
    (dict(truncation_mode="middle"), r"truncation_mode must be one of keep_end, keep_start"),
    (dict(max_prompt_length=0), r"max_prompt_length must be a positive number"),
    (dict(prompt_sample_size=0), r"prompt_sample_size must be at least 1 prompt per label, got 0"),
    (dict(min_density_ratio=2.0, max_density_ratio=1.0), r"min_density_ratio must be > 0 and at most max_density"),
])  # fmt: skip
def test_config_refuses_what_bco_has_no_use_for(setting, message):
    with pytest.raises(ValueError, match=message):
        BCOConfig("/tmp/slimrl-test-bco", use_cpu=True, **setting)
