"""One PPO rollout, from its prompts to the buffer its optimizer steps train on (`RolloutBuffer`).

What needs the trainer (the engine it keeps, the reward functions it calls, metrics reduced over processes) stays in
trainer.py; this module holds the rest, in the order a rollout runs:
- its sequences: `stop_token_ids`, `prompt_token_ids`, `left_pad`, `sample_with_generate` (the transformers
  backend; the engine's is the trainer's), `cut_at_eos`; as tensors, `rollout_tensors` and `sequence_lengths`;
- its scores: `reward_name`, `reward_inputs` (what reward functions receive), `reward_model_scores` (a reward
  model's), `penalise_missing_eos`, and `score_rollout`, the gradient-free pass giving old log-probs, values and
  reference log-probs;
- `build_buffer`: per-token rewards, GAE, whitened advantages and each pass's row order, kept in a `RolloutBuffer`,
  whose `micro_batch` is what `compute_loss` reads at each micro-step; `sequence_sums` for the rollout's metrics.
Shapes: N sequences (one completion per prompt, this process's share), P prompt columns (left-padded), T completion
columns (right-padded).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch
from torch import nn

from slimrl.trainers.common.chunked_step import Chunk, chunk_sequences
from slimrl.trainers.ppo import losses as pm
from slimrl.trainers.ppo.value_model import PolicyAndValue, policy_logprobs

if TYPE_CHECKING:
    from slimrl.trainers.ppo.config import PPOConfig

# the per-sequence fields of the buffer, [N, P] or [N, T]: a micro-batch is their rows
ROW_FIELDS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "old_logps", "old_values",
              "advantages", "returns")  # fmt: skip


@dataclass
class RolloutBuffer:
    """A scored rollout, trained on for `num_ppo_epochs` passes of `num_mini_batches` mini-batches (optimizer steps)
    of `gradient_accumulation_steps` micro-batches each."""

    prompt_ids: torch.Tensor  # [N, P] long, left-padded
    prompt_mask: torch.Tensor  # [N, P] long, 1 on real tokens
    completion_ids: torch.Tensor  # [N, T] long, right-padded; up to and including the EOS
    completion_mask: torch.Tensor  # [N, T] long, 1 on real tokens
    old_logps: torch.Tensor  # [N, T] fp32, the sampling policy's log-probs (the ratio's denominator)
    old_values: torch.Tensor  # [N, T] fp32, the value of the state before each token; 0 on padding
    advantages: torch.Tensor  # [N, T] fp32, GAE's, whitened over the rollout's real tokens; 0 on padding
    returns: torch.Tensor  # [N, T] fp32, GAE's advantages + values (the value loss's targets); 0 on padding
    order: torch.Tensor  # [epochs, N] long, each pass's permutation of the rows
    stopped: bool = False  # past target_kl: the rollout's later micro-steps train nothing
    metrics: dict[str, float] = field(default_factory=dict)  # the rollout's, logged with every step trained on it

    def micro_batch(self, position: int, micro_batch_size: int, accumulation_steps: int,
                    mini_batches: int) -> dict[str, torch.Tensor]:  # fmt: skip
        """What `compute_loss` reads at micro-step `position` of the rollout: the rows [b, ...] of every per-sequence
        field for its pass, mini-batch and micro-batch of the pass's permutation, and `minibatch_tokens` (the
        loss's divisor): the real completion tokens of its whole mini-batch, at least 1."""
        steps_per_pass = mini_batches * accumulation_steps
        steps = self.order.size(0) * steps_per_pass
        if not 0 <= position < steps:
            raise IndexError(f"micro-step {position} is not one of the rollout's {steps} (0 to {steps - 1}): pass the "
                             "trainer's micro-step modulo micro_steps_per_rollout.")  # fmt: skip
        epoch, within = divmod(position, steps_per_pass)
        minibatch, micro = divmod(within, accumulation_steps)
        minibatch_size = micro_batch_size * accumulation_steps
        minibatch_rows = self.order[epoch][minibatch * minibatch_size : (minibatch + 1) * minibatch_size]
        rows = minibatch_rows[micro * micro_batch_size : (micro + 1) * micro_batch_size]
        batch = {name: getattr(self, name).index_select(0, rows) for name in ROW_FIELDS}
        batch["minibatch_tokens"] = self.completion_mask.index_select(0, minibatch_rows).sum().clamp(min=1)
        return batch

    def to_dict(self) -> dict:
        """The fields as a plain dict of tensors, a bool and floats: what `torch.load(weights_only=True)` reads back
        (ResumableTrainerMixin saves the buffer with each checkpoint and loads it that way)."""
        return {item.name: getattr(self, item.name) for item in fields(self)}

    @classmethod
    def from_dict(cls, state: dict) -> RolloutBuffer:
        """The buffer `to_dict` gave (or a checkpoint saved by the trainer before the buffer was a dataclass)."""
        missing = {item.name for item in fields(cls)} - set(state)
        if missing:
            raise ValueError(f"a saved PPO rollout buffer lacks {sorted(missing)}: resume from a checkpoint saved by "
                             "slimrl's PPOTrainer.")  # fmt: skip
        return cls(**{item.name: state[item.name] for item in fields(cls)})


