"""slimrl's PPO trainer: a transformers Trainer whose steps are PPO's mini-batch updates on buffered rollouts.

TRL 1.16 ships no PPO; this is slimrl's own, with TRL 0.x's settings and metric names. A rollout (`_rollout`):
  rollout_batch_size prompts --[slimrl's engine, or transformers' generate]--> one completion each
  --> reward functions / reward models --> scores [N]
  --> gradient-free pass in chunks: old log-probs and values, reference log-probs (adapter disabled)
  --> per-token rewards: -kl_coef * KL on every token, the score at the last real token (losses.token_rewards)
  --> GAE (gamma, lam) --> advantages whitened over the rollout's real tokens --> a `RolloutBuffer`.
Then num_ppo_epochs passes of num_mini_batches mini-batches, each one optimizer step of gradient_accumulation_steps
micro-batches (`RolloutBuffer.micro_batch`); each micro-batch runs in chunks of sequences: forward (log-probs,
values) --> clipped policy loss + vf_coef * clipped value loss, token sums divided by the mini-batch's token count
(known before the first chunk) --> backward. After each step its approximate KL is read; past target_kl, the
rollout's other steps are skipped. Beside this file: rollout.py (the buffer, and the rollout's steps that need no
trainer), value_model.py (policy and value function as one module, its saving), losses.py (the math), config.py.

Overrides of transformers' Trainer, each for one reason (the Trainer's contract kept, said in a `contract:` line):
- `get_train_dataloader` / `_get_train_sampler`: a batch is one rollout's prompts, repeated for every micro-step
  that trains on it (TRL's RepeatSampler, as GRPO buffers its generations).
- `_prepare_inputs`: generates and scores a rollout at its first micro-step; returns the buffered micro-batch.
- `compute_loss`: the chunked PPO loss, through the chunk-plan protocol (common/chunked_trainer.py:
  `_plan_micro_batch`, `_chunk_loss`, `_log_chunk_metrics`); `training_step`: the early stop, each step's metrics.
- `log`: adds PPO's metrics (TRL 0.x names) averaged over the steps since the last log.
- `_save` / `_load_from_checkpoint`: the policy as `save_pretrained` writes it, the value function beside it.
`SlimTrainerMixin` adds the NaN guards, `ResumableTrainerMixin` saves the rollout buffer with each checkpoint (as
the plain dict `_buffered_inputs`).
"""

from __future__ import annotations

import logging
import math
import os
from collections import defaultdict

import torch
from torch import nn
from transformers import Trainer
from transformers.trainer import TRAINING_ARGS_NAME

from slimrl.ops.finite import drop_gradients, trainable_parameters
from slimrl.trainers.common.base import SlimTrainerMixin
from slimrl.trainers.common.chunked_step import Chunk, chunk_sequences, plan_chunks, take
from slimrl.trainers.common.chunked_trainer import ChunkedTrainerMixin, ChunkPlan
from slimrl.trainers.common.dataset_checks import check_prompt_column
from slimrl.trainers.common.resume import ResumableTrainerMixin
from slimrl.trainers.common.rewards_guard import check_reward_table, guard_reward_funcs
from slimrl.trainers.ppo import losses as pm
from slimrl.trainers.ppo import rollout as ro
from slimrl.trainers.ppo import value_model as vm
from slimrl.trainers.ppo.config import PPOConfig, check_train_dataset
from slimrl.trainers.ppo.rollout import RolloutBuffer

__all__ = ["PPOConfig", "PPOTrainer"]
logger = logging.getLogger(__name__)

# per optimizer step: token sums of these, over the mini-batch's real tokens, then divided by its token count
STEP_STATS = ("loss/policy_avg", "loss/value_avg", "policy/clipfrac_avg", "val/clipfrac_avg", "policy/approxkl_avg",
              "policy/entropy_avg", "val/ratio")  # fmt: skip


def _rows(features: list[dict]) -> list[dict]:  # the collator: the trainer reads the dataset rows itself
    return features


