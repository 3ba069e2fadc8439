"""slimrl's PRMTrainer on a tiny token-classification model: the chunked step gives the one-piece loss and gradient
(and, in evaluation, the model's logits); a short CPU run learns a step rule (loss falls, step accuracy rises); inputs
and settings that cannot work are refused with the fix in the message."""

from __future__ import annotations

import random

import pytest
import torch
from datasets import Dataset
from transformers import LlamaForTokenClassification, TrainingArguments

from slimrl.testing import tiny_config, tiny_tokenizer
from slimrl.trainers.prm.trainer import PRMConfig, PRMTrainer
from tests.tolerances import assert_close


@pytest.fixture(autouse=True)
def one_thread():
    """One CPU thread: the tiny model's ops last microseconds, so a second thread only adds waiting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def step_rows(n: int, seed: int) -> Dataset:
    """The toy rule: a step (1-4 digits, then '+' or '-') is correct iff it ends with '+'; 1-3 steps per row."""
    rng, rows = random.Random(seed), []
    for i in range(n):
        good = [rng.random() < 0.5 for _ in range(rng.randint(1, 3))]
        steps = ["".join(rng.choices("0123456789", k=rng.randint(1, 4))) + ("+" if ok else "-") for ok in good]
        rows.append({"prompt": f"Q{i % 10}:", "completions": steps, "labels": good})
    return Dataset.from_list(rows)


def prm_model(seed: int = 0, num_labels: int = 2) -> LlamaForTokenClassification:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForTokenClassification(tiny_config(num_labels=num_labels))


def build(model=None, train_dataset=None, eval_dataset=None, **config) -> PRMTrainer:
    settings = dict(per_device_train_batch_size=8, per_device_eval_batch_size=16, max_steps=20, learning_rate=3e-3,
                    logging_steps=5, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
                    gradient_checkpointing=False, num_chunks=1, seed=0)  # fmt: skip
    settings.update(config)
    args = PRMConfig("/tmp/slimrl-test-prm", **settings)
    return PRMTrainer(model or prm_model(), args, train_dataset=train_dataset or step_rows(16, 1),
                      eval_dataset=eval_dataset, processing_class=tiny_tokenizer())  # fmt: skip


def one_batch(trainer: PRMTrainer) -> dict:
    """The first 8 tokenised rows collated: lengths differ, so chunks cut different widths."""
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    assert len(set(batch["attention_mask"].sum(1).tolist())) > 2  # the chunks drop different amounts of padding
    return batch


def gradients(model) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("num_chunks", [1, 2, 8])
def test_chunked_loss_and_gradients_are_the_one_piece_ones(num_chunks):
    """The model's own loss (transformers' mean cross-entropy over labelled tokens, one forward over the batch) is
    the reference: the chunks' summed loss and gradient equal it."""
    reference_model = prm_model().eval()  # its classifier dropout off, as the trainer's disable_dropout does
    trainer = build(num_chunks=num_chunks)
    batch = one_batch(trainer)
    expected = reference_model(**batch).loss
    expected.backward()
    expected_grads = gradients(reference_model)
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    assert_close(loss, expected, name=f"loss, {num_chunks} chunks")
    grads = gradients(trainer.model)
    assert grads.keys() == expected_grads.keys() and "score.weight" in grads
    for name, grad in grads.items():
        scale = expected_grads[name].abs().max().clamp(min=1e-12)
        assert_close(grad / scale, expected_grads[name] / scale, "grad_fp32", name=f"{name}, {num_chunks} chunks")


def test_evaluation_in_chunks_returns_the_models_loss_and_logits():
    trainer = build(num_chunks=3)
    batch = one_batch(trainer)
    with torch.no_grad():
        expected = prm_model().eval()(**batch)
        loss, outputs = trainer.compute_loss(trainer.model, batch, return_outputs=True)
    assert_close(loss, expected.loss, name="eval loss")
    attended = batch["attention_mask"].bool()  # padded positions are left at 0 (no label reads them)
    assert_close(outputs.logits[attended], expected.logits[attended], name="logits")


def test_outputs_with_gradients_run_in_one_piece_with_the_same_loss(caplog):
    """return_outputs=True with grad on asks for logits attached to the whole batch's graph: the Trainer's one-piece
    loss (the model's own) runs, with the reason logged, and gives the chunked path's value."""
    trainer = build(num_chunks=4)
    batch = one_batch(trainer)
    chunked = trainer.compute_loss(trainer.model, batch).detach()
    with caplog.at_level("WARNING", logger="slimrl.trainers"):
        loss, outputs = trainer.compute_loss(trainer.model, batch, return_outputs=True)
    assert "one piece" in caplog.text and "return_outputs=True" in caplog.text
    assert outputs.logits.requires_grad and outputs.logits.shape == (*batch["input_ids"].shape, 2)
    assert_close(loss, chunked, name="one-piece loss")


def test_a_short_run_learns_the_step_rule():
    """Loss falls and step accuracy on held-out rows rises from chance to nearly every step."""
    trainer = build(train_dataset=step_rows(64, 1), eval_dataset=step_rows(32, 2), num_chunks=2)
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 4 and losses[-1] < 0.5 * losses[0], losses
    assert after["eval_loss"] < 0.5 * before["eval_loss"], (before, after)
    assert before["eval_accuracy"] < 0.7 and after["eval_accuracy"] > 0.9, (before, after)


def test_train_on_last_step_only_trains_on_one_label_per_row():
    trainer = build(train_on_last_step_only=True, eval_dataset=step_rows(4, 2))
    for row in trainer.train_dataset:
        assert sum(label != -100 for label in row["labels"]) == 1 and row["labels"][-1] in (0, 1)
    steps = [len(row["completions"]) for row in step_rows(4, 2)]
    assert [sum(label != -100 for label in row["labels"]) for row in trainer.eval_dataset] == steps


@pytest.mark.parametrize(("change", "error", "message"), [
    (dict(train_dataset=Dataset.from_list([{"prompt": "Q", "completion": "a", "label": True}])), ValueError,
     r"needs \['prompt', 'completions', 'labels'\].*Missing: \['completions', 'labels'\]"),
    (dict(train_dataset=Dataset.from_list([{"prompt": "Q", "completions": ["a", "b"], "labels": [True]}])),
     ValueError, r"2 steps in 'completions' but 1 values in 'labels'"),
    (dict(model=prm_model(num_labels=1)), ValueError, r"num_labels=1.*num_labels=2"),
])  # fmt: skip
def test_inputs_that_cannot_work_are_refused_with_the_fix(change, error, message):
    with pytest.raises(error, match=message):
        build(**change)


def test_settings_that_cannot_work_are_refused_with_the_fix():
    with pytest.raises(TypeError, match="must be a slimrl PRMConfig"):
        PRMTrainer(prm_model(), TrainingArguments("/tmp/slimrl-test-prm", use_cpu=True), train_dataset=step_rows(2, 0),
                   processing_class=tiny_tokenizer())  # fmt: skip
    with pytest.raises(ValueError, match="step_separator must be a non-empty string"):
        PRMConfig("/tmp/slimrl-test-prm", step_separator="", use_cpu=True)
    with pytest.raises(ValueError, match="max_length must be a positive number of tokens"):
        PRMConfig("/tmp/slimrl-test-prm", max_length=0, use_cpu=True)
