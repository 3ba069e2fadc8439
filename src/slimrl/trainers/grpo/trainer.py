"""slimrl's GRPO trainer: TRL's GRPOTrainer with a chunked training step and input validation.

Overrides, each for one reason (and each keeping TRL's contract, said in a `contract:` line beside it):
- `__init__`: TRL's signature; validates what TRL lets through (dataset columns, context length) after TRL's own
  checks, and wraps reward functions so a failing one names itself (trainers/common/rewards_guard.py).
- `_calculate_rewards` (from `CheckedRewardsMixin`, shared with RLOO): TRL's, then the values of every reward source
  are checked together (an infinite reward, or a batch no function scored, is an error; None and NaN abstain).
- `_generate_single_turn` (from `EngineRolloutMixin`, trainers/rollouts/engine_rollouts.py, shared with RLOO): rollouts
  from slimrl's engine (live weights, no copy) when that backend is chosen.
- `compute_loss`: runs the micro-batch in chunks of sequences (only one chunk's activations alive at once) with the
  loss normalised so that the summed gradient equals TRL's; logs TRL's metrics with TRL's names and values.
- `_get_per_token_logps_and_entropies` (from `ChunkedScoringMixin`, shared with RLOO): gradient-free scoring passes
  in the training step's chunk size.
- `_chunk_logps_and_entropies`: with `shared_prompt_forward`, a chunk of whole prompt groups is scored by one packed
  forward that computes each prompt once for all its completions (trainers/common/shared_prompt.py); same values.
- `training_step`: measures the step's peak GPU memory and the training phase's tokens per second.
`SlimTrainerMixin` (trainers/common/base.py) adds the NaN guards and the attention-backend choice around every step.
Everything else (rewards, advantages, tools and environments, logging, checkpoints) is TRL's.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import trl

from slimrl.trainers.common.base import SlimTrainerMixin
from slimrl.trainers.common.batches import is_multimodal
from slimrl.trainers.common.chunked_step import Chunk, ChunkStats, plan_chunks, take
from slimrl.trainers.common.chunked_trainer import ChunkedScoringMixin, ChunkedTrainerMixin, ChunkPlan
from slimrl.trainers.common.dataset_checks import check_prompt_datasets
from slimrl.trainers.common.resume import ResumableTrainerMixin
from slimrl.trainers.common.rewards_guard import CheckedRewardsMixin, guard_reward_funcs
from slimrl.trainers.common.shared_prompt import GroupChunk, packed_logps_and_entropies, plan_shared_prompt
from slimrl.trainers.grpo.config import GRPOConfig, with_slimrl_fields
from slimrl.trainers.grpo.inputs import check_context_length
from slimrl.trainers.grpo.loss import (
    LOSS_TYPES,
    TOKEN_SUM_LOSSES,
    PolicyLossSettings,
    policy_loss_terms,
    sequence_weights,
    weighted_loss_sum,
)
from slimrl.trainers.grpo.metrics import ENTROPY_STATS, POLICY_LOSS, append_metrics, chunk_metrics
from slimrl.trainers.rollouts.async_rollouts import AsyncRolloutMixin
from slimrl.trainers.rollouts.engine_rollouts import EngineRolloutMixin

__all__ = ["GRPOConfig", "GRPOTrainer"]  # the config lives in grpo_config.py; importable from here as before

logger = logging.getLogger("slimrl.trainers")


@dataclass(frozen=True)
class _MicroBatch(ChunkPlan):
    """What every chunk's share of the loss depends on, computed over the whole micro-batch before the first chunk;
    the normaliser is the per-sequence weights [N] (grpo/loss.sequence_weights)."""

    width: int  # completion columns of the micro-batch
    mask: torch.Tensor  # [N, T] completion (and tool) mask
    advantages: torch.Tensor  # [N, 1] or [N, T]
    policy_divisor: int  # 1 where the weights already hold the accumulation factor, else the accumulation steps
    accumulation: int
    settings: PolicyLossSettings
    entropy_mask: torch.Tensor | None  # [N, T] bool, top-entropy tokens over the whole micro-batch
    effective_total: torch.Tensor | None  # tokens the entropy bonus averages over; None: each chunk counts its own
    entropy_coef: float  # the entropy bonus's coefficient for this micro-batch (0 when the bonus is off)


class GRPOTrainer(ResumableTrainerMixin, SlimTrainerMixin, ChunkedScoringMixin, ChunkedTrainerMixin, AsyncRolloutMixin,
                  EngineRolloutMixin, CheckedRewardsMixin, trl.GRPOTrainer):
    """TRL's GRPOTrainer whose training step runs in chunks of sequences. Same constructor, same results."""

    def __init__(self, model, reward_funcs=None, args=None, train_dataset=None, *positional, **kwargs):
        # contract: TRL's arguments, positions and defaults; args=None gets slimrl's GRPOConfig named as TRL names it
        # TRL's signature and defaults; slimrl's checks run after TRL's own, so TRL's errors keep their text
        args = with_slimrl_fields(args, model)
        super().__init__(model, reward_funcs, args, train_dataset, *positional, **kwargs)
        # with environment_factory an environment may produce the prompt (TRL's datasets then carry `environment`)
        check_prompt_datasets(train_dataset, self.eval_dataset, "GRPO", self.environment_factories is not None)
        check_context_length(self.model, self.args.max_completion_length)
        self.reward_funcs = guard_reward_funcs(self.reward_funcs, self.reward_func_names)
        self._apply_memory_savers()
        self._choose_generation_backend()
        self._check_async_generation()
        self._phase_start: float | None = None
        self._phase_tokens = 0

    # -- the chunked loss ------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # contract: a scalar loss whose backward() completes TRL's gradient (earlier chunks already backpropagated),
        # TRL's metrics appended to self._metrics[mode] once per micro-batch, eval mode under no_grad unchanged
        if return_outputs:
            raise ValueError("The GRPOTrainer does not support returning outputs")
        self._start_training_phase(inputs)
        return self._loss_in_chunks_or_one_piece(model, inputs, return_outputs, num_items_in_batch)

    def _one_piece_reason(self, inputs, return_outputs: bool) -> str | None:
        """Why this batch must run through TRL's own one-piece loss, or None when chunking applies."""
        if is_multimodal(inputs):
            return "multimodal inputs are not chunked yet"
        if self.aux_loss_enabled:
            return "the MoE load-balancing loss depends on all tokens of the micro-batch at once"
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type {self.loss_type!r} is not supported by slimrl ({', '.join(LOSS_TYPES)}).")
        return None

    def _plan_micro_batch(self, model, inputs, mode: str, num_items_in_batch=None) -> _MicroBatch:
        """The chunk plan and the micro-batch-wide quantities of the loss, in the order TRL computes them; its loss
        terms carry TRL's accumulation scaling (loss_is_scaled_for_ga), so the inner chunks' backward divides by 1."""
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        settings = PolicyLossSettings.from_trainer(self)
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]  # [N, T]
        advantages = inputs["advantages"]
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # [N, 1] or [N, T]
        chunks = self._plan_chunks(model, inputs)
        token_normalizer = None
        if self.loss_type in TOKEN_SUM_LOSSES:
            token_normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                token_normalizer = token_normalizer * accumulation / self.args.steps_per_generation
        weights = sequence_weights(
            self.loss_type, mask, max_completion_length=self.max_completion_length, token_normalizer=token_normalizer
        )  # [N]
        entropy_mask = None  # [N, T] bool, top-entropy tokens over the whole micro-batch
        if self.top_entropy_quantile < 1.0 and len(chunks) > 1:
            entropy_mask = self._top_entropy_mask(model, inputs, chunks, mask)
        effective_total, entropy_coef = None, 0.0  # a single chunk counts its own tokens
        if self._entropy_bonus_enabled:
            if entropy_mask is not None or self.top_entropy_quantile >= 1.0:
                effective_total = (mask if entropy_mask is None else mask * entropy_mask).sum().clamp(min=1.0)
            entropy_coef = self.entropy_coef
            if self.use_adaptive_entropy and not self._last_world_entropy <= self.args.entropy_target:
                entropy_coef = 0.0  # TRL's controller: no bonus while the entropy is above its target
        return _MicroBatch(
            chunks=chunks,
            normaliser=weights,
            width=completion_ids.size(1),
            mask=mask,
            advantages=advantages,
            policy_divisor=1 if self.loss_type in TOKEN_SUM_LOSSES else accumulation,
            accumulation=accumulation,
            settings=settings,
            entropy_mask=entropy_mask,
            effective_total=effective_total,
            entropy_coef=entropy_coef,
        )

    def _plan_chunks(self, model, inputs) -> list[Chunk]:
        """Chunks of whole prompt groups for the shared-prompt forward where it is on and can run, else of sequences
        grouped by length; a reason the shared prompt cannot run is logged once."""
        completion_mask = inputs["completion_mask"]
        device = completion_mask.device
        if self.args.shared_prompt_forward:
            auto = self.args.num_chunks == "auto"
            plan = plan_shared_prompt(model, inputs, lambda units: self._num_chunks_for(units, device), auto)
            if plan.chunks is not None:
                return plan.chunks
            self._log_shared_prompt_fallback(plan.reason)
        lengths = (inputs["prompt_mask"].sum(1) + completion_mask.sum(1)).tolist()
        return plan_chunks(completion_mask, self._num_chunks_for(lengths, device))

    def _log_shared_prompt_fallback(self, reason: str) -> None:
        logged = self.__dict__.setdefault("_shared_prompt_fallbacks", [])
        if reason not in logged:
            logged.append(reason)
            logger.warning("slimrl: the shared-prompt forward does not run on this batch because %s; the plain "
                           "forward computes it (same values).", reason)  # fmt: skip

    @property
    def shared_prompt_fallbacks(self) -> list[str]:
        """The reasons the shared-prompt forward fell back to the plain forward so far (each once, in order)."""
        return list(self.__dict__.get("_shared_prompt_fallbacks", []))

    def _chunk_logps_and_entropies(self, model, inputs, chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
        # contract: ChunkedScoringMixin's (logps, entropies) [b, chunk.width] of the chunk's rows, same values
        if isinstance(chunk, GroupChunk):
            return packed_logps_and_entropies(model, inputs, chunk, self.accelerator.autocast())
        return super()._chunk_logps_and_entropies(model, inputs, chunk)

    def _chunk_loss(self, model, inputs, batch: _MicroBatch, chunk: Chunk) -> tuple[torch.Tensor, ChunkStats]:
        """One chunk's share of the loss (with grad) and its detached policy-loss, entropy and metric parts."""
        width = batch.width
        mask = take(batch.mask, chunk, width)  # [b, t]
        logps, entropies = self._chunk_logps_and_entropies(model, inputs, chunk)  # [b, t] each
        entropy_mask = take(batch.entropy_mask, chunk, width)
        if self.top_entropy_quantile < 1.0 and entropy_mask is None:  # one chunk: TRL's own rule, in place
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
        old = take(inputs.get("old_per_token_logps"), chunk, width)
        advantages = take(batch.advantages, chunk, width)
        terms = policy_loss_terms(
            batch.settings,
            logps,
            logps.detach() if old is None else old,
            advantages,
            mask,
            ref_logps=take(inputs.get("ref_per_token_logps"), chunk, width),
            is_ratio=take(inputs.get("importance_sampling_ratio"), chunk, width),
            sampling_logps=take(inputs.get("sampling_per_token_logps"), chunk, width),
            entropy_mask=entropy_mask,
        )
        policy = weighted_loss_sum(terms.per_token_loss, mask, take(batch.normaliser, chunk, -1))
        loss = policy / batch.policy_divisor
        stats = {POLICY_LOSS: policy.detach().float()}
        if self._entropy_bonus_enabled:
            effective = mask if entropy_mask is None else mask * entropy_mask
            total = effective.sum().clamp(min=1.0) if batch.effective_total is None else batch.effective_total
            entropy_sum = (entropies * effective).sum()
            loss = loss - batch.entropy_coef * entropy_sum / total / batch.accumulation
            stats[ENTROPY_STATS] = torch.stack([entropy_sum.detach(), effective.sum().detach()]).float()
        num_rows = batch.mask.size(0)
        stats.update(chunk_metrics(self.loss_type, self.epsilon_low, self.epsilon_high, terms, entropies, advantages,
                                   mask, chunk, num_rows))  # fmt: skip
        return loss, stats

    @torch.no_grad()
    def _top_entropy_mask(self, model, inputs, chunks: list[Chunk], mask: torch.Tensor) -> torch.Tensor:
        """TRL's top-entropy token mask needs a quantile over the whole micro-batch: a gradient-free pass gets it."""
        entropies = torch.zeros_like(mask, dtype=torch.float32)  # [N, T]
        for chunk in chunks:
            entropies[chunk.rows, : chunk.width] = self._chunk_logps_and_entropies(model, inputs, chunk)[1].float()
        return self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)

    def _log_chunk_metrics(self, mode: str, inputs, batch: _MicroBatch, totals: ChunkStats) -> None:
        """Append the micro-batch's metrics in TRL's order, with TRL's reductions."""
        metrics = self._metrics[mode]
        if self._entropy_bonus_enabled:
            metrics["policy_loss"].append(self.accelerator.gather(totals[POLICY_LOSS]).nanmean().item())
            if self.use_adaptive_entropy and mode == "train":
                self._update_adaptive_entropy(totals[ENTROPY_STATS])
            if mode == "train" and self.accelerator.sync_gradients:
                metrics["entropy_coef"].append(self.entropy_coef)
        append_metrics(metrics, totals, self.accelerator)

    def _update_adaptive_entropy(self, stats: torch.Tensor) -> None:
        """TRL's adaptive entropy controller, fed with the whole micro-batch's entropy sum and token count."""
        stats = stats.detach()
        self._entropy_window_stats = stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
        if not self.accelerator.sync_gradients:
            return
        window = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        world_entropy = (window[0] / window[1].clamp(min=1.0)).item()
        args = self.args
        if world_entropy <= args.entropy_target:
            self.entropy_coef = min(self.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
        self._last_world_entropy = world_entropy
        self._entropy_window_stats = None

    # -- step measurements -----------------------------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch):
        # contract: the detached loss TRL returns; adds peak_gpu_memory_GiB / train_tokens_per_second to _metrics
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._phase_start = None
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._finish_training_phase()
        return loss

    def _start_training_phase(self, inputs) -> None:
        if not self.model.training or self._phase_start is not None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._phase_start = time.perf_counter()
        self._phase_tokens = int(inputs["prompt_mask"].sum()) + int(inputs["completion_mask"].sum())

    def _finish_training_phase(self) -> None:
        if self._phase_start is None:
            return
        metrics = self._metrics["train"]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            metrics["peak_gpu_memory_GiB"].append(torch.cuda.max_memory_allocated() / 2**30)
        elapsed = time.perf_counter() - self._phase_start
        metrics["train_tokens_per_second"].append(self._phase_tokens / elapsed if elapsed > 0 else math.nan)
        self._phase_start = None
