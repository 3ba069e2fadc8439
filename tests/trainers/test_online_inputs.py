"""The dataset checks every online trainer (GRPO, RLOO, online DPO, PPO) runs at construction
(trainers/common/dataset_checks.py):
without them TRL builds the trainer, then fails at train() with KeyError: 'prompt'."""

from __future__ import annotations

import warnings

import pytest
from datasets import DatasetDict

import slimrl
from slimrl.testing import tiny_model, tiny_prompt_dataset, tiny_tokenizer
from tests.trainers import grpo_harness, online_dpo_harness, rloo_harness
from tests.trainers.run_settings import CPU_RUN

NAMES = {"grpo": "GRPO", "rloo": "RLOO", "online_dpo": "online DPO", "ppo": "PPO"}


def build(kind: str, dataset, eval_dataset=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "grpo":
            return grpo_harness.build_trainer("slimrl", dataset=dataset, trainer_kwargs={"eval_dataset": eval_dataset})
        if kind == "rloo":
            return rloo_harness.build_trainer("slimrl", dataset=dataset)
        if kind == "online_dpo":
            args = slimrl.OnlineDPOConfig(output_dir="/tmp/slimrl-test-online-dpo", max_new_tokens=4, **CPU_RUN)
            return slimrl.OnlineDPOTrainer(
                model=tiny_model(),
                reward_funcs=[online_dpo_harness.digit_reward],
                args=args,
                train_dataset=dataset,
                processing_class=tiny_tokenizer(),
            )
        from tests.trainers.test_ppo_trainer import build as build_ppo

        return build_ppo(dataset=dataset)


@pytest.mark.parametrize("kind", list(NAMES))
def test_a_dataset_without_a_prompt_column_is_refused_with_the_rename(kind):
    dataset = tiny_prompt_dataset().rename_column("prompt", "question")
    with pytest.raises(ValueError, match=rf"train_dataset has columns \['question', 'answer'\] but {NAMES[kind]} "
                                         r"needs a 'prompt' column .*dataset = dataset\.rename_column\('question', "
                                         r"'prompt'\), or build it with dataset\.map"):  # fmt: skip
        build(kind, dataset)


def test_each_named_eval_dataset_is_checked():
    held_out = tiny_prompt_dataset(4).rename_column("prompt", "instruction")
    with pytest.raises(
        ValueError,
        match=r"eval_dataset\['held_out'\] has columns \['instruction', 'answer'\] but "
        r"GRPO needs a 'prompt' column.*rename_column\('instruction', 'prompt'\)",
    ):
        build("grpo", tiny_prompt_dataset(), eval_dataset={"held_out": held_out})


def test_a_dataset_dict_is_refused_with_the_split_to_pass():
    splits = DatasetDict(train=tiny_prompt_dataset())
    with pytest.raises(ValueError, match=r"train_dataset is a DatasetDict with splits \['train'\]; pass one split, "
                                         r"e\.g\. train_dataset=dataset\['train'\]"):  # fmt: skip
        build("ppo", splits)
