"""slimrl's XPO trainer (exploratory preference optimisation; TRL 1.16 removed TRL's): online DPO whose pair is the
policy's completion and the reference model's, with an exploration term, built on slimrl's online DPO trainer.

TRL's last XPOTrainer (trl.experimental.xpo, and trl.trainer.xpo_trainer in TRL 0.2x) subclassed online DPO; so
does this one, and everything but the pair, the loss and the stats is slimrl's online DPO trainer (the rollout
backends, reward functions and their checks, the fused LM head, the memory savers, the one-step training template).
Overrides, each for one reason:
- `__init__`: TRL's XPOTrainer arguments; `args=None` or an online DPO config becomes an XPO one (alpha at TRL's
  default); what XPO cannot do fails here (vLLM rollouts, LOMO optimizers, a loss type other than sigmoid and ipo);
  the stats get TRL's XPO names.
- `_generate`: online DPO's layout (rows i and B + i complete prompt i), row i sampled by the policy and row B + i
  by the reference model: the policy with its adapter disabled (slimrl's engine or transformers' generate, the
  engine reading the adapter's on/off switch at call time), or a separate reference model (transformers' generate).
- the chunked loss and the stats (trainers/xpo/step.py).
"""

from __future__ import annotations

import contextlib

import torch
from transformers.training_args import OptimizerNames
from trl.data_utils import maybe_apply_chat_template
from trl.experimental.utils import truncate_right
from trl.models.utils import unwrap_model_for_generation

from slimrl.trainers.online_dpo.step import PAIR_LOSSES
from slimrl.trainers.online_dpo.trainer import OnlineDPOConfig, OnlineDPOTrainer, _pad_rows
from slimrl.trainers.rollouts.rollout_fields import with_rollout_fields
from slimrl.trainers.xpo.config import TRL_DEFAULT_ALPHA, XPOConfig, checked_alpha
from slimrl.trainers.xpo.step import ChunkedXPOStep

__all__ = ["XPOConfig", "XPOTrainer"]

# TRL's XPO stats, in its order, then its score stats (TRL 1.16 always ranks by reward functions or models)
XPO_STATS = ("loss/dpo", "loss/xpo", "objective/kl", "objective/entropy", "rewards/chosen", "rewards/rejected",
             "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected", "val/model_contain_eos_token",
             "val/ref_contain_eos_token", "alpha", "beta")  # fmt: skip
SCORE_STATS = ("objective/model_scores", "objective/ref_scores", "objective/scores_margin")


