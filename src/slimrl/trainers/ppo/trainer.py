"""slimrl's PPO trainer: a transformers Trainer whose steps are PPO's mini-batch updates on buffered rollouts.

TRL 1.16 ships no PPO; this is slimrl's own, with TRL 0.x's settings and metric names. A rollout:
  rollout_batch_size prompts --[slimrl's engine, or transformers' generate]--> one completion each
  --> reward functions / reward models --> scores [N]
  --> gradient-free pass in chunks: old log-probs and values, reference log-probs (adapter disabled)
  --> per-token rewards: -kl_coef * KL on every token, the score at the last real token (ppo_math.token_rewards)
  --> GAE (gamma, lam) --> advantages whitened over the rollout's real tokens --> buffer.
Then num_ppo_epochs passes of num_mini_batches mini-batches, each one optimizer step of gradient_accumulation_steps
micro-batches; each micro-batch runs in chunks of sequences: forward (log-probs, values) --> clipped policy loss +
vf_coef * clipped value loss, token sums divided by the mini-batch's token count (known before the first chunk)
--> backward. After each step its approximate KL is read; past target_kl, the rollout's other steps are skipped.

Overrides of transformers' Trainer, each for one reason (the Trainer's contract kept, said in a `contract:` line):
- `get_train_dataloader` / `_get_train_sampler`: a batch is one rollout's prompts, repeated for every micro-step
  that trains on it (TRL's RepeatSampler, as GRPO buffers its generations).
- `_prepare_inputs`: generates and scores a rollout at its first micro-step; returns the buffered micro-batch.
- `compute_loss`: the chunked PPO loss; `training_step`: the early stop, and each optimizer step's metrics.
- `log`: adds PPO's metrics (TRL 0.x names) averaged over the steps since the last log.
- `_save` / `_load_from_checkpoint`: the policy as `save_pretrained` writes it, the value function beside it.
`SlimTrainerMixin` adds the NaN guards, `ResumableTrainerMixin` saves the rollout buffer with each checkpoint.
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
from slimrl.trainers.common.chunked_trainer import ChunkedTrainerMixin
from slimrl.trainers.common.dataset_checks import check_prompt_column
from slimrl.trainers.common.resume import ResumableTrainerMixin
from slimrl.trainers.common.rewards_guard import check_reward_table, guard_reward_funcs
from slimrl.trainers.ppo import losses as pm
from slimrl.trainers.ppo import value_model as vm
from slimrl.trainers.ppo.config import PPOConfig, check_train_dataset

__all__ = ["PPOConfig", "PPOTrainer"]
logger = logging.getLogger(__name__)

ROW_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "old_logps", "old_values",
            "advantages", "returns")  # fmt: skip  # per-sequence tensors of the rollout buffer, [N, P] or [N, T]
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
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = set([eos] if isinstance(eos, int) else eos or []) | {processing_class.eos_token_id}
        self.eos_token_ids = sorted(e for e in eos if e is not None)
        self.pad_token_id = processing_class.pad_token_id if processing_class.pad_token_id is not None else \
            self.eos_token_ids[0]  # fmt: skip
        self._metrics = {"train": defaultdict(list)}
        self._step, self._episode, self._buffered_inputs = 0, 0, None
        self._step_sums: torch.Tensor | None = None  # [len(STEP_STATS) + 1] token sums of the optimizer step so far
        from slimrl.trainers.rollouts.generation import choose_backend, fast_inference_of

        self._rollout_engine = None
        self.generation_backend, reason = choose_backend(args.generation_backend, model, use_vllm=False,
                                                         use_continuous_batching=False,
                                                         fast_inference=fast_inference_of(model))  # fmt: skip
        logger.info("slimrl PPO: rollouts from %s (%s).", self.generation_backend, reason)
        self._apply_memory_savers()

    def _setup_rewards(self, reward_funcs, processing_classes) -> None:
        funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not funcs or any(f is None for f in funcs):
            raise ValueError("PPOTrainer needs reward_funcs: callables f(prompts, completions, **columns) -> "
                             "list[float], and/or reward models (a *ForSequenceClassification with one label).")
        self.reward_func_names = [(f.config._name_or_path or type(f).__name__).split("/")[-1] if isinstance(
            f, nn.Module) else f.__name__ for f in funcs]  # fmt: skip
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
        position = self._step % self.micro_steps_per_rollout
        if position == 0 or self._buffered_inputs is None:
            self._buffered_inputs = self._rollout(generation_batch)
        return self._micro_batch(position)

    def _micro_batch(self, position: int) -> dict:
        """The rows of micro-step `position` of the rollout: its pass, mini-batch and micro-batch of the pass's
        permutation, and the token count of its whole mini-batch (the loss's divisor)."""
        buffer, args = self._buffered_inputs, self.args
        ga, size = args.gradient_accumulation_steps, args.per_device_train_batch_size
        epoch, within = divmod(position, args.num_mini_batches * ga)
        minibatch, micro = divmod(within, ga)
        minibatch_rows = buffer["order"][epoch][minibatch * ga * size : (minibatch + 1) * ga * size]
        rows = minibatch_rows[micro * size : (micro + 1) * size]
        batch = {key: buffer[key].index_select(0, rows) for key in ROW_KEYS}
        batch["minibatch_tokens"] = buffer["completion_mask"].index_select(0, minibatch_rows).sum().clamp(min=1)
        return batch

    # -- the rollout -----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _rollout(self, rows: list[dict]) -> dict:
        """Generate, score and compute the advantages of one rollout; the buffer its micro-steps read."""
        from trl.data_utils import maybe_apply_chat_template

        tokenizer, device = self.processing_class, self.accelerator.device
        prompts = [row["prompt"] for row in rows]
        texts = [maybe_apply_chat_template({"prompt": p}, tokenizer)["prompt"] for p in prompts]
        prompt_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        completion_ids = self._generate(prompt_ids)
        batch = {k: v.to(device) for k, v in vm.rollout_tensors(prompt_ids, completion_ids, self.pad_token_id).items()}
        scores, reward_means = self._scores(rows, prompts, completion_ids)  # [N], {rewards/<name>: mean}
        scores = scores.to(device)
        if self.args.missing_eos_penalty is not None:
            ended = torch.tensor([bool(c) and c[-1] in self.eos_token_ids for c in completion_ids], device=device)
            scores = scores - self.args.missing_eos_penalty * (~ended).float()
        chunks = plan_chunks(batch["completion_mask"], self._num_chunks_for(vm.sequence_lengths(batch), device))
        old_logps, old_values, ref_logps = vm.score_rollout(self.accelerator.unwrap_model(self.model), self.ref_model,
                                                         batch, chunks, self.args.temperature,
                                                         with_reference=self.args.kl_coef > 0)  # fmt: skip
        args, mask = self.args, batch["completion_mask"]
        rewards = pm.token_rewards(scores, old_logps, ref_logps, mask, args.kl_coef, args.kl_estimator)
        per_token = pm.masked_whiten(rewards.rewards, mask, shift_mean=False) if args.whiten_rewards \
            else rewards.rewards  # fmt: skip
        advantages, returns = pm.gae(per_token, old_values, mask, args.gamma, args.lam)
        advantages = pm.masked_whiten(advantages, mask)
        metrics = {**reward_means, **self._rollout_metrics(scores, rewards, old_logps, batch)}
        order = torch.stack([torch.randperm(len(rows)) for _ in range(args.num_ppo_epochs)]).to(device)
        return {**batch, "old_logps": old_logps, "old_values": old_values * mask, "advantages": advantages,
                "returns": returns, "order": order, "stopped": False, "metrics": metrics}  # fmt: skip

    def _generate(self, prompt_ids: list[list[int]]) -> list[list[int]]:
        """One sampled completion per prompt from the policy as it is now: token ids up to and including the EOS."""
        from slimrl.trainers.rollouts.generation import inference_mode

        policy, args = self.accelerator.unwrap_model(self.model).policy, self.args
        with inference_mode(policy):
            if self.generation_backend == "engine":
                return self._engine_generate(policy, prompt_ids)
            from transformers import GenerationConfig

            padded, attention = (t.to(self.accelerator.device) for t in vm.left_pad(prompt_ids, self.pad_token_id))
            config = GenerationConfig(max_new_tokens=args.response_length, do_sample=True, temperature=args.temperature,
                                      top_p=args.top_p, top_k=args.top_k, eos_token_id=self.eos_token_ids,
                                      pad_token_id=self.pad_token_id)  # fmt: skip
            output = policy.generate(input_ids=padded, attention_mask=attention, generation_config=config)
        completions = output[:, padded.size(1) :].tolist()
        return [vm.cut_at_eos(row, self.eos_token_ids) for row in completions]

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
        from trl.data_utils import is_conversational

        texts = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        conversational = is_conversational({"prompt": prompts[0]})
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
        values, means = [], {}
        for func, name, tokenizer in zip(self.reward_funcs, self.reward_func_names, self.reward_processing_classes,
                                         strict=True):  # fmt: skip
            if isinstance(func, nn.Module):
                scores = _reward_model_scores(func, tokenizer, prompts, completions, conversational)
            else:  # the guard (rewards_guard.py) reads the output as TRL does: float32, NaN where it abstains
                func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
                scores = func.last_rewards
            values.append(scores.float().cpu())
            means[f"rewards/{name}"] = self._mean_across(scores.nanmean())
        table = torch.stack(values, 1)  # [N, F]
        # every process's values, so that all of them raise together
        check_reward_table(self.accelerator.gather(table.to(self.accelerator.device)).cpu(), self.reward_func_names)
        return (table * self.reward_weights).nansum(1), means

    def _rollout_metrics(self, scores, rewards: pm.TokenRewards, old_logps, batch) -> dict[str, float]:
        """TRL 0.x's rollout metrics: per-sequence sums over the completion's tokens, averaged over sequences. Each
        optimizer step trained on the rollout logs them (so a log averages the rollouts of its steps)."""
        mask = batch["completion_mask"].bool()
        sums = {"objective/kl": rewards.kl.sum(1), "objective/entropy": torch.where(mask, -old_logps, 0.0).sum(1),
                "objective/non_score_reward": rewards.non_score_reward.sum(1)}  # fmt: skip
        if self.args.kl_coef == 0:  # no reference pass was made (as GRPO logs no KL at beta 0)
            del sums["objective/kl"]
        means = {name: self._mean_across(value.mean()) for name, value in sums.items()}
        means["objective/scores"] = self._mean_across(scores.mean())
        means["objective/rlhf_reward"] = means["objective/non_score_reward"] + means["objective/scores"]
        eos = torch.isin(batch["completion_ids"], torch.tensor(self.eos_token_ids, device=mask.device)) & mask
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
        mask = inputs["completion_mask"]
        chunks = plan_chunks(mask, self._num_chunks_for(vm.sequence_lengths(inputs), mask.device))
        loss, totals = self._run_chunks(model, chunks, lambda chunk: self._chunk_loss(model, inputs, chunk),
                                        num_items_in_batch)  # fmt: skip
        sums = totals["sums"]
        self._step_sums = sums if self._step_sums is None else self._step_sums + sums
        return loss

    def _chunk_loss(self, model, inputs, chunk: Chunk):
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
        loss = (policy_sum + args.vf_coef * value_sum) / inputs["minibatch_tokens"]
        parts = (policy_sum, value_sum, policy.clipped.float(), value.clipped.float(),
                 pm.approx_kl(logps.detach(), old_logps), entropies, ratio.detach())  # fmt: skip
        sums = torch.stack([p.detach() if p.dim() == 0 else pm.masked_sum(p, mask) for p in parts] + [mask.sum()])
        return loss, {"sums": sums.float()}

    def training_step(self, model, inputs, num_items_in_batch=None):
        # contract: the Trainer's (forward and backward of one micro-batch, its detached loss); a micro-step of an
        # early-stopped rollout runs nothing and returns 0 (no gradient: the optimizer leaves the weights as they are)
        buffer = self._buffered_inputs
        skipped = buffer is not None and buffer["stopped"] and self._step % self.micro_steps_per_rollout != 0
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
        for name, value in self._buffered_inputs["metrics"].items():
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
            self._buffered_inputs["stopped"] = True

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


# -- helpers ----------------------------------------------------------------------------------------------------------


def _reward_model_scores(model, tokenizer, prompts, completions, conversational: bool) -> torch.Tensor:
    """A sequence-classification reward model's score of each prompt + completion, as text in its own tokenizer."""
    pairs = zip(prompts, completions, strict=True)
    texts = [tokenizer.apply_chat_template(p + c, tokenize=False) if conversational else p + c for p, c in pairs]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    device = next(model.parameters()).device
    return model(**{k: v.to(device) for k, v in inputs.items()}).logits[:, 0].float()
