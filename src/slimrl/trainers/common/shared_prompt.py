"""GRPO's shared-prompt forward: a chunk of whole prompt groups, each packed as one row, scored in one forward.

The rows of a micro-batch that carry identical prompt ids and mask form a group (GRPO's G completions of a prompt;
found from the ids, not from the row order). A chunk holds whole groups. Each group becomes one packed row: its
prompt's real tokens but the last (left-padded to the chunk's longest), then per completion a segment
`[last prompt token, c_0 .. c_{W-2}]` of the chunk's width W (ops/shared_prompt_attention.py attends each segment to
the shared tokens and to itself only). Position ids are the plain forward's: a prompt token keeps its column in the
left-padded prompt, completion token t is at P + t. Labels sit where the plain forward scores them, pre-shifted
(`shift_labels`), so TRL's fused LM head (add_fused_lm_head: temperature, log-softmax, entropy, in tiles) scores
every completion token of a segment exactly as it does the plain row; the prompt's last token is computed once per
segment (W columns a segment, as many as the plain row has completion columns).

What it saves: the prompt's tokens run through every layer once per group instead of G times (W3: 1,024-token
prompts, G=8, ~1k completions: about half the training step's token-layers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from slimrl.models.unwrap import unwrap_model
from slimrl.ops.shared_prompt_attention import INNER_ATTENTION, LAYOUT_KWARG, PackedLayout, routed_to_shared_prompt
from slimrl.trainers.common.batches import is_multimodal
from slimrl.trainers.common.chunked_step import Chunk, plan_by_length

IGNORE = -100  # TRL's label for an unscored position


@dataclass(frozen=True)
class GroupChunk(Chunk):
    """A chunk of whole prompt groups; `rows` are the groups' rows one group after the other."""

    groups: tuple[torch.Tensor, ...]  # host row indices of each group in the chunk


@dataclass(frozen=True)
class SharedPromptPlan:
    chunks: list[GroupChunk] | None  # None: the plain forward runs, for `reason`
    reason: str | None = None


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[torch.Tensor]:
    """Host row indices of the rows sharing identical prompt ids and mask, groups in the order of their first row."""
    keys = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1).cpu()  # [N, 2P]
    _, inverse = torch.unique(keys, dim=0, return_inverse=True)
    order = {}
    for row, group in enumerate(inverse.tolist()):
        order.setdefault(group, []).append(row)
    return [torch.tensor(rows) for rows in order.values()]


def model_reason(model) -> str | None:
    """Why this model's forward cannot be packed, or None."""
    base = unwrap_model(model)
    config = getattr(base, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation is None or not getattr(type(base), "_supports_attention_backend", False):
        return "the model's attention layers do not go through transformers' attention interface"
    if config.get_text_config() is not config:
        return "the model is multimodal"
    if implementation != INNER_ATTENTION:
        return f"the model runs attn_implementation={implementation!r} (the packed attention replaces 'sdpa')"
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()) or getattr(config, "use_sliding_window",
                                                                                     False):  # fmt: skip
        return "the model has sliding-window attention layers"
    if getattr(config, "attention_dropout", 0.0) and base.training:
        return "attention dropout is on"
    return None


def plan_shared_prompt(model, inputs: dict, num_chunks_for: Callable[[list[int]], int],
                       memory_planned: bool = False) -> SharedPromptPlan:  # fmt: skip
    """Chunks of whole prompt groups for the packed forward, or the reason it cannot run on this batch.
    `num_chunks_for(units)` picks the chunk count for units of these token counts (the packed rows); a count above the
    number of groups is capped, unless `memory_planned` (num_chunks="auto"): then a group's packed row would not fit
    the memory the plan allows, and the plain forward runs."""
    reason = "multimodal inputs" if is_multimodal(inputs) else model_reason(model)
    if reason is not None:
        return SharedPromptPlan(None, reason)
    prompt_mask, completion_mask = inputs["prompt_mask"], inputs["completion_mask"]
    groups = prompt_groups(inputs["prompt_ids"], prompt_mask)
    if max(len(rows) for rows in groups) < 2:
        return SharedPromptPlan(None, "no two rows of the micro-batch share a prompt (a prompt's completions are "
                                      "spread over processes or micro-batches)")  # fmt: skip
    prompt_lengths = prompt_mask.sum(1).cpu()
    if int(prompt_lengths.min()) < 1:
        return SharedPromptPlan(None, "a prompt is empty")
    columns = torch.arange(1, completion_mask.size(1) + 1, device=completion_mask.device)
    ends = (completion_mask.bool() * columns).amax(dim=1).cpu() if completion_mask.numel() else torch.zeros(0)
    widths = torch.stack([ends[rows].max() for rows in groups])  # [groups] longest completion of each
    units = [int(prompt_lengths[rows[0]]) - 1 + len(rows) * int(w) for rows, w in zip(groups, widths, strict=True)]
    num_chunks = num_chunks_for(units)
    if memory_planned and num_chunks > len(groups):
        return SharedPromptPlan(None, "the memory plan (num_chunks='auto') needs more chunks than the micro-batch has "
                                      "prompt groups, and a group's packed row is never split")  # fmt: skip
    planned = plan_by_length(widths, num_chunks, min_width=min(2, completion_mask.size(1)))
    device = completion_mask.device
    chunks = []
    for chunk in planned:
        members = tuple(groups[int(g)] for g in chunk.rows)
        chunks.append(GroupChunk(rows=torch.cat(members).to(device), width=chunk.width, groups=members))
    return SharedPromptPlan(chunks)


