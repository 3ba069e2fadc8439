"""Inputs TRL's KTOTrainer fails on with a bare KeyError or TypeError, or accepts silently: each is an error (or a
warning) that names the fix. And what must keep working: paired datasets, 0/1 labels, plain TRL configs."""

from __future__ import annotations

import inspect
import warnings

import pytest
import trl
from datasets import Dataset, IterableDataset

import slimrl
from slimrl.testing import tiny_model, tiny_tokenizer
from tests.trainers.grpo_harness import lora_tiny_model
from tests.trainers.kto_harness import build_trainer, first_batch, kto_dataset, kto_rows, loss_grads_metrics


def dataset_with(**columns) -> Dataset:
    """The harness's unpaired rows with columns replaced (a value per row from a function of the row index) or
    removed (None)."""
    rows = kto_rows(8)
    for i, row in enumerate(rows):
        for name, value in columns.items():
            if value is None:
                row.pop(name)
            else:
                row[name] = value(i)
    return Dataset.from_list(rows)


@pytest.mark.parametrize("missing", ["label", "prompt", "completion"])
def test_unpaired_dataset_missing_a_column(missing):
    dataset = dataset_with(**{missing: None})
    with pytest.raises(ValueError, match=rf"train_dataset has columns \[.*\], without \['{missing}'\]\. KTO needs an "
                                         r"unpaired dataset with 'prompt', 'completion' and a boolean 'label'.*"
                                         r"or a paired preference dataset with 'chosen' and 'rejected'"):  # fmt: skip
        build_trainer("slimrl", dataset=dataset)


@pytest.mark.parametrize(
    "label,shown",
    [
        (lambda i: "good" if i % 2 else "bad", r"'bad' \(str\), 'good' \(str\)"),
        (lambda i: 2 * (i % 2), r"2 \(int\)"),  # TRL would count a 2 as two desirable rows in its metrics
        (lambda i: 0.5, r"0\.5 \(float\)"),
    ],
    ids=["strings", "integers_beyond_0_1", "fractions"],
)
def test_labels_that_are_not_booleans(label, shown):
    with pytest.raises(ValueError, match=rf"train_dataset's 'label' column holds {shown}; KTO needs a boolean label "
                                         r"per row.*dataset\.map\(lambda row: \{'label': row\['label'\] == 'good'\}"):
        build_trainer("slimrl", dataset=dataset_with(label=label))  # fmt: skip


def test_iterable_dataset_labels_are_checked_on_the_first_example():
    rows = kto_rows(8)
    for row in rows:
        row["label"] = "yes"
    dataset = IterableDataset.from_generator(lambda: iter(rows))
    with pytest.raises(ValueError, match=r"'label' column holds 'yes' \(str\)"):
        build_trainer("slimrl", dataset=dataset, max_steps=1)


def test_eval_dataset_is_checked_under_its_name():
    with pytest.raises(ValueError, match=r"eval_dataset\['held_out'\] has columns .*without \['label'\]"):
        build_trainer("slimrl", trainer_kwargs={"eval_dataset": {"held_out": dataset_with(label=None)}})


def test_half_a_preference_pair():
    dataset = Dataset.from_list([{"prompt": "Q", "chosen": " a"}] * 8)
    with pytest.raises(ValueError, match=r"has a 'chosen' column but no 'rejected' column"):
        build_trainer("slimrl", dataset=dataset)


@pytest.mark.parametrize("with_prompt", [True, False])
def test_paired_preference_datasets_are_unpaired_as_trl_does(with_prompt):
    """TRL turns a chosen/rejected pair into a desirable and an undesirable row; slimrl's checks let it through."""
    rows = [{"prompt": f"Q{i}:", "chosen": " yes" * (i + 1), "rejected": " no"} for i in range(8)]
    if not with_prompt:  # the prompt is the common prefix of chosen and rejected
        rows = [{"chosen": row["prompt"] + row["chosen"], "rejected": row["prompt"] + row["rejected"]} for row in rows]
    ours = build_trainer("slimrl", dataset=Dataset.from_list(rows))
    reference = build_trainer("trl", dataset=Dataset.from_list(rows))
    assert ours.train_dataset["label"] == reference.train_dataset["label"] == [True] * 8 + [False] * 8
    assert ours.train_dataset["completion_ids"] == reference.train_dataset["completion_ids"]


def test_zero_one_integer_labels_work_as_booleans():
    """TRL reads 0/1 labels exactly as False/True, so they stay accepted."""
    trainer = build_trainer("slimrl", dataset=dataset_with(label=lambda i: int(i % 3 != 1)), num_chunks=2)
    loss, _, metrics = loss_grads_metrics(trainer, first_batch(trainer))
    assert loss.isfinite() and metrics["num_tokens"] > 0
    assert first_batch(trainer)["label"].tolist() == [1, 0, 1, 1, 0, 1, 1, 0]
    assert metrics["logps/chosen"] != metrics["logps/rejected"]


