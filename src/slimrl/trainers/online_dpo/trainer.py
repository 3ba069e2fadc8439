"""slimrl's online DPO trainer: TRL's (experimental) OnlineDPOTrainer with rollouts from slimrl's engine and a
chunked training step.

Overrides, each for one reason (and each keeping TRL's contract, said in a `contract:` line beside it):
- `__init__`: TRL's signature; `args=None` or a plain trl OnlineDPOConfig gets slimrl's fields; after TRL's setup it
  checks the datasets' 'prompt' column, wraps the reward functions so a failing one names itself
  (trainers/common/rewards_guard.py), installs TRL's fused LM head on the policy (and on a separate reference model),
  turns on the memory savers and picks the rollout backend (EngineRolloutMixin's choice; no continuous batching in
TRL's). - `_calculate_rewards_from_functions`: TRL's, with the values of every reward source recorded and checked
  together (an infinite reward, or a pair neither of whose completions any function scored, is an error).
- `_generate`: with the "engine" backend, slimrl's rollout engine samples the two completions of every prompt with
  the training weights and the live LoRA adapter; other backends and image prompts go to TRL's path.
- `training_step` (`ChunkedOnlineDPOStep`, trainers/online_dpo/step.py): the pairs run forward and backward in
  chunks (a pair's chosen and rejected sequence together), the loss a mean over the micro-batch's pairs, so loss,
  gradient and TRL's stats are TRL's.
`SlimTrainerMixin` (trainers/common/base.py) adds the NaN guards and the attention-backend choice around every step.
Everything else (reward functions and models, vLLM, the beta schedule, logging, checkpoints) is TRL's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from trl.data_utils import maybe_apply_chat_template
from trl.experimental import online_dpo as _trl_online_dpo

from slimrl.trainers.common.base import SlimTrainerMixin
from slimrl.trainers.common.chunked_trainer import ChunkedTrainerMixin
from slimrl.trainers.common.dataset_checks import check_prompt_datasets
from slimrl.trainers.common.paired_forward import fused_head_obstacle
from slimrl.trainers.common.rewards_guard import RewardRecorder, check_pairs_scored, guard_reward_funcs
from slimrl.trainers.common.slim_fields import SlimFields
from slimrl.trainers.online_dpo.step import ChunkedOnlineDPOStep
from slimrl.trainers.rollouts.engine_rollouts import EngineRolloutMixin
from slimrl.trainers.rollouts.rollout_fields import RolloutFields, with_rollout_fields

__all__ = ["OnlineDPOConfig", "OnlineDPOTrainer"]


@dataclass
class OnlineDPOConfig(RolloutFields, SlimFields, _trl_online_dpo.OnlineDPOConfig):
    """TRL's OnlineDPOConfig plus slimrl's settings: the chunked step's (SlimFields; a chunk holds whole pairs) and
    the rollouts' (RolloutFields: generation_backend, deterministic_rollouts), after TRL's fields."""


class OnlineDPOTrainer(SlimTrainerMixin, ChunkedOnlineDPOStep, ChunkedTrainerMixin, EngineRolloutMixin,
                       _trl_online_dpo.OnlineDPOTrainer):  # fmt: skip
    """TRL's OnlineDPOTrainer whose rollouts may come from slimrl's engine and whose step runs in chunks of pairs.
    Same constructor, same results."""

    single_turn_returns_logprobs = False  # the engine's log-probs are never read: TRL rescores the completions

    def __init__(self, model, ref_model=None, reward_funcs=None, args=None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, peft_config=None,
                 compute_metrics=None, callbacks=None, optimizers=(None, None),
                 preprocess_logits_for_metrics=None):  # fmt: skip
        # contract: TRL's arguments, positions and defaults; args=None gets slimrl's OnlineDPOConfig named after the
        # model (TRL itself fails on None); TRL's own errors keep their text
        args = with_rollout_fields(args, model, OnlineDPOConfig, "OnlineDPO")
        super().__init__(model, ref_model, reward_funcs, args, data_collator, train_dataset, eval_dataset,
                         processing_class, reward_processing_classes, peft_config, compute_metrics, callbacks,
                         optimizers, preprocess_logits_for_metrics)  # fmt: skip
        check_prompt_datasets(train_dataset, eval_dataset, "online DPO")
        self.reward_funcs = guard_reward_funcs(self.reward_funcs, self.reward_func_names, "online DPO",
                                               supports_async=False)  # fmt: skip
        self._fused_head_obstacle = fused_head_obstacle(self.accelerator.unwrap_model(self.model))
        if self.ref_model is not None:
            self._ref_head_obstacle = fused_head_obstacle(self.accelerator.unwrap_model(self.ref_model))
        self._apply_memory_savers()
        self._choose_generation_backend()

    @property
    def max_completion_length(self) -> int:
        """The engine's token budget per completion: TRL's max_new_tokens."""
        return self.args.max_new_tokens

    def _calculate_rewards_from_functions(self, prompts, completions, completion_ids_list, **reward_kwargs):
        # contract: TRL's [2B] weighted sums of the reward sources' values (NaN abstentions left out), unchanged
        with RewardRecorder(self.reward_funcs) as recorder:
            rewards = super()._calculate_rewards_from_functions(prompts, completions, completion_ids_list,
                                                                **reward_kwargs)  # fmt: skip
        check_pairs_scored(recorder.table(len(prompts)), self.reward_func_names)
        return rewards

    def _generate(self, model, prompts, images=None):
        # contract: TRL's (prompt ids [2B, P] left-padded and their mask, completion ids [2B, C] padded after the
        # first EOS and their mask up to and including it, vision inputs or None), rows i and B + i completing
        # prompt i, on the model's device, no grad
        if self._generation_backend != "engine" or images is not None:
            return super()._generate(model, prompts, images)
        texts = [maybe_apply_chat_template({"prompt": prompt}, self.processing_class)["prompt"] for prompt in prompts]
        encoded = self.processing_class(text=texts, add_special_tokens=False)["input_ids"]
        prompt_rows = [list(ids) for ids in encoded] * 2  # block layout: every prompt, then every prompt again
        completion_rows, _ = self._engine_rollout(prompt_rows)
        device, pad = next(model.parameters()).device, self._tokenizer.pad_token_id
        prompt_ids, prompt_mask = _pad_rows(prompt_rows, pad, device, left=True)
        completion_ids, completion_mask = _pad_rows(completion_rows, pad, device, left=False)
        return prompt_ids, prompt_mask, completion_ids, completion_mask, None


def _pad_rows(rows: list[list[int]], pad: int, device, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows padded to the longest (on the left or the right) and their mask, [N, L] each."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        columns = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, columns] = torch.tensor(row, dtype=torch.long)
        mask[i, columns] = 1
    return ids.to(device), mask.to(device)