@dataclass
class PackedChunk:
    """A chunk's packed forward inputs and where each of its rows' scores come back."""

    input_ids: torch.Tensor  # [n, L] one row per group
    position_ids: torch.Tensor  # [n, L] the plain forward's positions
    shift_labels: torch.Tensor  # [n, L] the token each position predicts, IGNORE where nothing is scored
    layout: PackedLayout
    packed_row: torch.Tensor  # [b] the packed row of each chunk row
    first_column: torch.Tensor  # [b] the column of its segment's first position


def pack_chunk(inputs: dict, chunk: GroupChunk) -> PackedChunk:
    """The packed rows of `chunk` (module docstring), built from TRL's prompt/completion batch."""
    completion_ids = inputs["completion_ids"]
    device, width = completion_ids.device, chunk.width
    firsts = [int(rows[0]) for rows in chunk.groups]
    columns = [row.nonzero().flatten() for row in inputs["prompt_mask"][firsts].bool().cpu()]  # real prompt columns
    shared_end = max(len(c) for c in columns) - 1
    sizes = [len(rows) for rows in chunk.groups]
    shape = (len(sizes), shared_end + max(sizes) * width)
    packed = (torch.zeros(shape, dtype=completion_ids.dtype, device=device),  # input ids
              torch.zeros(shape, dtype=torch.long, device=device),  # position ids
              torch.full(shape, IGNORE, dtype=completion_ids.dtype, device=device))  # shift labels  # fmt: skip
    for j, (rows, cols) in enumerate(zip(chunk.groups, columns, strict=True)):
        start = shared_end - len(cols) + 1
        shared, segments = _group_row(inputs, firsts[j], cols.to(device), rows.to(device), width)
        for target, part, tail in zip(packed, shared, segments, strict=True):
            target[j, start:shared_end] = part
            target[j, shared_end : shared_end + tail.numel()] = tail.flatten()
    layout = PackedLayout([shared_end - len(c) + 1 for c in columns], shared_end, sizes, width)
    packed_row = torch.cat([torch.full((g,), j) for j, g in enumerate(sizes)]).to(device)
    first_column = torch.cat([shared_end + width * torch.arange(g) for g in sizes]).to(device)
    return PackedChunk(*packed, layout, packed_row, first_column)


def _group_row(inputs: dict, first: int, cols: torch.Tensor, rows: torch.Tensor, width: int) -> tuple[tuple, tuple]:
    """(ids, positions, labels) of one group's shared part [P_g - 1] and of its segments [g, W]."""
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    prompt = inputs["prompt_ids"][first, cols]  # [P_g]
    count = rows.numel()
    segment_ids = torch.cat([prompt[-1:].expand(count, 1), completion_ids[rows, : width - 1]], dim=1)  # [g, W]
    completion_positions = inputs["prompt_ids"].size(1) + torch.arange(width - 1, device=cols.device)  # c_0..c_{W-2}
    segment_positions = torch.cat([cols[-1:], completion_positions]).expand(count, width)
    segment_labels = completion_ids[rows, :width].masked_fill(completion_mask[rows, :width] == 0, IGNORE)
    shared_labels = torch.full_like(prompt[:-1], IGNORE)
    return (prompt[:-1], cols[:-1], shared_labels), (segment_ids, segment_positions, segment_labels)


def packed_logps_and_entropies(model, inputs: dict, chunk: GroupChunk, autocast) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies [b, W] of the chunk's rows (in `chunk.rows` order), equal to the plain
    forward's (TRL's `_get_per_token_logps_and_entropies` on `chunk_sequences(inputs, chunk)`); with grad when grad
    is on. `autocast`: the accelerator's autocast context, as TRL's forward runs under it."""
    packed = pack_chunk(inputs, chunk)
    config = unwrap_model(model).config
    with autocast, routed_to_shared_prompt(config, packed.layout, config.num_hidden_layers):
        outputs = model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                        shift_labels=packed.shift_labels, fused_lm_head=True,
                        **{LAYOUT_KWARG: packed.layout})  # fmt: skip
    columns = packed.first_column[:, None] + torch.arange(chunk.width, device=packed.first_column.device)  # [b, W]
    rows = packed.packed_row[:, None]
    return outputs.log_probs[rows, columns], outputs.entropy[rows, columns]


__all__ = ["GroupChunk", "SharedPromptPlan", "model_reason", "pack_chunk", "packed_logps_and_entropies",
           "plan_shared_prompt", "prompt_groups"]  # fmt: skip