def test_examples_dropped_by_max_length():
    """TRL drops an example whose prompt alone fills max_length without a word: slimrl warns, and refuses when none
    is left."""
    rows = kto_rows(8)
    rows[0]["prompt"] = rows[1]["prompt"] = "p" * 40
    with pytest.warns(UserWarning, match=r"2 of 8 training examples were dropped because their prompt alone has at "
                                         r"least max_length=32 tokens\. Raise max_length"):  # fmt: skip
        build_trainer("slimrl", dataset=Dataset.from_list(rows), max_length=32)
    with pytest.raises(ValueError, match=r"Every example of train_dataset was dropped.*max_length=3 tokens"):
        build_trainer("slimrl", max_length=3)


def test_sequences_beyond_the_models_context():
    """With max_length=None nothing is truncated: sequences past max_position_embeddings warn (transformers' RoPE
    runs past it, as under TRL); past FastLanguageModel's max_seq_length they are an error."""
    with pytest.warns(UserWarning, match=r"longest training sequence has 37 tokens, beyond the model's context of 24 "
                                         r"tokens \(the model's max_position_embeddings\)\. Set max_length=24"):
        build_trainer("slimrl", reference="model", model=tiny_model(max_position_embeddings=24), max_length=None)
    model = tiny_model()
    model.slimrl_options = type("Options", (), {"max_seq_length": 30})()  # as FastLanguageModel records it
    with pytest.raises(ValueError, match=r"37 tokens, beyond the model's context of 30 tokens \(max_seq_length given "
                                         r"to FastLanguageModel"):  # fmt: skip
        build_trainer("slimrl", reference="model", model=model, max_length=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_trainer("slimrl", reference="model", model=model, max_length=30)  # truncated to fit: accepted
    assert not [w for w in caught if "longest training sequence" in str(w.message)]


def test_unknown_loss_type():
    with pytest.raises(ValueError, match=r"loss_type 'bco' is not a KTO loss slimrl supports"):
        slimrl.KTOConfig(output_dir="/tmp/slimrl-test-kto", loss_type="bco", use_cpu=True)
    args = trl.KTOConfig(output_dir="/tmp/slimrl-test-kto", loss_type="bco", use_cpu=True, bf16=False,
                         report_to="none", per_device_train_batch_size=8)  # fmt: skip
    with pytest.raises(ValueError, match=r"loss_type 'bco' is not a KTO loss slimrl supports"):  # after TRL's init
        slimrl.KTOTrainer(lora_tiny_model(), args=args, train_dataset=kto_dataset(), processing_class=tiny_tokenizer())


def test_num_chunks_is_validated():
    with pytest.raises(ValueError, match=r"num_chunks must be a positive integer or 'auto'"):
        slimrl.KTOConfig(output_dir="/tmp/slimrl-test-kto", num_chunks=0, use_cpu=True)


def test_plain_trl_config_gets_slimrl_defaults():
    args = trl.KTOConfig(output_dir="/tmp/slimrl-test-kto", use_cpu=True, bf16=False, report_to="none",
                         per_device_train_batch_size=8)  # fmt: skip
    trainer = slimrl.KTOTrainer(model=lora_tiny_model(), args=args, train_dataset=kto_dataset(),
                                processing_class=tiny_tokenizer())  # fmt: skip
    assert trainer.args.num_chunks == "auto" and trainer.args.mlp_tile_tokens == 8192
    assert trainer.args.offload_checkpoints is None and trainer.args.on_nonfinite == "raise"


def test_constructor_has_trls_signature():
    ours = inspect.signature(slimrl.KTOTrainer.__init__).parameters
    theirs = inspect.signature(trl.KTOTrainer.__init__).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [
        (p.name, p.kind, p.default) for p in theirs.values()
    ]


def test_patched_trl_name_builds_slimrls_trainer():
    """After PatchFastRL("kto"), TRL's names give slimrl's classes, and unpatch restores TRL's."""
    original = trl.KTOTrainer
    slimrl.PatchFastRL("kto")
    try:
        assert trl.KTOTrainer is slimrl.KTOTrainer and trl.KTOConfig is slimrl.KTOConfig
        trainer = trl.KTOTrainer(lora_tiny_model(), args=trl.KTOConfig(output_dir="/tmp/slimrl-test-kto", use_cpu=True,
                                 report_to="none", per_device_train_batch_size=8, num_chunks=2),
                                 train_dataset=kto_dataset(), processing_class=tiny_tokenizer())  # fmt: skip
        assert isinstance(trainer, original) and trainer.args.num_chunks == 2 and trainer.args.bf16 is False
    finally:
        slimrl.unpatch("kto")
    assert trl.KTOTrainer is original
