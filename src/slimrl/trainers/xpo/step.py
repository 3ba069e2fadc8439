"""The chunked loss of slimrl's XPO trainer, through the chunk-plan protocol (trainers/common/chunked_trainer.py).

The step is online DPO's (trainers/online_dpo/step.py `ChunkedOnlineDPOStep.training_step`: generate, rank with
`_ranked_rollout`, the chunked loss, the last backward); the generation puts the policy's completion of prompt i in
row i and the reference model's in row B + i, and the rewards rank each pair, the policy's sample winning ties (as
TRL's `model_scores >= ref_scores`). What XPO declares here:
- `_plan_micro_batch`: chunks of whole pairs, the loss over the micro-batch's pair count, the step's alpha; one chunk
  where chunks would draw other random numbers or DataParallel splits the batch (XPO has no TRL step to fall back on).
- `_chunk_loss`: both completions of each of the chunk's pairs under the policy (through the fused LM head, with
  grad) and the reference model (no grad), masked to their tokens; DPO's pair loss plus alpha times the policy's
  log-prob of the reference's completion (trainers/xpo/loss.py); the pair terms and per-row sums as stats.
- `_log_chunk_metrics`: TRL's XPO stats, with its names and reductions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimrl.trainers.common.chunked_step import Chunk, ChunkStats, plan_by_length
from slimrl.trainers.common.chunked_trainer import ChunkPlan
from slimrl.trainers.online_dpo.step import RankedRollout, _has_active_dropout, _place
from slimrl.trainers.xpo.loss import xpo_terms

__all__ = ["ChunkedXPOStep", "XPOPlan"]

PAIR_STATS = ("dpo", "xpo", "chosen_logps", "rejected_logps", "chosen_ref_logps", "rejected_ref_logps")


@dataclass(frozen=True)
class XPOPlan(ChunkPlan):
    alpha: float  # the step's weight of the exploration term (the epoch's, when alpha is a schedule)


class ChunkedXPOStep:
    """XPO's declarations of the chunk-plan protocol. Goes before slimrl's OnlineDPOTrainer in the bases."""

    def _one_piece_reason(self, inputs, return_outputs: bool) -> str | None:
        # contract: None always (online DPO's training_step would otherwise run TRL's online DPO step, not XPO);
        # what would make chunks differ from one piece turns into a one-chunk plan (`_one_chunk_reason`)
        if "image" in inputs:
            raise ValueError("XPO takes text prompts only (TRL's XPOTrainer had no vision support): drop the "
                             "dataset's 'image' column.")  # fmt: skip
        return None

    def _one_chunk_reason(self) -> str | None:
        """Why the micro-batch must run as one chunk (the same loss, computed at once), or None."""
        if self.args.n_gpu > 1:
            return "DataParallel (n_gpu > 1) splits the micro-batch itself"
        if _has_active_dropout(self.accelerator.unwrap_model(self.model)):
            return "dropout is active (disable_dropout=False), and chunked forwards would draw other dropout masks"
        return None

    def _plan_micro_batch(self, model, ranked: RankedRollout, mode: str, num_items_in_batch=None) -> XPOPlan:
        """Chunks of whole pairs (every pair as wide as the micro-batch), each chunk's terms over the micro-batch's
        pair count, and the step's alpha."""
        num_pairs, width = ranked.rollout.num_pairs, ranked.rollout.input_ids.size(1)
        reason = self._one_chunk_reason()
        if reason is not None:
            self._log_fallback(f"{reason} (XPO runs the micro-batch as one chunk)")
            count = 1
        else:
            count = self._num_chunks_for([2 * width] * num_pairs, ranked.rollout.input_ids.device)
        chunks = plan_by_length(torch.full((num_pairs,), 2 * width), count)
        return XPOPlan(chunks, normaliser=num_pairs, alpha=self.alpha)

    def _chunk_loss(self, model, ranked: RankedRollout, plan: XPOPlan, chunk: Chunk):
        """One chunk's share of XPO's loss (its pairs' DPO and exploration terms over the micro-batch's pair count)
        and its stats."""
        rollout, num_pairs = ranked.rollout, plan.normaliser
        pairs = chunk.rows.to(ranked.chosen.device)
        rows = torch.cat([pairs, pairs + num_pairs])  # [2b] the policy's samples, then the reference's
        mask = rollout.completion_mask[rows]  # [2b, C]
        ref_logprobs = self._reference_logprobs(rollout, rows) * mask  # [2b, C] no grad, padding zeroed
        logprobs = self._completion_logprobs(model, rollout, rows, self._fused_head_obstacle) * mask  # [2b, C]
        logps, ref_logps = logprobs.sum(1), ref_logprobs.sum(1)  # [2b] each
        policy_chosen = ranked.chosen[pairs] < num_pairs  # [b] the policy's sample won
        terms = xpo_terms(torch.stack(logps.chunk(2), 1), torch.stack(ref_logps.chunk(2), 1), policy_chosen,
                          ranked.beta, plan.alpha, self.args.loss_type)  # fmt: skip
        loss = (terms.dpo + terms.xpo).sum() / num_pairs
        stats = {name: chunk.spread(getattr(terms, name).detach(), num_pairs) for name in PAIR_STATS}
        # per completion (rows in generation order): TRL's KL and entropy sum the completion's tokens only
        stats["kl"] = _place((logprobs.detach() - ref_logprobs).sum(1), rows, 2 * num_pairs)
        stats["logprob_sum"] = _place(logps.detach(), rows, 2 * num_pairs)
        return loss, stats

    def _log_chunk_metrics(self, mode: str, ranked: RankedRollout, plan: XPOPlan, totals: ChunkStats) -> None:
        """Append the step's stats to self.stats with TRL's XPO names and reductions."""
        stats, beta, num_pairs = self.stats, ranked.beta, plan.normaliser

        def gather_mean(value: torch.Tensor) -> float:
            return self.accelerator.gather_for_metrics(value).mean().item()

        stats["loss/dpo"].append(gather_mean(totals["dpo"]))
        stats["loss/xpo"].append(gather_mean(totals["xpo"]))
        if "objective/model_scores" in stats:
            model_scores, ref_scores = ranked.rewards[:num_pairs], ranked.rewards[num_pairs:]  # [B] each
            stats["objective/model_scores"].append(gather_mean(model_scores))
            stats["objective/ref_scores"].append(gather_mean(ref_scores))
            stats["objective/scores_margin"].append(gather_mean(model_scores - ref_scores))
        chosen, rejected = totals["chosen_logps"], totals["rejected_logps"]  # [B] the policy's
        chosen_ref, rejected_ref = totals["chosen_ref_logps"], totals["rejected_ref_logps"]
        # TRL's XPO logs the policy's mean summed log-prob plus the reference model's, kept so curves compare
        stats["logps/chosen"].append(gather_mean(chosen.mean() + chosen_ref.mean()))
        stats["logps/rejected"].append(gather_mean(rejected.mean() + rejected_ref.mean()))
        chosen_rewards, rejected_rewards = beta * (chosen - chosen_ref), beta * (rejected - rejected_ref)  # [B]
        stats["rewards/chosen"].append(gather_mean(chosen_rewards.mean()))
        stats["rewards/rejected"].append(gather_mean(rejected_rewards.mean()))
        # over both samples of every pair: (mean over the policy's + mean over the reference's) / 2
        stats["objective/kl"].append(gather_mean(totals["kl"].mean()))
        stats["objective/entropy"].append(gather_mean(-totals["logprob_sum"].mean()))
        margins = chosen_rewards - rejected_rewards
        stats["rewards/margins"].append(gather_mean(margins.mean()))
        stats["rewards/accuracies"].append(gather_mean((margins > 0).float().mean()))
        policy_eos, reference_eos = ranked.contain_eos[:num_pairs], ranked.contain_eos[num_pairs:]
        stats["val/model_contain_eos_token"].append(gather_mean(policy_eos.float()))
        stats["val/ref_contain_eos_token"].append(gather_mean(reference_eos.float()))
        stats["alpha"].append(plan.alpha)
        stats["beta"].append(beta)