# -- a rollout's sequences -------------------------------------------------------------------------------------------


def stop_token_ids(model: nn.Module, tokenizer) -> list[int]:
    """The tokens that end a completion: the model's generation config's EOS ids and the tokenizer's, sorted."""
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    eos = set([eos] if isinstance(eos, int) else eos or []) | {tokenizer.eos_token_id}
    return sorted(e for e in eos if e is not None)


def prompt_token_ids(prompts: list, tokenizer) -> list[list[int]]:
    """Each prompt's token ids: a conversation rendered by the chat template, text as it is; no special tokens
    added (the template has them)."""
    from trl.data_utils import maybe_apply_chat_template

    texts = [maybe_apply_chat_template({"prompt": prompt}, tokenizer)["prompt"] for prompt in prompts]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def left_pad(sequences: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [N, P], mask [N, P]) of left-padded sequences."""
    width = max(len(s) for s in sequences)
    ids = torch.tensor([[pad] * (width - len(s)) + list(s) for s in sequences], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences], dtype=torch.long)
    return ids, mask


def cut_at_eos(tokens: list[int], eos_ids: list[int]) -> list[int]:
    """The tokens up to and including the first EOS (all of them when there is none)."""
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1]
    return tokens


def sample_with_generate(policy: nn.Module, prompt_ids: list[list[int]], args: PPOConfig, eos_ids: list[int],
                         pad: int, device: torch.device) -> list[list[int]]:  # fmt: skip
    """One completion per prompt sampled by transformers' `generate` with the config's sampling settings (the
    backend off CUDA): token ids up to and including the EOS."""
    from transformers import GenerationConfig

    padded, attention = (t.to(device) for t in left_pad(prompt_ids, pad))
    config = GenerationConfig(max_new_tokens=args.response_length, do_sample=True, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, eos_token_id=eos_ids, pad_token_id=pad)  # fmt: skip
    output = policy.generate(input_ids=padded, attention_mask=attention, generation_config=config)
    return [cut_at_eos(row, eos_ids) for row in output[:, padded.size(1) :].tolist()]


def rollout_tensors(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts [N, P] and right-padded completions [N, T], with their masks."""
    prompts, prompt_mask = left_pad(prompt_ids, pad)
    width = max(1, max(len(c) for c in completion_ids))
    completions = torch.tensor([list(c) + [pad] * (width - len(c)) for c in completion_ids], dtype=torch.long)
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completion_ids], dtype=torch.long)
    return {"prompt_ids": prompts, "prompt_mask": prompt_mask, "completion_ids": completions,
            "completion_mask": completion_mask}  # fmt: skip


def sequence_lengths(batch: dict) -> list[int]:
    """Real tokens of each sequence, prompt and completion: what the chunk count is planned from."""
    return (batch["prompt_mask"].sum(1) + batch["completion_mask"].sum(1)).tolist()


# -- its scores ------------------------------------------------------------------------------------------------------


def reward_name(func) -> str:
    """The name a reward function's metric carries (`rewards/<name>`): a reward model's last path part, else the
    function's name."""
    if isinstance(func, nn.Module):
        return (func.config._name_or_path or type(func).__name__).split("/")[-1]
    return func.__name__


def reward_inputs(rows: list[dict], prompts: list, completion_ids: list[list[int]],
                  tokenizer) -> tuple[list, dict[str, list], bool]:  # fmt: skip
    """What the reward functions receive, as TRL's GRPO passes it: (the completions as text, or as one assistant
    message each for conversational prompts; the dataset's other columns by name; whether the prompts are
    conversational)."""
    from trl.data_utils import is_conversational

    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    conversational = is_conversational({"prompt": prompts[0]})
    completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
    columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
    return completions, columns, conversational


def reward_model_scores(model: nn.Module, tokenizer, prompts: list, completions: list,
                        conversational: bool) -> torch.Tensor:  # fmt: skip
    """A sequence-classification reward model's score [N] of each prompt + completion, as text in its own
    tokenizer."""
    pairs = zip(prompts, completions, strict=True)
    texts = [tokenizer.apply_chat_template(p + c, tokenize=False) if conversational else p + c for p, c in pairs]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    device = next(model.parameters()).device
    return model(**{k: v.to(device) for k, v in inputs.items()}).logits[:, 0].float()


