"""The chunked training step of slimrl's online DPO trainer, and the pair math it shares with TRL's.

TRL's online DPO step samples two completions per prompt (rows i and B + i of the generation complete prompt i),
scores all 2B with the reward functions, makes the better of each pair "chosen", and takes the DPO loss of the pair's
log-ratio margin against the reference. Its `training_step` runs the policy over all 2B sequences at once, so the
`[2B, T, vocab]` logits and every layer's activations of the micro-batch are alive together.

`ChunkedOnlineDPOStep.training_step` ranks the pairs first (the rewards need only the completions), then runs the
pairs in chunks through the chunk-plan protocol (trainers/common/chunked_trainer.py) with the ranked rollout as its
inputs, a pair's chosen and rejected sequence always together: per chunk the reference log-probs (no grad),
the policy's through TRL's fused LM head (no `[tokens, vocab]` logits), the chunk's pair losses summed over the
micro-batch's pair count, and its backward. The loss is a mean over pairs, so the summed gradient is TRL's. Every
chunk keeps the micro-batch's full width: TRL's objective/kl and objective/entropy sum over padding columns too, and
its forward places tokens by column (no position ids), so trimming a chunk's padding would change both.

Where chunks cannot reproduce TRL exactly, TRL's one-piece step runs instead, logged once per reason: vision inputs,
active dropout (chunks draw other masks), LOMO optimizers (they step inside backward), DataParallel, and loss types
other than sigmoid and ipo (TRL raises for them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.training_args import OptimizerNames
from trl.data_utils import is_conversational
from trl.experimental.utils import empty_cache

from slimrl.trainers.common.chunked_step import Chunk, ChunkStats, plan_by_length
from slimrl.trainers.common.chunked_trainer import ChunkPlan

__all__ = ["PAIR_LOSSES", "ChunkedOnlineDPOStep", "pair_losses", "rank_pairs"]

PAIR_LOSSES = ("sigmoid", "ipo")  # TRL 1.16's online DPO loss types
# per-pair [B] stats (pair order) and per-sequence [2B] stats (generation order), summed over chunks
PAIR_STATS = ("chosen_logps", "rejected_logps", "chosen_ref_logps", "rejected_ref_logps")
ROW_STATS = ("kl", "non_score_reward", "logprob_sum")


def rank_pairs(rewards: torch.Tensor, num_pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen rows [B], rejected rows [B]) of a block-layout generation whose rewards are [2B]: pair i is rows i
    and B + i, and the first wins ties, as in TRL."""
    first_wins = rewards[:num_pairs] >= rewards[num_pairs:]  # [B] bool
    pairs = torch.arange(num_pairs, device=rewards.device)
    return pairs + (~first_wins) * num_pairs, pairs + first_wins * num_pairs


def pair_losses(margins: torch.Tensor, beta: float, loss_type: str) -> torch.Tensor:
    """Per-pair losses [b] from the policy's log-ratio margin minus the reference's, [b]."""
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * margins)
    if loss_type == "ipo":
        return (margins - 1 / (2 * beta)) ** 2
    raise NotImplementedError(f"invalid loss type {loss_type}")


@dataclass(frozen=True)
class Rollout:
    """One micro-batch's generation in TRL's block layout (rows i and B + i complete prompt i)."""

    prompt_ids: torch.Tensor  # [2B, P] left-padded
    prompt_mask: torch.Tensor  # [2B, P]
    completion_ids: torch.Tensor  # [2B, C] padded after the first EOS
    completion_mask: torch.Tensor  # [2B, C] 1 up to and including the first EOS
    # the fused head's inputs: the prompt cut on the left to max_length as TRL's forward cuts it, then completions
    input_ids: torch.Tensor  # [2B, P' + C]
    attention_mask: torch.Tensor  # [2B, P' + C]
    labels: torch.Tensor  # [2B, P' + C] -100 on the prompt, the completion ids (padding included) after it

    @property
    def num_pairs(self) -> int:
        return self.completion_ids.size(0) // 2


