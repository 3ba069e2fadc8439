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

from slimrl.distributed.sharded import sharded_training, sharding, whole_weights

logger = logging.getLogger(__name__)


class EngineRolloutMixin:
    """The backend choice and the engine's rollouts, for a TRL trainer whose args carry RolloutFields."""

    # True where TRL's `_generate_single_turn` returns (ids, log-probs) (GRPO); False where it returns ids (RLOO).
    single_turn_returns_logprobs: bool = True
    # True where the trainer trains on one-step-stale rollouts with TRL's importance-sampling correction
    # (AsyncRolloutMixin, GRPO only: TRL's RLOO and online DPO have no such correction)
    supports_async_generation: bool = False

    def _choose_generation_backend(self) -> None:
        """Who generates (`generation_backend`): the config's generation_backend, the model's fast_inference and what
        the engine can serve decide it (trainers/rollouts/generation.py choose_backend); an impossible demand fails
        here."""
        from slimrl.trainers.rollouts.generation import choose_backend, engine_refusal, fast_inference_of

        self._rollout_engine = None
        device = getattr(self.args, "generation_device", None)
        if getattr(self.args, "async_generation", False) and not self.supports_async_generation:
            raise ValueError(f"async_generation=True trains on rollouts one step stale, corrected by TRL's "
                             f"importance sampling, which TRL's GRPO has and {type(self).__name__} does not; turn it "
                             "off (generation_device alone works here).")  # fmt: skip
        if device is not None:  # the engine in its own process: checked now, started at the first rollout
            from slimrl.distributed.remote_engine import check_generation_device

            check_generation_device(device, self.accelerator.unwrap_model(self.model), self.accelerator.num_processes,
                                    sharded_training(self.accelerator))  # fmt: skip
        requested = "engine" if device is not None else self.args.generation_backend
        model = self.accelerator.unwrap_model(self.model)
        fast_inference = fast_inference_of(model)  # FastLanguageModel.from_pretrained(fast_inference=True)
        self._generation_backend, reason = choose_backend(
            requested,
            model,
            use_vllm=self.use_vllm,
            # TRL's online DPO has no continuous-batching switch: there it is off
            use_continuous_batching=getattr(self.args, "use_transformers_continuous_batching", False),
            generation_kwargs=self.args.generation_kwargs,
            fast_inference=fast_inference,
            # what the engine will be asked, checked now: TRL 1.16's GRPO, RLOO and online DPO bound no prompt length
            max_prompt_length=getattr(self.args, "max_prompt_length", None),
            max_completion_length=getattr(self, "max_completion_length", None),
        )
        if self._generation_backend == "engine" and device is None and sharded_training(self.accelerator):
            problem = self._sharded_engine_problem()
            if problem is not None and (requested == "engine" or fast_inference):
                raise engine_refusal("generation_backend" if requested == "engine" else "fast_inference", problem)
            if problem is not None:
                self._generation_backend, reason = "transformers", problem
        if self._generation_backend == "engine":
            logger.info("slimrl: rollouts from slimrl's engine (%s).", reason)
        elif self.args.generation_backend == "auto" and not fast_inference:  # (choose_backend warned about that)
            # on CUDA the engine was expected, so the fallback is worth a warning; on CPU it is the plan
            log = logger.warning if torch.cuda.is_available() else logger.info
            log("slimrl: rollouts use TRL's %s path, not slimrl's engine: %s.", self._generation_backend, reason)

    def _sharded_engine_problem(self) -> str | None:
        """Why the in-process engine cannot run over this trainer's sharded weights (FSDP2, ZeRO-3), or None: FSDP1's
        flat parameters are not gathered, and the whole weights must fit beside this rank's training state."""
        from slimrl.distributed.sharded import engine_fit_problem

        if sharding(self.accelerator) == "fsdp1":
            return ("slimrl's engine gathers FSDP2's and ZeRO-3's sharded weights, not FSDP1's flat parameters: set "
                    "fsdp_version: 2 in the accelerate config")  # fmt: skip
        model = self.accelerator.unwrap_model(self.model)
        # a row as long as the engine's cache (FastLanguageModel's max_seq_length), else the completion and 1024
        # prompt tokens
        options = getattr(model, "slimrl_options", None)
        seq_len = getattr(options, "max_seq_length", None) or self.max_completion_length + 1024
        half = self.args.bf16 or self.args.fp16
        return engine_fit_problem(model, world_size=self.accelerator.num_processes, device=self.accelerator.device,
                                  compute_bytes=2 if half else None, seq_len=seq_len)  # fmt: skip

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
        from slimrl.trainers.rollouts.generation import inference_mode

        model = self.accelerator.unwrap_model(self.model)
        if getattr(self.args, "generation_device", None) is not None:
            output = self._remote_rollout(prompt_ids)
        else:
            # sharded weights (FSDP2, ZeRO-3) are gathered for the rollout and given back after it
            with whole_weights(self.accelerator, self.model_wrapped), inference_mode(model):
                engine = self._engine()
                output = engine.generate(prompt_ids, self._engine_params(), max_new_tokens=self.max_completion_length)
            engine.release()  # the KV cache goes back to training
        return output.completion_ids, output.logprobs

    def _engine(self):
        """The rollout engine, built at the first rollout: in this process over the training weights, or in its own
        process on `generation_device`."""
        if self._rollout_engine is not None:
            return self._rollout_engine
        model = self.accelerator.unwrap_model(self.model)
        options = getattr(model, "slimrl_options", None)
        max_seq_len = getattr(options, "max_seq_length", None)
        if getattr(self.args, "generation_device", None) is not None:
            from slimrl.distributed.remote_engine import RemoteRolloutEngine

            # cap_completions=False as in the in-process engine: a prompt too long for its completion is an error
            self._rollout_engine = RemoteRolloutEngine(model, self.args.generation_device, max_seq_len,
                                                       deterministic=self.args.deterministic_rollouts,
                                                       cap_completions=False)  # fmt: skip
            return self._rollout_engine
        from slimrl.trainers.rollouts.generation import local_engine

        self._rollout_engine = local_engine(model, self._tokenizer, self.args.deterministic_rollouts)
        return self._rollout_engine

    def _engine_params(self):
        from slimrl.trainers.rollouts.generation import engine_sampling_params

        params = engine_sampling_params(self, self._engine().device)
        if not self.single_turn_returns_logprobs:  # nothing reads them: the engine need not compute them
            params = dataclasses.replace(params, logprobs=False)
        return params

    def _remote_rollout(self, prompt_ids: list[list[int]]):
        """The rollout device's completions of these prompts: the one generated ahead (async_generation) when it is
        for these prompts, else generated now with the adapter of the latest optimizer step."""
        engine = self._engine()
        ahead = getattr(self, "_rollout_ahead", None)
        if ahead is not None and ahead[0] == [list(map(int, p)) for p in prompt_ids]:
            self._rollout_ahead = None
            output = ahead[1]
        else:
            if engine.pending is not None:  # generated ahead for other prompts (an evaluation came between)
                self._rollout_ahead = (engine.pending, engine.collect())
            self._sync_rollout_adapter()
            output = engine.generate(prompt_ids, self._engine_params(), max_new_tokens=self.max_completion_length)
        # optimizer steps between the adapter that sampled this rollout and the one that trains on it
        self._log_rollout_metric("rollout/staleness", self.state.global_step - output.stats["adapter_version"])
        return output

    def _sync_rollout_adapter(self) -> None:
        """The rollout device gets the adapter of the latest optimizer step (unless it has it); the bytes are logged."""
        sent = self._engine().sync(self.state.global_step)
        if sent:
            self._log_rollout_metric("rollout/sync_bytes", sent)

    def _log_rollout_metric(self, name: str, value: float) -> None:
        metrics = getattr(self, "_metrics", None)
        if metrics is not None and self.model.training:
            metrics["train"][name].append(float(value))

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
