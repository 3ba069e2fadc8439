"""Inputs TRL's SFT and reward trainers let through to a KeyError deep in `Dataset.map`, or train on silently in a way
nobody asked for: each is an error (or a warning) that names the fix. Also: the constructors keep TRL's."""

from __future__ import annotations

import inspect

import pytest
import trl
from datasets import Dataset
from transformers import TrainingArguments

import slimrl
from tests.trainers.sft_harness import build_reward, build_sft, preference_dataset

# -- SFT datasets --------------------------------------------------------------------------------------------------


def test_sft_dataset_without_a_known_column_names_what_it_has_and_needs():
    dataset = Dataset.from_list([{"question": "What is 2+2?", "answer": "4"}] * 4)
    with pytest.raises(ValueError) as error:
        build_sft("slimrl", dataset=dataset)
    message = str(error.value)
    assert "columns ['question', 'answer']" in message
    for need in ("'text' column", "'messages' column", "'prompt' and 'completion'", "'input_ids'", "formatting_func"):
        assert need in message, f"the error does not mention {need}: {message}"


def test_sft_dataset_text_field_is_the_one_configured():
    dataset = Dataset.from_list([{"body": "some text"}] * 4)
    with pytest.raises(ValueError, match=r"a 'content' column of plain text \(or set dataset_text_field"):
        build_sft("slimrl", dataset=dataset, dataset_text_field="content")
    trainer = build_sft("slimrl", dataset=dataset, dataset_text_field="body")  # the column it names is used
    assert len(trainer.train_dataset) == 4


def test_sft_prompt_without_completion():
    dataset = Dataset.from_list([{"prompt": "2+2=", "answer": "4"}] * 4)
    with pytest.raises(ValueError, match=r"needs both 'prompt' and 'completion', and 'completion' is missing"):
        build_sft("slimrl", dataset=dataset)


def test_sft_messages_that_are_not_chat_messages():
    dataset = Dataset.from_list([{"messages": ["hello", "hi there"]}] * 4)
    with pytest.raises(ValueError, match=r"'messages' column does not hold chat messages"):
        build_sft("slimrl", dataset=dataset)


def test_sft_eval_dataset_is_checked_too():
    with pytest.raises(ValueError, match=r"The eval dataset has columns \['question'\]"):
        build_sft("slimrl", trainer_kwargs={"eval_dataset": Dataset.from_list([{"question": "q"}] * 2)})


def test_trls_own_checks_come_first():
    """TRL rejects assistant_only_loss on non-conversational data before preparing it: its message stands."""
    dataset = Dataset.from_list([{"question": "q"}] * 4)
    with pytest.raises(ValueError, match=r"You set `assistant_only_loss=True`, but the dataset is not conversational"):
        build_sft("slimrl", dataset=dataset, assistant_only_loss=True)


def test_empty_sft_dataset():
    with pytest.raises(ValueError, match=r"The train dataset is empty"):
        build_sft("slimrl", dataset=Dataset.from_list([{"text": "x"}]).select([]))


def test_truncation_that_leaves_nothing_to_train_on():
    """Prompts longer than max_length under completion-only loss: TRL drops every example, then fails obscurely."""
    dataset = Dataset.from_list([{"prompt": "a long prompt " * 4, "completion": "yes"}] * 4)
    with pytest.raises(ValueError, match=r"4 of the 4 examples .* max_length=16 .* nothing is left.* Raise max_length"):
        build_sft("slimrl", dataset=dataset, max_length=16)


def test_truncation_that_drops_some_examples_warns():
    rows = [{"prompt": "a long prompt " * 4, "completion": "yes"}] + [{"prompt": "hi", "completion": "yes"}] * 3
    with pytest.warns(UserWarning, match=r"1 of the 4 examples of the train dataset kept no token .* left out"):
        trainer = build_sft("slimrl", dataset=Dataset.from_list(rows), max_length=16)
    assert len(trainer.train_dataset) == 3


