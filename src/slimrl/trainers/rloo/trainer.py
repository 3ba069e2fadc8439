"""slimrl's RLOO trainer: TRL's RLOOTrainer with rollouts from slimrl's engine and a chunked training step.

RLOO's loss is per sequence: the ratio of the sequence's probability under the policy to its probability when it was
generated, clipped PPO-style, times the sequence's leave-one-out advantage, averaged over the micro-batch's sequences.
A sum over sequences divided by a count known before the first chunk, so it splits into chunks of sequences exactly.

Overrides, each for one reason (and each keeping TRL's contract, said in a `contract:` line beside it):
- `__init__`: TRL's signature; gives a plain trl.RLOOConfig slimrl's fields; after TRL's setup it checks the
  datasets' 'prompt' column, wraps the reward functions so a failing one names itself
  (trainers/common/rewards_guard.py), sets up the memory savers and picks the rollout backend.
- `_calculate_rewards` (from `CheckedRewardsMixin`, shared with GRPO): TRL's, then the values of every reward source
  are checked together (an infinite reward, or a batch no function scored, is an error; None and NaN abstain).
- `_generate_single_turn` (from `EngineRolloutMixin`, trainers/rollouts/engine_rollouts.py, shared with GRPO): rollouts
  from slimrl's engine (live weights and LoRA, no copy) when that backend is chosen.
- `compute_loss`: runs the micro-batch in chunks of sequences (only one chunk's activations alive at once), each
  chunk's loss divided by the micro-batch's sequence count, so the summed gradient is TRL's; logs TRL's metrics
  (entropy, clip_ratio/*) with TRL's names and values. Multimodal batches and the MoE load-balancing loss run
  through TRL's one-piece loss instead (logged once per reason).
- `_get_per_token_logps_and_entropies` (from `ChunkedScoringMixin`, shared with GRPO): the gradient-free scoring
  passes (old and reference log-probs, which TRL runs a whole micro-batch at a time) in the training step's chunk size.
`SlimTrainerMixin` (trainers/common/base.py) adds the NaN guards and the attention-backend choice around every step, and
`ResumableTrainerMixin` (trainers/common/resume.py) saves the generation buffer and data order with each checkpoint.
Everything else (generation bookkeeping, rewards, the KL penalty in the reward, advantages, logging) is TRL's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import trl
from trl.trainer.utils import nanmax, nanmin

from slimrl.trainers.common.base import SlimTrainerMixin
from slimrl.trainers.common.batches import is_multimodal
from slimrl.trainers.common.chunked_step import Chunk, ChunkStats, plan_chunks, take
from slimrl.trainers.common.chunked_trainer import ChunkedScoringMixin, ChunkedTrainerMixin, ChunkPlan
from slimrl.trainers.common.dataset_checks import check_prompt_datasets
from slimrl.trainers.common.resume import ResumableTrainerMixin
from slimrl.trainers.common.rewards_guard import CheckedRewardsMixin, guard_reward_funcs
from slimrl.trainers.common.slim_fields import SlimFields
from slimrl.trainers.rollouts.engine_rollouts import EngineRolloutMixin
from slimrl.trainers.rollouts.rollout_fields import RolloutFields, with_rollout_fields

__all__ = ["RLOOConfig", "RLOOTrainer"]

ENTROPY = "entropy"  # [entropy sum over completion tokens, token count]
# per-sequence 0/1 flags, spread over the micro-batch's rows (Chunk.spread): the ratio fell outside its clip range
# below (negative advantage), above (positive advantage), or either
LOW_CLIPPED, HIGH_CLIPPED, REGION_CLIPPED = "clip_ratio/low", "clip_ratio/high", "clip_ratio/region"


@dataclass
class RLOOConfig(RolloutFields, SlimFields, trl.RLOOConfig):
    """TRL's RLOOConfig plus slimrl's settings: the chunked step's (SlimFields) and the rollouts' (RolloutFields:
    generation_backend, deterministic_rollouts), after TRL's fields."""


