"""slimrl's GRPOConfig: TRL's, plus the settings of slimrl's step and engine, with errors for settings TRL accepts but
that cannot work. A plain `trl.GRPOConfig` (or none) given to slimrl's trainer gets these fields' defaults
(`with_slimrl_fields`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import trl

from slimrl.trainers.finite import check_on_nonfinite
from slimrl.trainers.grpo_loss import LOSS_TYPES


@dataclass
class GRPOConfig(trl.GRPOConfig):
    """TRL's GRPOConfig plus slimrl's settings, with errors for settings TRL accepts but that cannot work."""

    num_chunks: int | str = field(
        default="auto",
        metadata={
            "help": "Number of chunks each micro-batch's sequences are split into for the forward/backward pass. "
            "Only one chunk's activations live at once; the gradient is the same for every value. 'auto' picks it "
            "from the free device memory, the model's shape and the batch's token count (1 on CPU)."
        },
    )

    generation_backend: str = field(
        default="auto",
        metadata={
            "help": "Who generates the rollouts: 'engine' (slimrl's rollout engine, decoding with the training "
            "weights and the live LoRA adapter in place), 'transformers' (TRL's generate path), 'vllm' (TRL's vLLM "
            "integration, same as use_vllm=True), or 'auto': the engine on CUDA for the Llama family, else TRL's."
        },
    )
    offload_checkpoints: bool | None = field(
        default=None,
        metadata={
            "help": "Park each decoder layer's gradient checkpoint in pinned CPU memory between forward and backward, "
            "so GPU memory does not grow with the number of layers. None: on when CUDA and gradient_checkpointing."
        },
    )
    mlp_tile_tokens: int = field(
        default=8192,
        metadata={
            "help": "With offloaded checkpoints, recompute each Llama-family decoder MLP over tiles of this many "
            "tokens, forward and backward per tile, so a long sequence's MLP activations never exist at once (no "
            "extra compute). 0 disables tiling."
        },
    )

    on_nonfinite: str = field(
        default="raise",
        metadata={
            "help": "What an optimizer step whose loss or gradient is NaN or infinite does: 'raise' stops training "
            "with slimrl.NonFiniteError before the optimizer writes the weights (so they, the optimizer state and the "
            "last checkpoint stay as they were); 'skip' drops that step's update, logs `nonfinite_skipped` and goes "
            "on."
        },
    )
    deterministic_rollouts: bool = field(
        default=True,
        metadata={
            "help": "Make the rollout engine's output depend only on the seed: the partial sums its kernels split "
            "over several GPU programs are added in a fixed order instead of by atomics (whose order, and so the last "
            "bits of the logits, vary from run to run). False is slightly faster (docs/benchmarks.md)."
        },
    )

    def __post_init__(self):
        if self.bf16 is None and not self.fp16 and not _bf16_supported(self.use_cpu):
            self.bf16 = False  # TRL defaults to bf16, which transformers refuses where there is no bf16 GPU
        self._check_slimrl_fields()
        self._check_generation_settings()
        try:
            super().__post_init__()
        except ValueError as error:
            if "must be divisible by num_generations" in str(error):
                raise ValueError(self._divisibility_message()) from error
            raise

    def _check_slimrl_fields(self) -> None:
        if isinstance(self.num_chunks, str):
            if self.num_chunks.isdigit():
                self.num_chunks = int(self.num_chunks)
            elif self.num_chunks != "auto":
                raise ValueError(f"num_chunks must be a positive integer or 'auto', got {self.num_chunks!r}.")
        if isinstance(self.num_chunks, bool) or (isinstance(self.num_chunks, int) and self.num_chunks < 1):
            raise ValueError(
                f"num_chunks must be a positive integer or 'auto', got {self.num_chunks!r}. Use 1 to run each "
                "micro-batch in one piece, or 'auto' to size chunks from free memory."
            )
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"Unknown loss_type {self.loss_type!r}; choose one of {', '.join(LOSS_TYPES)}.")
        from slimrl.trainers.generation import BACKENDS

        if self.generation_backend not in BACKENDS:
            raise ValueError(
                f"generation_backend must be one of {', '.join(BACKENDS)}, got {self.generation_backend!r}."
            )
        if self.generation_backend == "vllm":
            self.use_vllm = True  # TRL's own vLLM integration
        if self.mlp_tile_tokens < 0:
            raise ValueError(f"mlp_tile_tokens must be >= 0 (0 disables MLP tiling), got {self.mlp_tile_tokens}.")
        check_on_nonfinite(self.on_nonfinite)
        if self.offload_checkpoints and not self.gradient_checkpointing:
            raise ValueError(
                "offload_checkpoints=True offloads gradient checkpoints, but gradient_checkpointing is False. "
                "Set gradient_checkpointing=True, or leave offload_checkpoints unset."
            )

    def _check_generation_settings(self) -> None:
        if self.num_generations is not None and self.num_generations < 2:
            raise ValueError(
                f"num_generations={self.num_generations}: GRPO compares each completion with the others of its prompt, "
                "so it needs at least 2 generations per prompt. Set num_generations to 2 or more (8 is common)."
            )
        if self.temperature <= 0:
            raise ValueError(
                f"temperature={self.temperature}: GRPO samples completions and scores them at this temperature, so "
                "it must be > 0 (greedy decoding would make every completion of a prompt identical). Use e.g. 1.0."
            )
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate={self.learning_rate} must be positive; LoRA usually uses 5e-6 to 5e-4.")
        if self.learning_rate >= 1e-2:
            warnings.warn(
                f"learning_rate={self.learning_rate} is far above what LoRA fine-tuning tolerates (typically 5e-6 to "
                "5e-4) and will likely diverge; lower it unless you know why you need it.",
                UserWarning,
                stacklevel=3,
            )

    def _divisibility_message(self) -> str:
        groups = self.num_generations
        per_step = self.generation_batch_size
        return (
            f"The generation batch holds {per_step} completions (per_device_train_batch_size="
            f"{self.per_device_train_batch_size} x processes x steps_per_generation={self.steps_per_generation}), "
            f"which is not a multiple of num_generations={groups}, so some prompt would get a partial group. "
            f"Make per_device_train_batch_size x steps_per_generation a multiple of {groups} (e.g. "
            f"per_device_train_batch_size={groups}), or set generation_batch_size to a multiple of {groups}."
        )


def _bf16_supported(use_cpu: bool) -> bool:
    return not use_cpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported()


SLIMRL_FIELDS = ("num_chunks", "generation_backend", "offload_checkpoints", "mlp_tile_tokens", "on_nonfinite",
                 "deterministic_rollouts")  # fmt: skip


def with_slimrl_fields(args, model) -> GRPOConfig:
    """The config slimrl's trainer runs with: None becomes slimrl's GRPOConfig named as TRL names its default
    (`<model name>-GRPO`); a plain trl.GRPOConfig keeps its values and gains slimrl's fields at their defaults."""
    if args is None:
        from trl.trainer.utils import get_config_model_id

        name = model if isinstance(model, str) else get_config_model_id(model.config)
        return GRPOConfig(f"{name.split('/')[-1]}-GRPO")
    if not isinstance(args, GRPOConfig):
        for name in SLIMRL_FIELDS:
            if not hasattr(args, name):
                setattr(args, name, GRPOConfig.__dataclass_fields__[name].default)
        check_on_nonfinite(args.on_nonfinite)
    return args