def test_pretokenized_data_longer_than_max_length_when_truncation_is_skipped():
    rows = [{"input_ids": list(range(4, 40)), "labels": list(range(4, 40))}, {"input_ids": [5, 6], "labels": [5, 6]}]
    with pytest.raises(ValueError, match=r"1 examples .* longer than max_length=32 \(the longest has 36 tokens\).*"
                                         r"skip_prepare_dataset=True skips TRL's truncation"):  # fmt: skip
        build_sft("slimrl", dataset=Dataset.from_list(rows), max_length=32,
                  dataset_kwargs={"skip_prepare_dataset": True})  # fmt: skip
    trainer = build_sft("slimrl", dataset=Dataset.from_list(rows), max_length=None,
                        dataset_kwargs={"skip_prepare_dataset": True})  # fmt: skip
    assert len(trainer.train_dataset) == 2


# -- reward datasets -----------------------------------------------------------------------------------------------


def test_reward_dataset_without_rejected():
    dataset = preference_dataset().remove_columns("rejected")
    with pytest.raises(ValueError, match=r"has columns \['prompt', 'chosen'\], but a reward model trains on pairs.*"
                                         r"'rejected' column is missing"):  # fmt: skip
        build_reward("slimrl", dataset=dataset)


def test_reward_dataset_in_unpaired_format():
    dataset = Dataset.from_list([{"prompt": "p", "completion": "c", "label": True}] * 4)
    with pytest.raises(ValueError, match=r"unpaired preference dataset \(completion \+ label, as KTO uses\)"):
        build_reward("slimrl", dataset=dataset)


def test_reward_pairs_longer_than_max_length():
    """TRL drops such pairs without a word: a warning for some, an error when none is left."""
    long_pair = {"prompt": "p", "chosen": "x" * 40, "rejected": "y"}
    short_pair = {"prompt": "p", "chosen": "x", "rejected": "y"}
    with pytest.warns(UserWarning, match=r"1 of the 4 pairs .* longer than max_length=32; TRL does not truncate"):
        trainer = build_reward("slimrl", dataset=Dataset.from_list([long_pair] + [short_pair] * 3), max_length=32)
    assert len(trainer.train_dataset) == 3
    with pytest.raises(ValueError, match=r"2 of the 2 pairs .* nothing is left to train on. Raise max_length"):
        build_reward("slimrl", dataset=Dataset.from_list([long_pair] * 2), max_length=32)


# -- constructors and configs --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ours,theirs", [(slimrl.SFTTrainer, trl.SFTTrainer), (slimrl.RewardTrainer, trl.RewardTrainer)]
)
def test_constructor_keeps_trls_parameters(ours, theirs):
    def parameters(cls):
        return [(p.name, p.kind, p.default) for p in inspect.signature(cls.__init__).parameters.values()]

    assert parameters(ours) == parameters(theirs)


def test_plain_training_arguments_keep_slimrls_fields():
    """TRL turns a TrainingArguments into its own SFTConfig; slimrl turns it into slimrl's, at the default chunks."""
    args = TrainingArguments(output_dir="/tmp/slimrl-test-sft", report_to="none", use_cpu=True, learning_rate=3e-4)
    trainer = build_sft("slimrl", args=args)
    assert isinstance(trainer.args, slimrl.SFTConfig)
    assert trainer.args.num_chunks == "auto" and trainer.args.learning_rate == 3e-4


def test_num_chunks_is_checked():
    with pytest.raises(ValueError, match=r"num_chunks must be a positive integer or 'auto'"):
        slimrl.RewardConfig(output_dir="/tmp/slimrl-test-reward", num_chunks=0, use_cpu=True)
    with pytest.raises(ValueError, match=r"num_chunks must be a positive integer or 'auto'"):
        slimrl.SFTConfig(output_dir="/tmp/slimrl-test-sft", num_chunks="many", use_cpu=True)


def test_sft_config_keeps_trls_fields_first():
    trl_fields = list(trl.SFTConfig.__dataclass_fields__)
    assert list(slimrl.SFTConfig.__dataclass_fields__)[: len(trl_fields)] == trl_fields