class RLOOTrainer(ResumableTrainerMixin, SlimTrainerMixin, ChunkedScoringMixin, ChunkedTrainerMixin, EngineRolloutMixin,
                  CheckedRewardsMixin, trl.RLOOTrainer):
    """TRL's RLOOTrainer whose rollouts may come from slimrl's engine and whose training step runs in chunks of
    sequences. Same constructor, same results."""

    single_turn_returns_logprobs = False  # TRL's RLOO `_generate_single_turn` returns completion ids only

    def __init__(self, model, reward_funcs, args=None, train_dataset=None, eval_dataset=None, processing_class=None,
                 reward_processing_classes=None, callbacks=None, optimizers=(None, None), quantization_config=None,
                 peft_config=None):  # fmt: skip
        # contract: TRL's arguments, positions and defaults; args=None gets slimrl's RLOOConfig named as TRL names it
        args = with_rollout_fields(args, model, RLOOConfig, "RLOO")
        super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
                         reward_processing_classes, callbacks, optimizers, quantization_config,
                         peft_config)  # fmt: skip
        check_prompt_datasets(train_dataset, eval_dataset, "RLOO")
        self.reward_funcs = guard_reward_funcs(self.reward_funcs, self.reward_func_names, "RLOO")
        self._apply_memory_savers()
        self._choose_generation_backend()

    # -- the chunked loss ------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # contract: a scalar loss (unscaled for accumulation: the Trainer divides it) whose backward() completes TRL's
        # gradient (earlier chunks already backpropagated), TRL's metrics appended to self._metrics[mode] once per
        # micro-batch, eval mode under no_grad unchanged
        if return_outputs:
            raise ValueError("The RLOOTrainer does not support returning outputs")
        return self._loss_in_chunks_or_one_piece(model, inputs, return_outputs, num_items_in_batch)

    def _plan_micro_batch(self, model, inputs, mode: str, num_items_in_batch=None) -> ChunkPlan:
        """The micro-batch's sequences in chunks; each chunk's terms over the micro-batch's sequence count."""
        completion_mask = inputs["completion_mask"]  # [N, T]
        lengths = (inputs["prompt_mask"].sum(1) + completion_mask.sum(1)).tolist()
        chunks = plan_chunks(completion_mask, self._num_chunks_for(lengths, completion_mask.device))
        return ChunkPlan(chunks, normaliser=completion_mask.size(0))

    def _one_piece_reason(self, inputs, return_outputs: bool) -> str | None:
        """Why this batch must run through TRL's own one-piece loss, or None when chunking applies."""
        if is_multimodal(inputs):
            return "multimodal inputs are not chunked yet"
        if self.aux_loss_enabled:
            return "the MoE load-balancing loss depends on all tokens of the micro-batch at once"
        return None

    def _chunk_loss(self, model, inputs, plan: ChunkPlan, chunk: Chunk) -> tuple[torch.Tensor, ChunkStats]:
        """One chunk's share of TRL's loss (with grad): its sequences' clipped losses summed, over the micro-batch's
        sequence count; and the detached parts of TRL's metrics."""
        num_sequences = plan.normaliser  # the whole micro-batch's, for every chunk
        mask = take(inputs["completion_mask"], chunk, inputs["completion_ids"].size(1))  # [b, t]
        per_token_logps, entropies = self._chunk_logps_and_entropies(model, inputs, chunk)  # [b, t] each
        logps = (per_token_logps * mask).sum(1)  # [b] sequence log-probs
        old_logps = take(inputs["old_logps"], chunk, -1)  # [b]
        advantages = take(inputs["advantages"], chunk, -1)  # [b]
        coef_1 = torch.exp(logps - old_logps)  # [b]
        coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
        per_sequence_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)  # [b]
        loss = per_sequence_loss.sum() / num_sequences
        ratio = coef_1.detach()
        low = (ratio < 1 - self.epsilon_low) & (advantages < 0)  # [b] bool
        high = (ratio > 1 + self.epsilon_high) & (advantages > 0)
        stats = {
            ENTROPY: torch.stack([(entropies.detach() * mask).sum().float(), mask.sum().float()]),
            LOW_CLIPPED: chunk.spread(low.float(), num_sequences),
            HIGH_CLIPPED: chunk.spread(high.float(), num_sequences),
            REGION_CLIPPED: chunk.spread((low | high).float(), num_sequences),
        }
        return loss, stats

    def _log_chunk_metrics(self, mode: str, inputs, plan: ChunkPlan, totals: ChunkStats) -> None:
        """Append the micro-batch's metrics with TRL's names, order and reductions."""
        metrics = self._metrics[mode]
        entropy = self.accelerator.reduce(totals[ENTROPY], reduction="sum")
        metrics["entropy"].append((entropy[0] / entropy[1].clamp(min=1.0)).item())
        low = self.accelerator.gather(totals[LOW_CLIPPED])  # [N x processes]
        metrics["clip_ratio/low_mean"].append(low.nanmean().item())
        metrics["clip_ratio/low_min"].append(nanmin(low).item())
        high = self.accelerator.gather(totals[HIGH_CLIPPED])
        metrics["clip_ratio/high_mean"].append(high.nanmean().item())
        metrics["clip_ratio/high_max"].append(nanmax(high).item())
        metrics["clip_ratio/region_mean"].append(self.accelerator.gather(totals[REGION_CLIPPED]).nanmean().item())