class XPOTrainer(ChunkedXPOStep, OnlineDPOTrainer):
    """XPO: per prompt, the policy's and the reference model's completions, ranked by the reward functions; the DPO
    loss of the pair plus alpha times the policy's log-prob of the reference's completion."""

    _tag_names = ["trl", "xpo"]
    _name = "XPO"  # the model card's trainer and paper
    _paper = {
        "title": "Exploratory Preference Optimization: Harnessing Implicit Q*-Approximation for Sample-Efficient RLHF",
        "id": "2405.21046",
        "citation": "@article{xie2024exploratory,\n"
                    "    title  = {{Exploratory Preference Optimization: Harnessing Implicit Q*-Approximation for "
                    "Sample-Efficient RLHF}},\n"
                    "    author = {Tengyang Xie and Dylan J. Foster and Akshay Krishnamurthy and Corby Rosset and "
                    "Ahmed Awadallah and Alexander Rakhlin},\n"
                    "    year   = 2024,\n"
                    "    eprint = {arXiv:2405.21046}\n}",
    }  # fmt: skip

    def __init__(self, model, ref_model=None, reward_funcs=None, args=None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, peft_config=None,
                 compute_metrics=None, callbacks=None, optimizers=(None, None),
                 preprocess_logits_for_metrics=None):  # fmt: skip
        # contract: TRL 1.x's XPOTrainer arguments, positions and defaults (TRL 0.2x's `judge`, gone with TRL 1.16's
        # judges, becomes a reward function scoring 1 for the completion of each pair it prefers)
        args = _xpo_args(args, model)
        super().__init__(model, ref_model, reward_funcs, args, data_collator, train_dataset, eval_dataset,
                         processing_class, reward_processing_classes, peft_config, compute_metrics, callbacks,
                         optimizers, preprocess_logits_for_metrics)  # fmt: skip
        self._alpha = args.alpha
        self.stats = {name: [] for name in XPO_STATS + SCORE_STATS}

    @property
    def alpha(self) -> float:
        """The exploration term's weight this epoch: the config's float, or its list's entry for the epoch (the last
        one after the list ends)."""
        if isinstance(self._alpha, list):
            epoch = int(self.state.epoch or 0)
            return self._alpha[min(epoch, len(self._alpha) - 1)]
        return self._alpha

    def _generate(self, model, prompts, images=None):
        # contract: online DPO's (prompt ids [2B, P] left-padded and their mask, completion ids [2B, C] padded after
        # the first EOS and their mask up to and including it, None), row i the policy's completion of prompt i and
        # row B + i the reference model's, on the model's device, no grad
        if images is not None:
            raise ValueError("XPO takes text prompts only: drop the dataset's 'image' column.")
        texts = [maybe_apply_chat_template({"prompt": prompt}, self.processing_class)["prompt"] for prompt in prompts]
        encoded = self.processing_class(text=texts, add_special_tokens=False)["input_ids"]
        prompt_rows = [list(ids) for ids in encoded]
        policy_rows = self._sample(model, prompt_rows, engine=self._generation_backend == "engine")
        with self._reference_for_generation(model) as (reference, engine):
            reference_rows = self._sample(reference, prompt_rows, engine=engine)
        device, pad = next(model.parameters()).device, self._tokenizer.pad_token_id
        prompt_ids, prompt_mask = _pad_rows(prompt_rows * 2, pad, device, left=True)
        completion_ids, completion_mask = _pad_rows(policy_rows + reference_rows, pad, device, left=False)
        return prompt_ids, prompt_mask, completion_ids, completion_mask, None

    @contextlib.contextmanager
    def _reference_for_generation(self, model):
        """(the model that samples the reference's completions, whether slimrl's engine serves it): a separate
        reference model through transformers' generate, else the policy with its adapter disabled, by the in-process
        engine (it reads the switch when it reads the weights) or transformers' generate. The engine on its own
        generation_device holds a copy of the adapter it cannot switch off, so transformers' generate serves there."""
        if self.ref_model is not None:
            yield self.ref_model, False
            return
        in_process_engine = self._generation_backend == "engine" and self.args.generation_device is None
        with self.accelerator.unwrap_model(self.model).disable_adapter():
            yield model, in_process_engine

    def _sample(self, model, prompt_rows: list[list[int]], engine: bool) -> list[list[int]]:
        """One completion per token-id prompt (up to and including its first EOS), from slimrl's engine over the
        policy's weights or from `model`'s transformers generate with TRL's generation settings."""
        if engine:
            return self._engine_rollout(prompt_rows)[0]
        ids, mask = _pad_rows(prompt_rows, self._tokenizer.pad_token_id, next(model.parameters()).device, left=True)
        gather = self.args.ds3_gather_for_generation
        # the policy's FSDP shards gathered as TRL's generate gathers them (its adapter on or off)
        policy = model is not self.ref_model
        summon = _summon_full_params(self.model_wrapped) if self.is_fsdp_enabled and policy else None
        with (unwrap_model_for_generation(model, self.accelerator, gather_deepspeed3_params=gather,
                                          generation_kwargs=self.generation_kwargs) as unwrapped,
              torch.no_grad(), summon or contextlib.nullcontext()):  # fmt: skip
            if self.args.cache_implementation is not None:
                unwrapped.generation_config.cache_implementation = self.args.cache_implementation
            output = unwrapped.generate(input_ids=ids, attention_mask=mask, generation_config=self.generation_config)
        completions, kept = truncate_right(output[:, ids.size(1) :], self.eos_token_ids, self._tokenizer.pad_token_id)
        return [row[row_mask.bool()].tolist() for row, row_mask in zip(completions, kept, strict=True)]


def _summon_full_params(model):
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel.summon_full_params(model, recurse=False)


def _xpo_args(args, model):
    """The config XPO runs with: None becomes an XPOConfig named `<model>-XPO`; an online DPO config (TRL's or
    slimrl's) keeps its values and gains slimrl's fields and alpha at TRL's default. Refuses what XPO cannot do."""
    if args is None:
        args = with_rollout_fields(None, model, XPOConfig, "XPO")
    else:
        args = with_rollout_fields(args, model, OnlineDPOConfig, "XPO")
        args.alpha = checked_alpha(getattr(args, "alpha", TRL_DEFAULT_ALPHA))
    if args.use_vllm or args.generation_backend == "vllm":
        raise ValueError("XPO samples the reference model's completions with the policy's adapter disabled, which "
                         "TRL's vLLM integration cannot serve: set use_vllm=False (generation_backend='engine' is "
                         "slimrl's fast path, 'transformers' TRL's generate).")  # fmt: skip
    if args.loss_type not in PAIR_LOSSES:
        raise ValueError(f"XPO's loss_type is one of {PAIR_LOSSES}, got {args.loss_type!r}.")
    if args.optim in (OptimizerNames.LOMO, OptimizerNames.ADALOMO):
        raise ValueError(f"optim={args.optim!r}: LOMO optimizers update the weights inside backward, which slimrl's "
                         "chunked step calls once per chunk; choose another optimizer (e.g. adamw_torch).")  # fmt: skip
    return args
