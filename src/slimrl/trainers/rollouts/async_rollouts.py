"""`async_generation`: the next optimizer step's rollout is generated on the rollout device while this step trains.

`AsyncRolloutMixin` goes before `EngineRolloutMixin` in GRPO's bases; `_check_async_generation()` runs at the end of
`__init__`. Its overrides, each for one reason:
- `get_batch_samples`: HF Trainer pulls each optimizer step's micro-batches here. With async_generation on, the
  next step's are pulled one step early, their prompts tokenised as TRL tokenises them, and their rollout submitted
  to the engine process (after the adapter of the latest optimizer step), so it runs while this step trains. This
  step's rollout, submitted a step ago, is collected first. `_remote_rollout` then hands it to TRL's
  `_generate_single_turn` when the prompts match. The rollout a step trains on was so sampled from the policy one
  optimizer step behind the one it trains.
- `use_vllm`: TRL's flag, also true while rollouts are stale, so that TRL's importance-sampling correction of the
  sampling log-probs (`vllm_importance_sampling_correction`, `_mode`, `_clip_min`, `_clip_max`; TRL's defaults)
  applies to them exactly as it does to vLLM's. Nothing else behind the flag runs: generation never reaches TRL's
  vLLM path (the engine backend serves it), and tools, environments and rollout_func are refused with async.
"""

from __future__ import annotations


class AsyncRolloutMixin:
    """One step of lookahead over the training batches, for a GRPO trainer whose args carry RolloutFields."""

    supports_async_generation = True  # read by EngineRolloutMixin, after this mixin in the bases
    _stale_rollouts = False  # True once async_generation is checked and on

    @property
    def use_vllm(self) -> bool:
        # contract: TRL's `use_vllm` (what TRL's __init__ set), or True while rollouts come from a stale policy
        return self.__dict__.get("_trl_use_vllm", False) or self._stale_rollouts

    @use_vllm.setter
    def use_vllm(self, value: bool) -> None:
        self.__dict__["_trl_use_vllm"] = bool(value)

    def _check_async_generation(self) -> None:
        if not getattr(self.args, "async_generation", False):
            return
        refused = [name for name, used in (("tools", bool(self.tools)),
                                           ("environment_factories", self.environment_factories is not None),
                                           ("rollout_func", self.rollout_func is not None)) if used]  # fmt: skip
        if refused:
            raise ValueError(f"async_generation=True cannot be combined with {', '.join(refused)}: their rollouts "
                             "depend on more than the prompt. Turn async_generation off.")  # fmt: skip
        if self.args.steps_per_generation != self.args.gradient_accumulation_steps or self.num_iterations != 1:
            raise ValueError(
                "async_generation=True generates one rollout per optimizer step, so it needs steps_per_generation "
                f"equal to gradient_accumulation_steps (got {self.args.steps_per_generation} and "
                f"{self.args.gradient_accumulation_steps}) and num_iterations=1 (got {self.num_iterations})."
            )
        self._stale_rollouts = True

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        # contract: HF Trainer's: this optimizer step's micro-batches from epoch_iterator, and their item count
        if not self._stale_rollouts:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        ahead, self._batches_ahead = getattr(self, "_batches_ahead", None), None
        if ahead is not None and ahead[0] is epoch_iterator:
            current = ahead[1]
        else:
            current = super().get_batch_samples(epoch_iterator, num_batches, device)
        engine = self._engine()
        if current[0] and engine.pending is None and getattr(self, "_rollout_ahead", None) is None:
            self._submit_rollout(current[0][0])  # the first step: nothing was generated ahead of it
        if engine.pending is not None:  # collected before anything else is sent (transport.py's rule)
            self._rollout_ahead = (engine.pending, engine.collect())
        if self.state.global_step + 1 >= self.state.max_steps:  # the last step: nothing to generate ahead for
            return current
        upcoming = super().get_batch_samples(epoch_iterator, num_batches, device)
        if upcoming[0]:
            self._batches_ahead = (epoch_iterator, upcoming)
            self._submit_rollout(upcoming[0][0])
        return current

    def _submit_rollout(self, batch: list[dict]) -> None:
        """The engine process starts on this generation batch's prompts, after the latest optimizer step's adapter."""
        self._sync_rollout_adapter()
        prompt_ids = self._tokenize_prompts([row["prompt"] for row in batch])[0]
        self._engine().submit(prompt_ids, self._engine_params(), self.max_completion_length)