class PPOTrainer(ResumableTrainerMixin, SlimTrainerMixin, ChunkedTrainerMixin, Trainer):
    """PPO with a value head on the policy (value_model=None) or a separate value model; reference = the policy with
    its adapter disabled (or ref_model); rewards from `reward_funcs(prompts, completions, **columns) -> list[float]`
    and/or reward models. Rollouts from slimrl's engine on CUDA, transformers' generate elsewhere."""

    _tag_names = ["trl", "ppo", "slimrl"]
    loss_is_scaled_for_ga = True  # a micro-batch's loss is already divided by its mini-batch's token count
    resume_attributes = ("_step", "_buffered_inputs", "_episode")
    timed_phases = {"generation": "_generate", "reward": "_scores"}  # for slimrl.trainers.common.step_timer.StepTimer

    def __init__(self, model, reward_funcs, args: PPOConfig | None = None, train_dataset=None, processing_class=None,
                 value_model: nn.Module | None = None, ref_model: nn.Module | None = None,
                 reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 peft_config=None):  # fmt: skip
        model, processing_class = vm.load_policy(model, processing_class, peft_config)
        args = args if args is not None else PPOConfig(f"{model.config._name_or_path.split('/')[-1]}-PPO")
        if not isinstance(args, PPOConfig):
            raise TypeError(f"args must be a slimrl.PPOConfig (PPO's settings live there), got {type(args).__name__}.")
        check_prompt_column(train_dataset, "train_dataset", "PPO")
        check_train_dataset(train_dataset, args)
        self.ref_model = vm.reference_model(model, ref_model, args.kl_coef)
        for module in (model, value_model, self.ref_model):
            vm.disable_dropout(module)
        if args.total_episodes is not None:
            rollouts = math.ceil(args.total_episodes / (args.rollout_batch_size * args.world_size))
            args.max_steps = rollouts * args.steps_per_rollout
        super().__init__(model=vm.PolicyAndValue(model, value_model), args=args, data_collator=_rows,
                         train_dataset=train_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers)  # fmt: skip
        if self.ref_model is not None:
            self.ref_model.to(self.accelerator.device).eval()
        self._setup_rewards(reward_funcs, reward_processing_classes)
        self.eos_token_ids = ro.stop_token_ids(model, processing_class)
        self.pad_token_id = processing_class.pad_token_id if processing_class.pad_token_id is not None else \
            self.eos_token_ids[0]  # fmt: skip
        self._metrics = {"train": defaultdict(list)}
        self._step, self._episode = 0, 0
        self._rollout_buffer: RolloutBuffer | None = None  # the rollout being trained on
        self._step_sums: torch.Tensor | None = None  # [len(STEP_STATS) + 1] token sums of the optimizer step so far
        from slimrl.trainers.rollouts.generation import choose_backend, fast_inference_of

        self._rollout_engine = None
        self.generation_backend, reason = choose_backend(args.generation_backend, model, use_vllm=False,
                                                         use_continuous_batching=False,
                                                         fast_inference=fast_inference_of(model),
                                                         max_completion_length=args.response_length)  # fmt: skip
        logger.info("slimrl PPO: rollouts from %s (%s).", self.generation_backend, reason)
        self._apply_memory_savers()

    def _setup_rewards(self, reward_funcs, processing_classes) -> None:
        funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not funcs or any(f is None for f in funcs):
            raise ValueError("PPOTrainer needs reward_funcs: callables f(prompts, completions, **columns) -> "
                             "list[float], and/or reward models (a *ForSequenceClassification with one label).")
        self.reward_func_names = [ro.reward_name(func) for func in funcs]
        self.reward_funcs = guard_reward_funcs(funcs, self.reward_func_names, "PPO", supports_async=False)
        for func in funcs:
            if isinstance(func, nn.Module):
                func.to(self.accelerator.device).eval()
        classes = processing_classes if isinstance(processing_classes, (list, tuple)) else [processing_classes] * len(
            funcs)  # fmt: skip
        self.reward_processing_classes = [c or self.processing_class for c in classes]
        weights = self.args.reward_weights or [1.0] * len(funcs)
        if len(weights) != len(funcs):
            raise ValueError(f"reward_weights has {len(weights)} values for {len(funcs)} reward functions.")
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)

    def _apply_memory_savers(self) -> None:
        # contract: ChunkedTrainerMixin's, applied to the policy and a separate value model (not to their wrapper)
        from slimrl.models.lora import skip_input_casts_under_autocast

        wrapper = self.accelerator.unwrap_model(self.model)
        skip_input_casts_under_autocast(wrapper)
        self._offload_checkpoints([m for m in (wrapper.policy, wrapper.value_model) if m is not None])

    # -- data: one rollout's prompts per batch ---------------------------------------------------------------------

    @property
    def micro_steps_per_rollout(self) -> int:
        return self.args.steps_per_rollout * self.args.gradient_accumulation_steps

    def get_train_dataloader(self):
        # contract: the Trainer's loader; a batch is one rollout's prompts, repeated for each micro-step that uses it
        return self._get_dataloader(self.train_dataset, "Training", self.args.rollout_batch_size,
                                    sampler_fn=self._get_train_sampler, is_training=True)  # fmt: skip

    def _get_train_sampler(self, dataset=None):
        # contract: a sampler over the dataset's indices; whole rollouts, shuffled with args.seed, each repeated
        from trl.trainer.utils import RepeatSampler

        return RepeatSampler(dataset if dataset is not None else self.train_dataset, mini_repeat_count=1,
                             batch_size=self.args.rollout_batch_size * self.accelerator.num_processes,
                             repeat_count=self.micro_steps_per_rollout, seed=self.args.seed)  # fmt: skip

    def _set_signature_columns_if_needed(self):
        # contract: the columns the trainer reads; every column reaches the reward functions
        if self._signature_columns is None:
            self._signature_columns = ["prompt"]

    def _prepare_inputs(self, generation_batch):
        # contract: one micro-batch of tensors for compute_loss, from the Trainer's batch (here: a rollout's rows)
        position, args = self._step % self.micro_steps_per_rollout, self.args
        if position == 0 or self._rollout_buffer is None:
            self._rollout_buffer = self._rollout(generation_batch)
        return self._rollout_buffer.micro_batch(position, args.per_device_train_batch_size,
                                                args.gradient_accumulation_steps, args.num_mini_batches)  # fmt: skip

    @property
    def _buffered_inputs(self) -> dict | None:
        """The buffer as ResumableTrainerMixin saves it (its weights_only `torch.load` takes plain dicts); a copy."""
        return None if self._rollout_buffer is None else self._rollout_buffer.to_dict()

    @_buffered_inputs.setter
    def _buffered_inputs(self, state: dict | None) -> None:  # the mixin restores the saved dict on resume
        self._rollout_buffer = None if state is None else RolloutBuffer.from_dict(state)

    # -- the rollout -----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _rollout(self, rows: list[dict]) -> RolloutBuffer:
        """Generate, score and compute the advantages of one rollout; the buffer its micro-steps read."""
        device, prompts = self.accelerator.device, [row["prompt"] for row in rows]
        prompt_ids = ro.prompt_token_ids(prompts, self.processing_class)
        completion_ids = self._generate(prompt_ids)
        batch = {k: v.to(device) for k, v in ro.rollout_tensors(prompt_ids, completion_ids, self.pad_token_id).items()}
        scores, reward_means = self._scores(rows, prompts, completion_ids)  # [N], {rewards/<name>: mean}
        scores = ro.penalise_missing_eos(scores.to(device), completion_ids, self.eos_token_ids,
                                         self.args.missing_eos_penalty)  # fmt: skip
        chunks = plan_chunks(batch["completion_mask"], self._num_chunks_for(ro.sequence_lengths(batch), device))
        buffer, rewards = ro.build_buffer(self.accelerator.unwrap_model(self.model), self.ref_model, batch, scores,
                                          chunks, self.args)  # fmt: skip
        buffer.metrics = {**reward_means, **self._rollout_metrics(scores, rewards, buffer)}
        return buffer

    def _generate(self, prompt_ids: list[list[int]]) -> list[list[int]]:
        """One sampled completion per prompt from the policy as it is now: token ids up to and including the EOS."""
        from slimrl.trainers.rollouts.generation import inference_mode

        policy = self.accelerator.unwrap_model(self.model).policy
        with inference_mode(policy):
            if self.generation_backend == "engine":
                return self._engine_generate(policy, prompt_ids)
            return ro.sample_with_generate(policy, prompt_ids, self.args, self.eos_token_ids, self.pad_token_id,
                                           self.accelerator.device)  # fmt: skip

    def _engine_generate(self, policy, prompt_ids: list[list[int]]) -> list[list[int]]:
        from slimrl.rollout.sampling import SamplingParams
        from slimrl.trainers.rollouts.generation import local_engine

        if self._rollout_engine is None:
            self._rollout_engine = local_engine(policy, self.processing_class, self.args.deterministic_rollouts)
        engine, args = self._rollout_engine, self.args
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, logprobs=False,
                                stop_token_ids=self.eos_token_ids,
                                sampler="race" if engine.device.type == "cuda" else "multinomial")  # fmt: skip
        output = engine.generate(prompt_ids, params, max_new_tokens=args.response_length)
        engine.release()  # the KV cache goes back to training
        return output.completion_ids

    def _scores(self, rows: list[dict], prompts: list, completion_ids: list[list[int]]) -> tuple[torch.Tensor, dict]:
        """The weighted sum [N] of the reward functions' values (None or NaN: abstain, left out of the sum; a completion
        no function scored gets 0), and each one's mean. No reward at all in the rollout, or an infinite one, raises."""
        completions, columns, conversational = ro.reward_inputs(rows, prompts, completion_ids, self.processing_class)
        values, means = [], {}
        for func, name, tokenizer in zip(self.reward_funcs, self.reward_func_names, self.reward_processing_classes,
                                         strict=True):  # fmt: skip
            if isinstance(func, nn.Module):
                scores = ro.reward_model_scores(func, tokenizer, prompts, completions, conversational)
            else:  # the guard (rewards_guard.py) reads the output as TRL does: float32, NaN where it abstains
                func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
                scores = func.last_rewards
            values.append(scores.float().cpu())
            means[f"rewards/{name}"] = self._mean_across(scores.nanmean())
        table = torch.stack(values, 1)  # [N, F]
        # every process's values, so that all of them raise together
        check_reward_table(self.accelerator.gather(table.to(self.accelerator.device)).cpu(), self.reward_func_names)
        return (table * self.reward_weights).nansum(1), means

    def _rollout_metrics(self, scores, rewards: pm.TokenRewards, buffer: RolloutBuffer) -> dict[str, float]:
        """TRL 0.x's rollout metrics: per-sequence sums over the completion's tokens, averaged over sequences. Each
        optimizer step trained on the rollout logs them (so a log averages the rollouts of its steps)."""
        sums = ro.sequence_sums(rewards, buffer, with_kl=self.args.kl_coef != 0)  # {name: [N]}
        means = {name: self._mean_across(value.mean()) for name, value in sums.items()}
        means["objective/scores"] = self._mean_across(scores.mean())
        means["objective/rlhf_reward"] = means["objective/non_score_reward"] + means["objective/scores"]
        mask = buffer.completion_mask.bool()
        eos = torch.isin(buffer.completion_ids, torch.tensor(self.eos_token_ids, device=mask.device)) & mask
        means["val/num_eos_tokens"] = float(self.accelerator.reduce(eos.sum(), reduction="sum").item())
        means["completions/mean_length"] = self._mean_across(mask.sum(1).float().mean())  # as GRPO names it
        self._episode += len(scores) * self.accelerator.num_processes
        return means

    def _mean_across(self, value: torch.Tensor) -> float:
        return self.accelerator.gather(value.detach().float().reshape(1).to(self.accelerator.device)).mean().item()

    # -- the training step -----------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # contract: a scalar loss whose backward() completes the micro-batch's gradient (earlier chunks already
        # backpropagated), already divided for accumulation (loss_is_scaled_for_ga); no outputs
        if return_outputs:
            raise ValueError("PPOTrainer.compute_loss does not return outputs.")
        # slimrl's own loss: no TRL one-piece path to fall back to, so no _one_piece_reason
        mode = "train" if self.model.training else "eval"
        return self._chunked_loss(model, inputs, mode, num_items_in_batch).loss

    def _plan_micro_batch(self, model, inputs, mode: str, num_items_in_batch=None) -> ChunkPlan:
        """The micro-batch's sequences in chunks; each chunk's token sums over the mini-batch's token count."""
        mask = inputs["completion_mask"]
        chunks = plan_chunks(mask, self._num_chunks_for(ro.sequence_lengths(inputs), mask.device))
        return ChunkPlan(chunks, normaliser=inputs["minibatch_tokens"])

    def _chunk_loss(self, model, inputs, plan: ChunkPlan, chunk: Chunk):
        """One chunk's policy and value losses (token sums over the mini-batch's token count), and detached sums."""
        args, width = self.args, inputs["completion_ids"].size(1)
        mask = take(inputs["completion_mask"], chunk, width).float()  # [b, t]
        ids, attention = chunk_sequences(inputs, chunk)
        logps, entropies, values = model(ids, attention, chunk.width, args.temperature, with_entropy=True)  # [b, t]
        old_logps = take(inputs["old_logps"], chunk, width)
        ratio = pm.probability_ratio(logps, old_logps)
        policy = pm.clipped_policy_loss(ratio, take(inputs["advantages"], chunk, width), args.cliprange)
        value = pm.clipped_value_loss(values, take(inputs["old_values"], chunk, width),
                                      take(inputs["returns"], chunk, width), args.cliprange_value)  # fmt: skip
        policy_sum, value_sum = pm.masked_sum(policy.loss, mask), pm.masked_sum(value.loss, mask)
        loss = (policy_sum + args.vf_coef * value_sum) / plan.normaliser
        parts = (policy_sum, value_sum, policy.clipped.float(), value.clipped.float(),
                 pm.approx_kl(logps.detach(), old_logps), entropies, ratio.detach())  # fmt: skip
        sums = torch.stack([p.detach() if p.dim() == 0 else pm.masked_sum(p, mask) for p in parts] + [mask.sum()])
        return loss, {"sums": sums.float()}

    def _log_chunk_metrics(self, mode: str, inputs, plan: ChunkPlan, totals) -> None:
        """The micro-batch's token sums, added to the optimizer step's (read, reduced and logged by training_step)."""
        sums = totals["sums"]
        self._step_sums = sums if self._step_sums is None else self._step_sums + sums

    def training_step(self, model, inputs, num_items_in_batch=None):
        # contract: the Trainer's (forward and backward of one micro-batch, its detached loss); a micro-step of an
        # early-stopped rollout runs nothing and returns 0 (no gradient: the optimizer leaves the weights as they are)
        buffer = self._rollout_buffer
        skipped = buffer is not None and buffer.stopped and self._step % self.micro_steps_per_rollout != 0
        if skipped:
            loss = torch.zeros((), device=self.args.device)
        else:
            loss = super().training_step(model, inputs, num_items_in_batch)
        self._step += 1
        if self.accelerator.sync_gradients:
            self._end_optimizer_step(trained=not skipped)
        return loss

    def _end_optimizer_step(self, trained: bool) -> None:
        """The step's metrics: its rollout's, and when it trained its own (token means over its mini-batch, all
        processes); then the early stop: past target_kl, neither this step's update nor the rollout's later steps."""
        for name, value in self._rollout_buffer.metrics.items():
            self._metrics["train"][name].append(value)
        if not trained:
            return
        sums = self.accelerator.reduce(self._step_sums, reduction="sum").tolist()
        self._step_sums = None
        tokens = max(sums[-1], 1.0)
        for name, total in zip(STEP_STATS, sums[:-1], strict=True):
            self._metrics["train"][name].append(total / tokens)
        target = self.args.target_kl
        if target is not None and sums[STEP_STATS.index("policy/approxkl_avg")] / tokens > target:
            drop_gradients(trainable_parameters(self.model))  # this step's update is dropped too
            self._rollout_buffer.stopped = True

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # contract: the Trainer's; a training log also carries PPO's metrics, averaged over the steps since the last
        metrics = self._metrics["train"]
        if "loss" in logs and metrics:
            means = {name: sum(values) / len(values) for name, values in metrics.items() if values}
            if metrics.get("val/ratio"):  # the spread of the steps' mean ratios (population variance: 0 for one step)
                means["val/ratio_var"] = torch.tensor(metrics["val/ratio"], dtype=torch.float64).var(False).item()
            logs = {**logs, **means, "lr": logs.get("learning_rate", math.nan), "episode": self._episode}
            metrics.clear()
        super().log(logs, start_time)

    # -- checkpoints -------------------------------------------------------------------------------------------

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        # contract: the model's weights, tokenizer and training args in output_dir, loadable by _load_from_checkpoint
        output_dir = output_dir or self.args.output_dir
        self.accelerator.unwrap_model(self.model).save(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # contract: the checkpoint's weights loaded into the model, in place
        self.accelerator.unwrap_model(model if model is not None else self.model).load(resume_from_checkpoint)

    @property
    def rollout_engine(self):
        """slimrl's RolloutEngine once it has generated (None before, or with the transformers backend)."""
        return self._rollout_engine

