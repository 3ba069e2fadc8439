"""slimrl's reward-model trainer: TRL's RewardTrainer with a chunked training step and dataset validation.

Overrides, each for one reason (and each keeping TRL's contract, said in a `contract:` line beside it):
- `__init__`: TRL's signature; args become slimrl's RewardConfig; the memory savers.
- `_prepare_dataset`: before TRL's preparation, an error naming the chosen/rejected columns a reward model needs (TRL
  raises a bare KeyError from inside `Dataset.map`); after it, a warning or an error for the pairs TRL silently drops
  because they are longer than max_length.
- `compute_loss`: scores the micro-batch's pairs in chunks of whole pairs (a pair's loss,
  -logsigmoid(r_chosen - r_rejected - margin), is not a sum over its two sequences), only one chunk's activations
  alive at once, every term divided by the micro-batch's number of pairs, fixed before the first chunk, so the summed
  gradient is TRL's; logs TRL's metrics (num_tokens, min/mean/max_reward, accuracy, margin) with TRL's values from the
  rewards of all chunks. Falls back to TRL's one-piece loss, with a logged reason, where chunking would not be exact.
`SlimTrainerMixin` (trainers/common/base.py) adds the NaN guards and the attention-backend choice around every step.
Everything else (tokenisation, collation, logging, checkpoints) is TRL's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import trl
from transformers.modeling_outputs import SequenceClassifierOutputWithPast

from slimrl.trainers.common.base import SlimTrainerMixin
from slimrl.trainers.common.batches import row_lengths, run_level_obstacle
from slimrl.trainers.common.chunked_step import Chunk, ChunkStats, plan_by_length
from slimrl.trainers.common.chunked_trainer import ChunkedLoss, ChunkedTrainerMixin, ChunkPlan
from slimrl.trainers.common.slim_fields import SlimFields, with_slim_fields
from slimrl.trainers.reward.inputs import check_pairs_kept, check_reward_columns

__all__ = ["RewardConfig", "RewardTrainer"]

MODEL_INPUT_KEYS = ("input_ids", "attention_mask")  # per-row tensors [2P, T]: P chosen rows, then P rejected rows
KNOWN_KEYS = (*MODEL_INPUT_KEYS, "margin", "use_cache")
CHOSEN, REJECTED = "chosen_rewards", "rejected_rewards"  # [P] each, assembled from the chunks


@dataclass
class RewardConfig(SlimFields, trl.RewardConfig):
    """TRL's RewardConfig plus slimrl's settings (the shared ones in SlimFields: num_chunks, offload_checkpoints...)."""


class RewardTrainer(SlimTrainerMixin, ChunkedTrainerMixin, trl.RewardTrainer):
    """TRL's RewardTrainer whose training step runs in chunks of pairs. Same constructor, same results."""

    def __init__(self, model, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, compute_metrics=None, callbacks=None, optimizers=(None, None),
                 optimizer_cls_and_kwargs=None, preprocess_logits_for_metrics=None, quantization_config=None,
                 peft_config=None):  # fmt: skip
        # contract: TRL's arguments, positions and defaults; args=None gets slimrl's RewardConfig named as TRL names it
        args = with_slim_fields(args, model, RewardConfig, "Reward")
        super().__init__(model, args, data_collator, train_dataset, eval_dataset, processing_class, compute_metrics,
                         callbacks, optimizers, optimizer_cls_and_kwargs, preprocess_logits_for_metrics,
                         quantization_config, peft_config)  # fmt: skip
        self._apply_memory_savers()

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        # contract: TRL's prepared dataset, unchanged; raises first where TRL's preparation could not read the pairs
        check_reward_columns(dataset, dataset_name)
        prepared = super()._prepare_dataset(dataset, processing_class, args, dataset_name)
        check_pairs_kept(prepared, dataset, dataset_name, args.max_length)
        return prepared

    # -- the chunked loss ------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # contract: TRL's loss value, and a scalar whose backward() completes TRL's gradient (earlier chunks already
        # backpropagated with HF Trainer's accumulation scaling); TRL's metrics appended to self._metrics[mode];
        # with return_outputs (evaluation), outputs whose logits are TRL's rewards [2P, 1]
        return self._loss_in_chunks_or_one_piece(model, inputs, return_outputs, num_items_in_batch)

    def _plan_micro_batch(self, model, inputs, mode: str, num_items_in_batch=None) -> ChunkPlan:
        """The micro-batch's pairs in chunks (a pair's chosen and rejected rows together), each chunk's terms over the
        micro-batch's pair count."""
        num_pairs = inputs["input_ids"].size(0) // 2
        lengths = row_lengths(inputs)  # [2P]
        pair_widths = torch.maximum(lengths[:num_pairs], lengths[num_pairs:])  # [P]
        pair_tokens = (lengths[:num_pairs] + lengths[num_pairs:]).tolist()
        chunks = plan_by_length(pair_widths, self._num_chunks_for(pair_tokens, inputs["input_ids"].device))
        return ChunkPlan(chunks, normaliser=num_pairs)

    def _chunk_outputs(self, result: ChunkedLoss) -> SequenceClassifierOutputWithPast:
        """TRL's outputs: the micro-batch's rewards [2P, 1] (chosen rows, then rejected) as the model's logits."""
        return SequenceClassifierOutputWithPast(logits=_rewards(result.totals))

    def _one_piece_reason(self, inputs, return_outputs: bool) -> str | None:
        """Why this batch of pairs must run through TRL's one-piece loss, or None when chunking is exact."""
        if return_outputs and torch.is_grad_enabled():
            return "return_outputs=True with gradients asks for logits attached to the graph of the whole batch"
        input_ids = inputs.get("input_ids")
        if input_ids is None or input_ids.size(0) % 2:
            return "the batch is not chosen rows followed by as many rejected rows"
        unknown = sorted(key for key, value in inputs.items() if key not in KNOWN_KEYS and value is not None)
        if unknown:
            return f"the batch carries inputs slimrl does not know how to split ({', '.join(unknown)})"
        return run_level_obstacle(self.args, self.accelerator)

    def _chunk_loss(self, model, inputs, plan: ChunkPlan, chunk: Chunk) -> tuple[torch.Tensor, ChunkStats]:
        """The loss terms of one chunk's pairs, each divided by the micro-batch's pair count, and their rewards."""
        num_pairs = plan.normaliser
        pairs = chunk.rows.to(inputs["input_ids"].device)  # [p]
        rows = torch.cat([pairs, pairs + num_pairs])  # [2p]: the chunk's chosen rows, then their rejected rows
        chunk_inputs = {key: inputs[key].index_select(0, rows)[:, : chunk.width] for key in MODEL_INPUT_KEYS}
        rewards = model(**chunk_inputs, use_cache=False).logits.squeeze(-1)  # [2p]
        chosen, rejected = torch.chunk(rewards, chunks=2)  # [p] each
        difference = chosen - rejected
        if inputs.get("margin") is not None:
            difference = difference - inputs["margin"].index_select(0, pairs)
        loss = -F.logsigmoid(difference).sum() / num_pairs
        if self.args.center_rewards_coefficient is not None:
            loss = loss + self.args.center_rewards_coefficient * ((chosen + rejected) ** 2).sum() / num_pairs
        stats = {
            CHOSEN: chunk.spread(chosen.detach(), num_pairs),
            REJECTED: chunk.spread(rejected.detach(), num_pairs),
        }
        return loss, stats

    def _log_chunk_metrics(self, mode: str, inputs, plan: ChunkPlan, totals: ChunkStats) -> None:
        """TRL's metrics, names and order, from the micro-batch's rewards [2P, 1] gathered as TRL gathers its own."""
        rewards, num_pairs = _rewards(totals), plan.normaliser
        metrics = self._metrics[mode]
        if mode == "train":
            local_tokens = inputs["attention_mask"].sum()
            self._total_train_tokens += self.accelerator.gather_for_metrics(local_tokens).sum().item() // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]
        all_rewards = self.accelerator.gather(rewards)
        metrics["min_reward"].append(all_rewards.min().item())
        metrics["mean_reward"].append(all_rewards.mean().item())
        metrics["max_reward"].append(all_rewards.max().item())
        chosen, rejected = rewards[:num_pairs, 0], rewards[num_pairs:, 0]  # [P] each
        accuracy = (chosen > rejected).float().mean()
        metrics["accuracy"].append(self.accelerator.gather_for_metrics(accuracy).mean().item())
        margin = (chosen - rejected).mean()
        metrics["margin"].append(self.accelerator.gather_for_metrics(margin).mean().item())


def _rewards(totals: ChunkStats) -> torch.Tensor:
    """The micro-batch's rewards [2P, 1], chosen rows then rejected rows, from the chunks' summed stats."""
    return torch.cat([totals[CHOSEN], totals[REJECTED]]).unsqueeze(-1)
