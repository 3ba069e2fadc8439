"""Rollouts from slimrl's engine for TRL's generating trainers (GRPO, RLOO): one mixin, the same in both.

`EngineRolloutMixin` goes before TRL's class in a trainer's bases; the trainer calls `_choose_generation_backend()`
at the end of `__init__` (after TRL has set `use_vllm`, `eos_token_ids` and the generation settings). It overrides
one TRL method, keeping each trainer's contract:
- `_generate_single_turn`: with the "engine" backend, slimrl's rollout engine decodes the (already repeated) prompts
  with the training weights and the live LoRA adapter; other backends and multimodal prompts go to TRL's path.

TRL's `_generate_single_turn` differs between the trainers: GRPO's is (prompt_ids, images, multimodal_fields,
num_generations, has_tool_images) -> (completion ids, log-probs), RLOO's is (prompt_ids, images, multimodal_fields)
-> completion ids. The override passes every argument past the first three through untouched, and the trainer says
which return it has with `single_turn_returns_logprobs`.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

logger = logging.getLogger(__name__)


class EngineRolloutMixin:
    """The backend choice and the engine's rollouts, for a TRL trainer whose args carry RolloutFields."""

    # True where TRL's `_generate_single_turn` returns (ids, log-probs) (GRPO); False where it returns ids (RLOO).
    single_turn_returns_logprobs: bool = True

    def _choose_generation_backend(self) -> None:
        from slimrl.trainers.generation import choose_backend

        self._rollout_engine = None
        self._generation_backend, reason = choose_backend(
            self.args.generation_backend,
            self.accelerator.unwrap_model(self.model),
            use_vllm=self.use_vllm,
            # TRL's online DPO has no continuous-batching switch: there it is off
            use_continuous_batching=getattr(self.args, "use_transformers_continuous_batching", False),
            generation_kwargs=self.args.generation_kwargs,
        )
        if self.args.generation_backend == "auto" and self._generation_backend != "engine":
            # on CUDA the engine was expected, so the fallback is worth a warning; on CPU it is the plan
            log = logger.warning if torch.cuda.is_available() else logger.info
            log("slimrl: rollouts use TRL's %s path, not slimrl's engine: %s.", self._generation_backend, reason)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, *trl_args, **trl_kwargs):
        # contract: TRL's return for this trainer (completion ids per prompt, EOS included and nothing after it; GRPO
        # adds per-token log-probs or None), prompts in order, no grad, the model left in the mode it had
        # slimrl's engine decodes with the training weights and the live adapter; TRL's paths serve the rest
        if self._generation_backend != "engine" or images is not None or multimodal_fields:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, *trl_args, **trl_kwargs)
        completion_ids, logprobs = self._engine_rollout(prompt_ids)
        return (completion_ids, logprobs) if self.single_turn_returns_logprobs else completion_ids

    def _engine_rollout(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list | None]:
        """One completion per token-id prompt from slimrl's engine, and its log-probs when the trainer uses them."""
        from slimrl.trainers.generation import engine_sampling_params, inference_mode

        model = self.accelerator.unwrap_model(self.model)
        if self._rollout_engine is None:
            from slimrl.rollout.engine import RolloutEngine

            options = getattr(model, "slimrl_options", None)
            self._rollout_engine = RolloutEngine(
                model,
                max_seq_len=getattr(options, "max_seq_length", None),
                gpu_memory_utilization=getattr(options, "gpu_memory_utilization", None)
                if getattr(options, "fast_inference", False)
                else None,
                tokenizer=self._tokenizer,
                deterministic=self.args.deterministic_rollouts,
            )
        params = engine_sampling_params(self, self._rollout_engine.device)
        if not self.single_turn_returns_logprobs:  # nothing reads them: the engine need not compute them
            params = dataclasses.replace(params, logprobs=False)
        with inference_mode(model):
            output = self._rollout_engine.generate(prompt_ids, params, max_new_tokens=self.max_completion_length)
        self._rollout_engine.release()  # the KV cache goes back to training
        return output.completion_ids, output.logprobs

    @property
    def generation_backend(self) -> str:
        """Who generates this trainer's rollouts: "engine", "transformers" or "vllm" (see RolloutFields)."""
        return self._generation_backend

    @property
    def rollout_engine(self):
        """slimrl's RolloutEngine once it has generated (None before, or with another backend)."""
        return self._rollout_engine

    def generate_completion_ids(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list | None]:
        """One completion per token-id prompt from the policy as it is now, by this trainer's backend (slimrl's
        engine, or TRL's path): for a `rollout_func` that runs its own loop. Returns (completion ids, their
        log-probs, or None where the backend gives none)."""
        if self.single_turn_returns_logprobs:
            return self._generate_single_turn(prompt_ids, None, {}, num_generations=1)
        if self._generation_backend == "vllm":
            # TRL's vLLM path here generates num_generations completions per distinct prompt, not one per prompt
            raise NotImplementedError(
                f"{type(self).__name__}.generate_completion_ids does not support the vLLM backend; use 'engine' or "
                "'transformers'."
            )
        return self._generate_single_turn(prompt_ids, None, {}), None