def penalise_missing_eos(scores: torch.Tensor, completion_ids: list[list[int]], eos_ids: list[int],
                         penalty: float | None) -> torch.Tensor:  # fmt: skip
    """The scores [N] less `penalty` for each completion that stopped at the length limit rather than at an EOS."""
    if penalty is None:
        return scores
    ended = torch.tensor([bool(c) and c[-1] in eos_ids for c in completion_ids], device=scores.device)
    return scores - penalty * (~ended).float()


@torch.no_grad()
def score_rollout(model: PolicyAndValue, ref_model: nn.Module | None, batch: dict, chunks: list[Chunk],
                  temperature: float, with_reference: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Old log-probs, values and reference log-probs [N, T] of a rollout, gradient-free, chunk by chunk. The
    reference is `ref_model`, else the policy with its adapter disabled; a full policy without one is its own
    reference (KL 0: only when kl_coef=0, see `value_model.reference_model`). with_reference=False (kl_coef=0) skips
    the reference forward: the reference log-probs returned are the old ones."""
    mask = batch["completion_mask"]
    old_logps, values, ref_logps = (torch.zeros(mask.shape, device=mask.device) for _ in range(3))
    for chunk in chunks:
        ids, attention = chunk_sequences(batch, chunk)
        logps, _, chunk_values = model(ids, attention, chunk.width, temperature)
        old_logps[chunk.rows, : chunk.width], values[chunk.rows, : chunk.width] = logps, chunk_values
        if with_reference and ref_model is not None:
            logps = policy_logprobs(ref_model, ids, attention, chunk.width, temperature)[0]
        elif with_reference and hasattr(model.policy, "disable_adapter"):
            with model.reference():
                logps = policy_logprobs(model.policy, ids, attention, chunk.width, temperature)[0]
        ref_logps[chunk.rows, : chunk.width] = logps
    return old_logps, values, ref_logps


# -- its buffer ------------------------------------------------------------------------------------------------------


@torch.no_grad()
def build_buffer(model: PolicyAndValue, ref_model: nn.Module | None, batch: dict[str, torch.Tensor],
                 scores: torch.Tensor, chunks: list[Chunk], args: PPOConfig) -> tuple[RolloutBuffer, pm.TokenRewards]:
    """The buffer of a generated and scored rollout (`batch`: `rollout_tensors` on the training device; `scores`
    [N]), with its metrics left empty, and the per-token rewards the trainer's metrics read. The scoring pass runs
    in `chunks`; then per-token rewards (KL penalty, score at the last token), optionally whitened, GAE with
    (gamma, lam), advantages whitened over the rollout's real tokens, and a fresh permutation per pass."""
    old_logps, old_values, ref_logps = score_rollout(model, ref_model, batch, chunks, args.temperature,
                                                     with_reference=args.kl_coef > 0)  # fmt: skip
    mask = batch["completion_mask"]
    rewards = pm.token_rewards(scores, old_logps, ref_logps, mask, args.kl_coef, args.kl_estimator)
    per_token = pm.masked_whiten(rewards.rewards, mask, shift_mean=False) if args.whiten_rewards \
        else rewards.rewards  # fmt: skip
    advantages, returns = pm.gae(per_token, old_values, mask, args.gamma, args.lam)
    order = torch.stack([torch.randperm(mask.size(0)) for _ in range(args.num_ppo_epochs)]).to(mask.device)
    buffer = RolloutBuffer(**batch, old_logps=old_logps, old_values=old_values * mask,
                           advantages=pm.masked_whiten(advantages, mask), returns=returns, order=order)  # fmt: skip
    return buffer, rewards


def sequence_sums(rewards: pm.TokenRewards, buffer: RolloutBuffer, with_kl: bool) -> dict[str, torch.Tensor]:
    """Per-sequence sums [N] over each completion's tokens of TRL 0.x's rollout metrics (the trainer averages them
    over sequences and processes). with_kl=False (kl_coef=0): no reference pass was made, so no KL, as GRPO logs
    none at beta 0."""
    real = buffer.completion_mask.bool()
    sums = {"objective/kl": rewards.kl.sum(1), "objective/entropy": torch.where(real, -buffer.old_logps, 0.0).sum(1),
            "objective/non_score_reward": rewards.non_score_reward.sum(1)}  # fmt: skip
    if not with_kl:
        del sums["objective/kl"]
    return sums


__all__ = ["ROW_FIELDS", "RolloutBuffer", "build_buffer", "cut_at_eos", "left_pad", "penalise_missing_eos",
           "prompt_token_ids", "reward_inputs", "reward_model_scores", "reward_name", "rollout_tensors",
           "sample_with_generate", "score_rollout", "sequence_lengths", "sequence_sums", "stop_token_ids"]  # fmt: skip
