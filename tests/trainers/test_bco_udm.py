"""slimrl's BCOTrainer with density-ratio matching (UDM: embedding_func + embedding_tokenizer, trainers/bco/udm.py):
the weights the datasets carry, the chunked step against a plain weighted one-piece step, a short training run, the
classifier's prompt sample, and the errors for inputs UDM cannot use."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset

from slimrl.testing import tiny_model, tiny_tokenizer
from slimrl.trainers.bco import udm
from slimrl.trainers.bco.density_ratio import fit_density_ratio_classifier
from slimrl.trainers.bco.loss import RunningMoments
from tests.tolerances import assert_close
from tests.trainers import step_compare
from tests.trainers.kto_harness import kto_dataset, kto_rows, shift_reference_adapter
from tests.trainers.test_bco_trainer import HISTORY, build, first_batch, plain_bco_step

ZERO_ID = tiny_tokenizer().convert_tokens_to_ids("0")


def embed_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, 11] for prompts "Q<digit>:...": the digit one-hot, then the count of attended tokens / 8."""
    digit = F.one_hot(input_ids[:, 1] - ZERO_ID, 10).float()
    return torch.cat([digit, attention_mask.float().sum(-1, keepdim=True) / 8], dim=-1)


UDM = dict(embedding_func=embed_prompts, embedding_tokenizer=tiny_tokenizer())


def prompt_features(prompt: str) -> list[float]:
    """embed_prompts' features from the text itself (the tiny tokenizer has one token per ASCII character)."""
    return [float(int(prompt[1]) == digit) for digit in range(10)] + [len(prompt) / 8]


def expected_weights(trainer, dataset) -> torch.Tensor:
    """[N] by the definition: 1 for thumbs-up rows; for thumbs-down ones the odds of the trainer's classifier at the
    prompt's features, p / (1 - p + 1e-8), clamped to [0.5, 10] (BCOConfig's defaults)."""
    features = torch.tensor([prompt_features(p) for p in dataset["prompt"]], dtype=torch.float64)
    p = torch.sigmoid(features @ trainer.clf.weight + trainer.clf.bias)
    ratio = (p / (1 - p + 1e-8)).clamp(0.5, 10.0)
    return torch.where(torch.tensor(dataset["label"]), torch.ones_like(ratio), ratio)


@pytest.fixture(scope="module")
def trainer():
    trainer = build(num_chunks=1, trainer_kwargs=UDM)
    shift_reference_adapter(trainer.model)  # policy and reference differ, so the rewards are not all zero
    return trainer


def test_the_classifier_is_fit_on_the_prompts_and_thumbs_down_rows_carry_their_density_ratio(trainer):
    dataset = trainer.train_dataset
    # 10 thumbs-up and 6 thumbs-down rows, all under prompt_sample_size 1024: the classifier is the fit on every row
    features = torch.tensor([prompt_features(p) for p in dataset["prompt"]], dtype=torch.float64)
    refit = fit_density_ratio_classifier(features, torch.tensor(dataset["label"]))
    assert_close(trainer.clf.weight, refit.weight, name="classifier weight")
    assert trainer.clf.bias == pytest.approx(refit.bias, rel=1e-6)
    expected = expected_weights(trainer, dataset)
    assert_close(dataset[udm.WEIGHT_COLUMN], expected, name="udm_weight column")
    down = expected[~torch.tensor(dataset["label"])]
    assert (down - 1).abs().min() > 0.1, f"the test needs thumbs-down weights away from 1: {down}"
    assert (down == 0.5).any(), f"the test needs a thumbs-down weight clamped to min_density_ratio: {down}"
    batch = first_batch(trainer)
    assert_close(batch[udm.WEIGHT_COLUMN], expected[:8], name="the batch's weights")


@pytest.mark.parametrize("num_chunks", [1, 2, 8])
def test_chunked_step_with_udm_matches_the_weighted_one_piece_step(trainer, num_chunks):
    batch = first_batch(trainer)
    trainer.model.train()
    weights = expected_weights(trainer, trainer.train_dataset)[:8].float()
    loss_e, grads_e, rewards, delta = plain_bco_step(trainer, step_compare.cloned(batch), weights)
    assert rewards.abs().min() > 1e-4, "the reference must differ from the policy on every row"
    trainer.args.num_chunks = num_chunks
    trainer.running = RunningMoments(**HISTORY)
    loss, grads, metrics = step_compare.loss_grads_metrics(trainer, batch)
    assert grads_e, "the one-piece step gave no gradients"
    step_compare.assert_same_loss_and_grads((loss_e, grads_e), (loss, grads), "one-piece step", nonzero_reference=True)
    assert metrics["delta"] == pytest.approx(delta, rel=1e-5)


def test_a_collator_replaced_after_construction_is_refused(trainer):
    batch = first_batch(trainer)
    del batch[udm.WEIGHT_COLUMN]
    with pytest.raises(ValueError, match=r"no 'udm_weight'.*Pass a custom collator to BCOTrainer as data_collator"):
        step_compare.loss_grads_metrics(trainer, batch)


