"""The config fields of slimrl's rollouts, shared by the trainers that generate (GRPO, RLOO).

`RolloutFields` is a dataclass mixin placed before `SlimFields` in a config's bases
(`class RLOOConfig(RolloutFields, SlimFields, trl.RLOOConfig)`), so the fields come after TRL's and SlimFields' ones
and its `__post_init__` checks them before SlimFields and TRL check theirs. `with_rollout_fields` is
`with_slim_fields` that also gives a config lacking these fields (a plain TRL one) their defaults.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields

from slimrl.trainers.common.slim_fields import with_slim_fields

logger = logging.getLogger(__name__)


@dataclass
class RolloutFields:
    """Who generates the rollouts, and how reproducibly (mixed in before SlimFields)."""

    generation_backend: str = field(
        default="auto",
        metadata={
            "help": "Who generates the rollouts: 'engine' (slimrl's rollout engine, decoding with the training "
            "weights and the live LoRA adapter in place), 'transformers' (TRL's generate path), 'vllm' (TRL's vLLM "
            "integration, same as use_vllm=True), or 'auto': the engine on CUDA for the Llama family, else TRL's; "
            "with a model loaded by FastLanguageModel.from_pretrained(fast_inference=True), 'auto' means the engine "
            "(an error when it cannot serve the run), and use_vllm=True means it too, as in Unsloth."
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

    generation_device: str | None = field(
        default=None,
        metadata={
            "help": "Run slimrl's rollout engine in a process of its own on this device ('cuda:1', or 'cpu'), with "
            "its own copy of the model; after each optimizer step only the trainable tensors (the LoRA adapter) are "
            "sent to it. None: the engine runs in the training process, on the training weights."
        },
    )
    async_generation: bool = field(
        default=False,
        metadata={
            "help": "With generation_device: generate the next step's rollouts while this step trains, from the "
            "policy one optimizer step behind; TRL's importance-sampling correction (vllm_importance_sampling_*) is "
            "applied to those log-probs. GRPO only."
        },
    )

    @property
    def n_gpu(self) -> int:
        """GPUs this process trains on. With generation_device, one: the other visible GPU is the engine's, and HF's
        Trainer, counting every visible GPU in a single process, would wrap the model in nn.DataParallel (which TRL's
        trainers refuse; hiding the second GPU with CUDA_VISIBLE_DEVICES would hide the engine's device too)."""
        count = super().n_gpu
        return min(count, 1) if self.generation_device is not None else count

    def __post_init__(self):
        check_rollout_fields(self)
        try:
            super().__post_init__()
        except ValueError as error:
            if "must be divisible by the global batch size" in str(error):  # TRL's GRPO and RLOO configs
                raise ValueError(world_size_message(self)) from error
            raise


def world_size_message(args) -> str:
    """What to change when `generation_batch_size` does not split into passes over all processes."""
    per_pass = args.per_device_train_batch_size * args.world_size
    return (
        f"generation_batch_size={args.generation_batch_size} cannot be split over {args.world_size} processes: each "
        f"micro-step trains per_device_train_batch_size={args.per_device_train_batch_size} completions on each "
        f"process ({per_pass} in all), and {args.generation_batch_size} is not a multiple of {per_pass}. Set "
        f"generation_batch_size to a multiple of {per_pass}, or set steps_per_generation instead of it (the "
        f"generation batch is then {per_pass} x steps_per_generation), or launch a number of processes that divides "
        f"{args.generation_batch_size // args.per_device_train_batch_size}."
    )


def check_rollout_fields(args) -> None:
    """Check the rollout fields of `args` (any object carrying them); 'vllm' turns on TRL's own vLLM integration."""
    from slimrl.trainers.rollouts.generation import BACKENDS

    if args.generation_backend not in BACKENDS:
        raise ValueError(f"generation_backend must be one of {', '.join(BACKENDS)}, got {args.generation_backend!r}.")
    if args.generation_backend == "vllm":
        args.use_vllm = True
    device = getattr(args, "generation_device", None)
    if device is not None and (args.generation_backend not in ("auto", "engine") or getattr(args, "use_vllm", False)):
        raise ValueError(f"generation_device={device!r} runs slimrl's engine in its own process; it cannot be combined "
                         f"with generation_backend={args.generation_backend!r}. Use generation_backend='engine' "
                         "(or 'auto'), or leave generation_device unset.")  # fmt: skip
    if getattr(args, "async_generation", False) and device is None:
        raise ValueError("async_generation=True overlaps generation with training on a separate rollout device; set "
                         "generation_device (e.g. 'cuda:1'), or leave async_generation off.")  # fmt: skip


def with_rollout_fields(args, model, config_class, suffix: str):
    """`with_slim_fields` for a config class with RolloutFields: a config that lacks them (a plain TRL one) also
    gains the rollout fields at their defaults. (with_slim_fields counts every base but SlimFields as TRL's, so it
    would leave these out.) It runs before TRL's __init__, so use_vllm is settled here
    (`fast_inference_takes_use_vllm`)."""
    args = with_slim_fields(args, model, config_class, suffix)
    if not isinstance(args, config_class):
        for spec in fields(RolloutFields):
            if not hasattr(args, spec.name):
                setattr(args, spec.name, spec.default)
        check_rollout_fields(args)
    fast_inference_takes_use_vllm(args, model)
    return args


def fast_inference_takes_use_vllm(args, model) -> None:
    """Unsloth's scripts set use_vllm=True beside from_pretrained(fast_inference=True), meaning "generate with the
    model's own fast engine" (Unsloth hands TRL the vLLM engine the model carries). Here slimrl's in-process engine
    is that engine: with such a model and generation_backend left at 'auto', use_vllm is turned off before TRL's
    __init__ reads it (TRL would start its own vLLM integration) and the engine is chosen. TRL's vLLM stays one
    setting away: generation_backend='vllm'. Without fast_inference, use_vllm=True is TRL's vLLM, as in TRL."""
    from slimrl.trainers.rollouts.generation import fast_inference_of

    if getattr(args, "use_vllm", False) and args.generation_backend == "auto" and fast_inference_of(model):
        logger.warning("slimrl: use_vllm=True with a model loaded with fast_inference=True: rollouts come from "
                       "slimrl's engine (Unsloth's fast_inference); generation_backend='vllm' selects TRL's vLLM "
                       "integration instead.")  # fmt: skip
        args.use_vllm = False
