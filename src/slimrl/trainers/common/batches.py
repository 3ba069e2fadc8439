"""What the chunked trainers read off a collated batch before they plan chunks, shared by every family: whether it is
multimodal, whether it is one padding-free packed row, each row's used length; and the run settings under which no
batch can be chunked exactly."""

from __future__ import annotations

import torch

# Inputs that make a batch multimodal: chunking those needs per-image bookkeeping, so TRL's one-piece loss runs them.
MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def is_multimodal(values) -> bool:
    """Whether a batch (or the kwargs of a forward) carries image inputs."""
    return any(values.get(key) is not None for key in MULTIMODAL_KEYS)


def is_padding_free(inputs: dict) -> bool:
    """Whether the batch is TRL's padding-free layout: one packed row with position ids and no attention mask."""
    return inputs.get("attention_mask") is None and inputs.get("position_ids") is not None


def row_lengths(inputs: dict) -> torch.Tensor:
    """[N] host: each row's last attended column + 1 (every column when there is no attention mask)."""
    input_ids = inputs["input_ids"]  # [N, T]
    mask = inputs.get("attention_mask")
    if mask is None:
        return torch.full((input_ids.size(0),), input_ids.size(1), dtype=torch.long)
    positions = torch.arange(1, mask.size(1) + 1, device=mask.device)
    return (mask.bool() * positions).amax(dim=1).cpu()


def shards_sequences(accelerator) -> bool:
    """Whether context or sequence parallelism splits each sequence across ranks (chunks of whole rows then no longer
    hold whole sequences)."""
    config = accelerator.parallelism_config
    return config is not None and bool(getattr(config, "cp_enabled", False) or getattr(config, "sp_enabled", False))


def run_level_obstacle(args, accelerator) -> str | None:
    """Why no batch of this run can be chunked exactly, whatever it holds (SFT and reward models), or None."""
    if args.activation_offloading:
        return ("activation_offloading is set, and TRL's offloader expects one forward and one backward per step "
                "(slimrl's offload_checkpoints offloads with chunking)")  # fmt: skip
    if shards_sequences(accelerator):
        return "context or sequence parallelism shards each sequence across ranks"
    return None