def test_short_training_run_with_udm_lowers_the_weighted_loss():
    """Eight steps. Before training the reference is the policy, every reward 0 and each row's loss log 2 times its
    weight: the evaluation loss (two batches of 8) is log 2 times the mean weight. Training lowers it and separates
    thumbs-up rewards from thumbs-down ones."""
    trainer = build(learning_rate=1e-3, max_steps=8, num_chunks=2, logging_steps=4, trainer_kwargs=UDM)
    weights = expected_weights(trainer, trainer.train_dataset)
    before = trainer.evaluate(trainer.train_dataset)
    assert before["eval_loss"] == pytest.approx(math.log(2) * weights.mean().item(), rel=1e-5)
    trainer.train()
    after = trainer.evaluate(trainer.train_dataset)
    assert after["eval_loss"] < before["eval_loss"] - 0.05, (before, after)
    assert after["eval_rewards/margins"] > 0.3, after


def test_precomputed_references_and_udm_weights_travel_together():
    """precompute_ref_log_probs: the reference is the untrained policy, every reward 0, so the loss of the batch is
    log 2 times its mean weight."""
    trainer = build(dataset=kto_dataset(8), model=tiny_model(), precompute_ref_log_probs=True, trainer_kwargs=UDM)
    batch = first_batch(trainer)
    assert {"ref_logps", udm.WEIGHT_COLUMN} <= set(batch)
    weights = expected_weights(trainer, trainer.train_dataset)
    loss, _, _ = step_compare.loss_grads_metrics(trainer, batch)
    assert loss.item() == pytest.approx(math.log(2) * weights.mean().item(), rel=1e-5)


class RecordingEmbedder:
    """Stands in for udm.PromptEmbedder: records the prompts it is given; each prompt's feature is its number."""

    def __init__(self):
        self.calls = []

    def __call__(self, prompts: list) -> torch.Tensor:
        self.calls.append(list(prompts))
        return torch.tensor([[float(prompt.split()[1])] for prompt in prompts])


def test_the_classifier_sees_a_seeded_sample_of_each_label():
    """prompt_sample_size=3 of 6 thumbs-up and 4 thumbs-down rows: 3 distinct prompts of each label, the same for the
    same seed (every process, a resumed run)."""
    labels = [True, True, False, True, False, True, False, True, True, False]
    dataset = Dataset.from_list([{"prompt": f"prompt {i}", "label": label} for i, label in enumerate(labels)])

    def sample(seed: int) -> list[list[str]]:
        embed = RecordingEmbedder()
        udm.fit_classifier(dataset, embed, SimpleNamespace(seed=seed, prompt_sample_size=3))
        return embed.calls

    up, down = sample(seed=0)
    assert len(set(up)) == 3 and all(labels[int(p.split()[1])] for p in up)
    assert len(set(down)) == 3 and not any(labels[int(p.split()[1])] for p in down)
    assert sample(seed=0) == [up, down]
    assert any(sample(seed) != [up, down] for seed in (1, 2, 3)), "the seed must choose the sample"


def test_conversational_prompts_are_embedded_as_rendered_by_the_chat_template():
    embed = udm.PromptEmbedder(embed_prompts, tiny_tokenizer(), tiny_tokenizer(), batch_size=2, device="cpu")
    assert embed.text([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert embed.text("Q1:xx") == "Q1:xx"
    # three prompts in batches of 2, right-padded: each row's features are its own text's
    prompts = ["Q1:xx", "Q2:", "Q7"]
    assert_close(embed(prompts), [prompt_features(p) for p in prompts], name="features")


# -- errors ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(embedding_func=embed_prompts), r"needs both .* only embedding_func was given. Pass embedding_tokenizer too"),
    (dict(embedding_tokenizer=tiny_tokenizer()), r"only embedding_tokenizer was given. Pass embedding_func too"),
    (dict(embedding_func="mean", embedding_tokenizer=tiny_tokenizer()), r"embedding_func must be a function"),
])  # fmt: skip
def test_udm_arguments_are_both_or_neither(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build(model=tiny_model(), trainer_kwargs=kwargs)


def test_a_train_dataset_without_thumbs_down_rows_cannot_fit_the_classifier():
    dataset = Dataset.from_list(kto_rows(4, labels=[True]))
    with pytest.raises(ValueError, match=r"train_dataset has 4 thumbs-up and 0 thumbs-down rows. Add rows of the "
                                         r"missing label, or drop embedding_func"):  # fmt: skip
        build(dataset=dataset, model=tiny_model(), trainer_kwargs=UDM)


@pytest.mark.parametrize(("func", "message"), [
    (lambda input_ids, attention_mask: input_ids[..., None].float(), r"for 8 prompts it returned \(8, \d+, 1\)\."),
    (lambda input_ids, attention_mask: input_ids.float(), r"for 2 prompts it returned \(2, \d+\) after \[batch, \d+\]"),
])  # fmt: skip
def test_an_embedding_func_without_pooling_is_refused(func, message):
    """Per-token states ([B, T, 1]), or a [B, T] whose width changes with the batch's longest prompt (the 10 thumbs-up
    rows are embedded in batches of 8 and 2)."""
    with pytest.raises(ValueError, match=r"one embedding per prompt, a \[batch, dim\] tensor .*" + message):
        build(model=tiny_model(), trainer_kwargs=dict(UDM, embedding_func=func))


def test_a_streamed_dataset_is_refused():
    with pytest.raises(ValueError, match=r"train_dataset \(IterableDataset\) is not a map-style .*streaming=False"):
        build(dataset=kto_dataset().to_iterable_dataset(), model=tiny_model(), max_steps=1, trainer_kwargs=UDM)
