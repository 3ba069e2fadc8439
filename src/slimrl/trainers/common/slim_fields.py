"""The settings every slimrl trainer adds to its TRL config, and how a config that lacks them gets them.

Each slimrl config is `class XConfig(SlimFields, trl.XConfig)`: the dataclass fields of TRL's config come first
(positions unchanged), slimrl's after them. `SlimFields.__post_init__` checks slimrl's fields and then runs TRL's own
checks, so TRL's errors keep their text. A trainer given `args=None` or a plain TRL config calls `with_slim_fields`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from slimrl.ops.finite import check_on_nonfinite


def setting(default, help_text: str):
    """A config field with its help text (shown by HfArgumentParser's --help)."""
    return field(default=default, metadata={"help": help_text})


@dataclass
class SlimFields:
    """slimrl's settings shared by every trainer (mixed in before TRL's config class)."""

    num_chunks: int | str = field(
        default="auto",
        metadata={
            "help": "Number of chunks each micro-batch's sequences are split into for the forward/backward pass "
            "(trainers whose loss pairs sequences, such as DPO, never split a pair). Only one chunk's activations "
            "live at once; the gradient is the same for every value. 'auto' picks it from the free device memory, "
            "the model's shape and the batch's token count (1 on CPU)."
        },
    )
    offload_checkpoints: bool | None = field(
        default=None,
        metadata={
            "help": "Park each decoder layer's gradient checkpoint in pinned CPU memory between forward and backward, "
            "so GPU memory does not grow with the number of layers. None: on when CUDA and gradient_checkpointing; "
            "True: on any device (a CPU runs the same path with plain copies)."
        },
    )
    mlp_tile_tokens: int = field(
        default=8192,
        metadata={
            "help": "With offloaded checkpoints, recompute each Llama-family decoder MLP over tiles of at most this "
            "many tokens (as few as cover the chunk, of equal size), forward and backward per tile, so a long "
            "sequence's MLP activations never exist at once (no extra compute). 0 disables tiling."
        },
    )
    keep_attention_tokens: int = field(
        default=4096,
        metadata={
            "help": "With offloaded checkpoints and fast LoRA, Llama-family layers over sequences of at least this "
            "many tokens keep their attention from the forward instead of recomputing it in the backward: its output "
            "and log-sum-exp are parked in host memory like the checkpoints (q, k and v are recomputed anyway), for "
            "the same gradients bit for bit without the recompute's attention kernel, whose cost grows with the "
            "square of the length (W1 on an H100: 5% shorter steps at 4k and 16k tokens, 10% at 32k; 25% longer at "
            "1k, hence the default). Adds host memory and copies of about the checkpoints' own. 0 disables."
        },
    )
    layer_cuda_graphs: bool = field(
        default=True,
        metadata={
            "help": "With offloaded checkpoints on CUDA (one process or DDP), replay each Llama-family decoder layer's "
            "gradient-free forward and its recompute-and-backward as CUDA graphs once the same shapes come back "
            "(captured the second time a shape is seen; at most 2 shapes kept): a short sequence's step is bound by "
            "the host's launches, which a replay removes (W1 at 1,024 tokens: 0.22 s against 0.32 s on an H200). The "
            "same kernels, bit for bit the same gradients; layers that keep their attention (keep_attention_tokens) "
            "replay too, the kept attention's output going through static buffers (W1 at 4,096 tokens on an H100: "
            "0.86 s against 0.98 s). False: every pass eager."
        },
    )
    fast_lora: bool | None = field(
        default=None,
        metadata={
            "help": "Run the LoRA projections, gated MLPs and RMSNorms of Llama-family decoder layers through slimrl's "
            "fused functions (the LoRA add and scale inside the base GEMM, gate and up shrunk in one GEMM, the gated "
            "product, RMSNorm and the attention's rotary embedding in Triton kernels with hand-derived backward "
            "passes). Same math as peft's forward, "
            "rounded in fewer places. None: on for one process or DDP on CUDA (off under FSDP and DeepSpeed, whose "
            "hooks gather weights per module call); True: on wherever it can run; False: peft's forward."
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

    def __post_init__(self):
        if getattr(self, "bf16", None) is None and not self.fp16 and not bf16_supported(self.use_cpu):
            self.bf16 = False  # TRL defaults to bf16, which transformers refuses where there is no bf16 GPU
        check_slim_fields(self)
        super().__post_init__()


SLIM_FIELD_NAMES = tuple(f.name for f in fields(SlimFields))


def check_slim_fields(args) -> None:
    """Normalise and check the shared fields of `args` (any object carrying them)."""
    if isinstance(args.num_chunks, str):
        if args.num_chunks.isdigit():
            args.num_chunks = int(args.num_chunks)
        elif args.num_chunks != "auto":
            raise ValueError(f"num_chunks must be a positive integer or 'auto', got {args.num_chunks!r}.")
    if isinstance(args.num_chunks, bool) or (isinstance(args.num_chunks, int) and args.num_chunks < 1):
        raise ValueError(
            f"num_chunks must be a positive integer or 'auto', got {args.num_chunks!r}. Use 1 to run each "
            "micro-batch in one piece, or 'auto' to size chunks from free memory."
        )
    if args.mlp_tile_tokens < 0:
        raise ValueError(f"mlp_tile_tokens must be >= 0 (0 disables MLP tiling), got {args.mlp_tile_tokens}.")
    if args.keep_attention_tokens < 0:
        raise ValueError(f"keep_attention_tokens must be >= 0 (0: always recompute attention), got "
                         f"{args.keep_attention_tokens}.")  # fmt: skip
    check_on_nonfinite(args.on_nonfinite)
    if args.offload_checkpoints and not args.gradient_checkpointing:
        raise ValueError(
            "offload_checkpoints=True offloads gradient checkpoints, but gradient_checkpointing is False. "
            "Set gradient_checkpointing=True, or leave offload_checkpoints unset."
        )
    if getattr(args, "ddp_static_graph", None):
        raise ValueError(
            "ddp_static_graph=True cannot be honoured by slimrl's chunked step: it backpropagates every chunk of a "
            "micro-batch but the last under no_sync, and DDP's static graph, which records each weight's gradient "
            "hooks once in its first iteration, fails on such a pass (torch 2.13's reducer: 'expect_autograd_hooks_ "
            "INTERNAL ASSERT FAILED'). slimrl does not need it: its offloaded checkpoints hand autograd one gradient "
            "per weight per backward pass. Set ddp_static_graph=False or leave it unset."
        )


def bf16_supported(use_cpu: bool) -> bool:
    return not use_cpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def with_slim_fields(args, model, config_class, suffix: str):
    """The config a slimrl trainer runs with. None becomes `config_class` named as TRL names its default
    (`<model name>-<suffix>`); a config without slimrl's fields (a plain TRL one) keeps its values and gains every
    field `config_class` adds to TRL's, at its default, checked."""
    if args is None:
        from trl.trainer.utils import get_config_model_id

        name = model if isinstance(model, str) else get_config_model_id(model.config)
        return config_class(f"{name.split('/')[-1]}-{suffix}")
    if not isinstance(args, config_class):
        trl_fields = {f.name for cls in config_class.__mro__[1:] if cls is not SlimFields
                      for f in getattr(cls, "__dataclass_fields__", {}).values()}  # fmt: skip
        for name, spec in config_class.__dataclass_fields__.items():
            if name not in trl_fields and not hasattr(args, name):
                setattr(args, name, spec.default)
        check_slim_fields(args)
    return args