@dataclass(frozen=True)
class RankedRollout:
    """What the chunked loss of one step reads: the rollout, its rewards [2B], the chosen and rejected rows [B] of
    each pair, which completions hold an EOS [2B], and the step's beta."""

    rollout: Rollout
    rewards: torch.Tensor
    chosen: torch.Tensor
    rejected: torch.Tensor
    contain_eos: torch.Tensor
    beta: float


def _place(values: torch.Tensor, rows: torch.Tensor, size: int) -> torch.Tensor:
    """`values` [n] at `rows` of a zero vector [size]; summed over chunks they assemble the full vector."""
    return torch.zeros(size, dtype=values.dtype, device=values.device).index_copy(0, rows, values)


class ChunkedOnlineDPOStep:
    """TRL's online DPO `training_step`, in chunks of pairs. Goes after SlimTrainerMixin (which wraps this step) and
    before ChunkedTrainerMixin and TRL's class in the bases; the trainer sets `_fused_head_obstacle` and
    `_ref_head_obstacle`."""

    _fused_head_obstacle: str | None = None  # why the policy cannot score through the fused head (then TRL's forward)
    _ref_head_obstacle: str | None = None  # the same for a separate reference model

    def training_step(self, model, inputs, num_items_in_batch=None):
        # contract: TRL's step: two completions per prompt, ranked by the rewards, the DPO loss backpropagated
        # without the accumulation division (as TRL's), TRL's stats appended to self.stats, and the detached loss
        # divided by gradient_accumulation_steps returned
        reason = self._one_piece_reason(inputs, return_outputs=False)
        if reason is not None:
            self._log_fallback(reason)
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        result = self._chunked_loss(model, self._ranked_rollout(model, inputs), "train")
        self.accelerator.backward(result.loss)  # the last chunk's graph (earlier chunks' losses enter detached)
        steps = self.args.torch_empty_cache_steps
        if steps is not None and self.state.global_step % steps == 0:
            empty_cache()
        return result.loss.detach() / self.args.gradient_accumulation_steps

    def _one_piece_reason(self, inputs, return_outputs: bool) -> str | None:
        """Why this step must run as TRL's one-piece step, or None when chunks reproduce it."""
        if "image" in inputs:
            return "vision inputs are not chunked yet"
        if self.args.loss_type not in PAIR_LOSSES:
            return f"loss_type {self.args.loss_type!r} is not one slimrl knows how to chunk"
        if self.args.optim in (OptimizerNames.LOMO, OptimizerNames.ADALOMO):
            return "LOMO optimizers update the weights inside backward, which every chunk would call"
        if self.args.n_gpu > 1:
            return "DataParallel (n_gpu > 1) splits the micro-batch itself"
        if _has_active_dropout(self.accelerator.unwrap_model(self.model)):
            return "dropout is active (disable_dropout=False), and chunked forwards would draw other dropout masks"
        return None

    def _ga_divisor(self, num_items_in_batch) -> int:
        # TRL's online DPO backpropagates every micro-batch's loss undivided, so the inner chunks do too
        return 1

    def _backward_inner_chunk(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        # as TRL's step backpropagates through accelerate: DeepSpeed divides by the accumulation steps
        super()._backward_inner_chunk(loss, scale_wrt_gas=scale_wrt_gas)

    # -- generation and ranking ------------------------------------------------------------------------------------

    def _ranked_rollout(self, model, inputs) -> RankedRollout:
        """Generate two completions per prompt, score them and rank each pair."""
        rollout = self._rollout(model, inputs["prompt"])
        eos_ids = torch.tensor(self.eos_token_ids, device=rollout.completion_ids.device)
        contain_eos = torch.isin(rollout.completion_ids, eos_ids).any(dim=-1)  # [2B] bool
        rewards = self._rollout_rewards(inputs, rollout, contain_eos)  # [2B]
        chosen, rejected = rank_pairs(rewards, rollout.num_pairs)
        return RankedRollout(rollout, rewards, chosen, rejected, contain_eos, self.beta)

    def _rollout(self, model, prompts) -> Rollout:
        """Two completions per prompt from TRL's generation (or slimrl's engine behind `_generate`)."""
        if self.args.use_vllm:
            prompt_ids, prompt_mask, completion_ids, completion_mask = self._generate_vllm(prompts, None)
        else:
            prompt_ids, prompt_mask, completion_ids, completion_mask, _ = self._generate(model, prompts, None)
        cut = max(prompt_ids.size(1) + completion_ids.size(1) - self.max_length, 0)  # TRL's left truncation
        return Rollout(
            prompt_ids, prompt_mask, completion_ids, completion_mask,
            input_ids=torch.cat([prompt_ids[:, cut:], completion_ids], 1),
            attention_mask=torch.cat([prompt_mask[:, cut:], completion_mask], 1),
            labels=torch.cat([torch.full_like(prompt_ids[:, cut:], -100), completion_ids], 1),
        )  # fmt: skip

    def _rollout_rewards(self, inputs, rollout: Rollout, contain_eos: torch.Tensor) -> torch.Tensor:
        """The [2B] rewards TRL ranks the pairs by: its reward functions (the dataset's other columns repeated for
        the second completion of each prompt), less missing_eos_penalty where a completion has no EOS."""
        prompts = inputs["prompt"]
        completions = self.processing_class.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        if is_conversational({"prompt": prompts[0]}):
            completions = [[{"role": "assistant", "content": text}] for text in completions]
        columns = {key: value * 2 if isinstance(value, (list, tuple)) else value
                   for key, value in inputs.items() if key != "prompt"}  # fmt: skip
        rewards = self._calculate_rewards_from_functions(
            prompts=prompts * 2, completions=completions, completion_ids_list=rollout.completion_ids.tolist(),
            **columns,
        )  # fmt: skip
        if self.args.missing_eos_penalty is not None:
            rewards[~contain_eos] -= self.args.missing_eos_penalty
        return rewards

    # -- the chunked loss ------------------------------------------------------------------------------------------

    def _plan_micro_batch(self, model, ranked: RankedRollout, mode: str, num_items_in_batch=None) -> ChunkPlan:
        """The pairs in chunks, each chunk's pair losses over the micro-batch's pair count. Every pair is as long as
        the micro-batch (full width), so the plan just splits the pairs in order."""
        num_pairs, width = ranked.rollout.num_pairs, ranked.rollout.input_ids.size(1)
        count = self._num_chunks_for([2 * width] * num_pairs, ranked.rollout.input_ids.device)
        return ChunkPlan(plan_by_length(torch.full((num_pairs,), 2 * width), count), normaliser=num_pairs)

    def _chunk_loss(self, model, ranked: RankedRollout, plan: ChunkPlan, chunk: Chunk):
        """One chunk's share of TRL's loss (its pair losses over the micro-batch's pair count) and its stats."""
        rollout, num_pairs, beta = ranked.rollout, plan.normaliser, ranked.beta
        pairs = chunk.rows.to(ranked.chosen.device)
        rows = torch.cat([ranked.chosen[pairs], ranked.rejected[pairs]])  # [2b] chosen rows, then rejected rows
        mask = rollout.completion_mask[rows]  # [2b, C]
        ref_logprobs = self._reference_logprobs(rollout, rows)  # [2b, C] no grad
        logprobs = self._completion_logprobs(model, rollout, rows, self._fused_head_obstacle)  # [2b, C]
        logps, ref_logps = (logprobs * mask).sum(1), (ref_logprobs * mask).sum(1)  # [2b] each
        chosen_logps, rejected_logps = logps.chunk(2)
        chosen_ref, rejected_ref = ref_logps.chunk(2)
        margins = (chosen_logps - rejected_logps) - (chosen_ref - rejected_ref)  # [b]
        loss = pair_losses(margins, beta, self.args.loss_type).sum() / num_pairs
        # TRL's KL and entropy sum every completion column, padding included
        kl = logprobs.detach() - ref_logprobs  # [2b, C]
        per_pair = (chosen_logps, rejected_logps, chosen_ref, rejected_ref)
        per_row = (kl.sum(1), (-beta * kl).sum(1), logprobs.detach().sum(1))
        stats = {name: chunk.spread(value.detach(), num_pairs)
                 for name, value in zip(PAIR_STATS, per_pair, strict=True)}  # fmt: skip
        stats.update({name: _place(value, rows, 2 * num_pairs) for name, value in zip(ROW_STATS, per_row, strict=True)})
        return loss, stats

    def _reference_logprobs(self, rollout: Rollout, rows: torch.Tensor) -> torch.Tensor:
        """The reference's completion log-probs [2b, C] of `rows`: the reference model, or the policy with its
        adapter disabled (TRL's choice between them)."""
        with torch.no_grad():
            if self.ref_model is not None:
                return self._completion_logprobs(self.ref_model, rollout, rows, self._ref_head_obstacle)
            with self.model.disable_adapter():
                return self._completion_logprobs(self.model, rollout, rows, self._fused_head_obstacle)

    def _completion_logprobs(self, model, rollout: Rollout, rows: torch.Tensor, obstacle: str | None):
        """Per-token log-probs [2b, C] of the completions of `rows`, through the fused head where it serves (and the
        truncated prompt is not empty: TRL scores a prompt-less sequence its own way), else TRL's own forward."""
        width = rollout.completion_ids.size(1)
        if obstacle is not None or rollout.input_ids.size(1) == width:
            return self._forward(model, rollout.prompt_ids[rows], rollout.prompt_mask[rows],
                                 rollout.completion_ids[rows], rollout.completion_mask[rows])  # fmt: skip
        # alive until this chunk's backward: its activations (2b rows x P' + C columns) and the fused head's
        # per-token fp32 log-probs [2b, P' + C - 1], never [tokens, vocab]
        outputs = model(input_ids=rollout.input_ids[rows], attention_mask=rollout.attention_mask[rows],
                        labels=rollout.labels[rows], fused_lm_head=True, use_cache=False)  # fmt: skip
        return outputs.log_probs[:, -width:]

    # -- TRL's stats -----------------------------------------------------------------------------------------------

    def _log_chunk_metrics(self, mode: str, ranked: RankedRollout, plan: ChunkPlan, totals: ChunkStats) -> None:
        """Append the step's stats to self.stats with TRL's names and reductions."""
        gather, stats = self.accelerator.gather_for_metrics, self.stats
        rewards, chosen, rejected, beta = ranked.rewards, ranked.chosen, ranked.rejected, ranked.beta

        def mean_over_processes(value: torch.Tensor) -> float:
            return gather(value).mean().item()

        if self.reward_funcs is not None:
            stats["objective/scores_margin"].append(mean_over_processes((rewards[chosen] - rewards[rejected]).mean()))
            stats["objective/scores"].append(mean_over_processes(rewards.mean()))
        stats["val/contain_eos_token"].append(ranked.contain_eos.float().mean().item())
        stats["logps/chosen"].append(mean_over_processes(totals["chosen_logps"]))
        stats["logps/rejected"].append(mean_over_processes(totals["rejected_logps"]))
        stats["objective/kl"].append(mean_over_processes(totals["kl"].mean()))
        non_score_reward = totals["non_score_reward"]  # [2B]
        stats["objective/non_score_reward"].append(mean_over_processes(non_score_reward.mean()))
        if self.reward_funcs is not None:
            stats["objective/rlhf_reward"].append(mean_over_processes(rewards + non_score_reward))
        stats["objective/entropy"].append(mean_over_processes(-totals["logprob_sum"].mean()))
        chosen_rewards = gather(beta * (totals["chosen_logps"] - totals["chosen_ref_logps"]))
        rejected_rewards = gather(beta * (totals["rejected_logps"] - totals["rejected_ref_logps"]))
        stats["rewards/chosen"].append(chosen_rewards.mean().item())
        stats["rewards/rejected"].append(rejected_rewards.mean().item())
        margins = chosen_rewards - rejected_rewards
        stats["rewards/margins"].append(margins.mean().item())
        stats["rewards/accuracies"].append((margins > 0).float().mean().item())
        stats["beta"].append(beta)


def _has_active_dropout(model) -> bool:
    """Whether a forward in train mode draws random masks: a dropout module with p > 0, or attention dropout."""
    if any(isinstance(module, torch.nn.Dropout) and module.p > 0 for module in model.modules()):
        return True
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return float(getattr(text_config, "attention_dropout", 0.0) or 0.0) > 0
