"""The attention of the shared-prompt forward: the G completions of one prompt against ONE copy of its activations.

A packed row holds one prompt group: the prompt but its last token (left-padded to the batch's longest, the "shared
part"), then one segment per completion, each `[last prompt token, c_0, ..., c_{W-2}]` (the completion's last token is
never an input: nothing is predicted from it). Per row the attention is, exactly:
- shared-part queries: causal over the shared part (one SDPA call with is_causal, no mask tensor);
- segment i's queries: over every shared-part key plus segment i's own keys causally, never another segment's:
  [segments, heads, W, d] queries against [shared keys expanded, own keys] with a [W, S + W] mask (no [L, L] mask);
- left padding before the shared part and right padding after the last segment: zero output, no keys.
So the last prompt token of each segment sees what it sees in the plain forward (the whole prompt), and so does every
completion token: the logits equal the plain forward's while the prompt's layers run once per group, not G times.

How it is reached: `ATTENTION_NAME` is registered with transformers' `AttentionInterface` (and its mask interface).
`routed_to_shared_prompt` switches a model config's `_attn_implementation` to it for as long as a packed forward's
layout is alive: the forward itself and, where gradient checkpointing keeps the layout for the recompute, until that
graph is freed (after its backward). Calls that carry no layout (any other forward while the switch is on) go to SDPA
unchanged, masks included, so the switch never changes another forward's numbers. The layout comes in through the
forward's kwargs (`shared_prompt_layout=`), which transformers passes to every attention call and which checkpoints
keep for the recompute. Each call is counted on the layout, so a forward whose layers bypassed this function is
caught instead of returning a plain causal attention over the packed row.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, causal_lower_right

ATTENTION_NAME = "slimrl_shared_prompt"
INNER_ATTENTION = "sdpa"  # what calls without a layout run, and the only implementation the switch replaces
LAYOUT_KWARG = "shared_prompt_layout"

# True while a packed forward builds its masks: the packed row's attention needs none (it is built per segment)
_packing = contextvars.ContextVar("slimrl_shared_prompt_packing", default=False)


@dataclass(eq=False)
class PackedLayout:
    """Where the parts of each packed row are (one row per prompt group; columns of the packed row)."""

    shared_starts: list[int]  # per row: first column of its shared part (the columns before it are padding)
    shared_end: int  # column where every row's shared part ends and its first segment starts
    segments: list[int]  # per row: how many segments (completions) follow the shared part
    width: int  # columns of each segment
    calls: int = field(default=0, compare=False)  # attention calls that read this layout (forward and recompute)

    def __post_init__(self):
        if len(self.shared_starts) != len(self.segments):
            raise ValueError(f"{len(self.shared_starts)} shared parts but {len(self.segments)} segment counts")
        if self.width < 1 or any(not 0 <= s <= self.shared_end for s in self.shared_starts):
            raise ValueError(f"invalid packed layout: {self}")


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: PackedLayout,
                     scaling: float | None) -> torch.Tensor:  # fmt: skip
    """query [n, H, L, d], key/value [n, Hkv, L, d] -> attention output [n, H, L, d] of the packed rows."""
    num_rows, heads, length, head_dim = query.shape
    if num_rows != len(layout.segments):
        raise ValueError(f"the packed layout describes {len(layout.segments)} rows, the batch has {num_rows}")
    rows = []
    for row in range(num_rows):
        start, end = layout.shared_starts[row], layout.shared_end
        stop = end + layout.segments[row] * layout.width
        if stop > length:
            raise ValueError(f"packed row {row} needs {stop} columns, the batch has {length}")
        q, k, v = query[row], key[row], value[row]  # [H, L, d], [Hkv, L, d]
        parts = [q.new_zeros(heads, start, head_dim)] if start else []
        if end > start:  # the shared part: plain causal attention, no mask tensor
            parts.append(_sdpa(q[:, start:end], k[:, start:end], v[:, start:end], scaling, causal=True))
        parts.append(_segment_attention(q, k, v, start, end, layout.segments[row], layout.width, scaling))
        if stop < length:
            parts.append(q.new_zeros(heads, length - stop, head_dim))
        rows.append(torch.cat(parts, dim=1))
    return torch.stack(rows)


def _segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, end: int, count: int,
                       width: int, scaling: float | None) -> torch.Tensor:  # fmt: skip
    """Each of `count` segments of `width` columns from column `end` against the shared keys [start, end) and its
    own keys causally: [H, count * width, d]."""
    heads, _, head_dim = q.shape
    kv_heads, shared = k.shape[0], end - start
    stop = end + count * width
    queries = q[:, end:stop].reshape(heads, count, width, head_dim).transpose(0, 1)  # [G, H, W, d]

    def keys_of(t: torch.Tensor) -> torch.Tensor:  # [G, Hkv, S + W, d]: the shared keys, then the segment's own
        own = t[:, end:stop].reshape(kv_heads, count, width, head_dim).transpose(0, 1)
        prefix = t[:, start:end].unsqueeze(0).expand(count, -1, -1, -1)
        return _repeat_kv(torch.cat([prefix, own], dim=2), heads // kv_heads)

    # query i of a segment sees every shared key and its own keys 0..i: key j with j <= i + shared, the causal mask
    # aligned to the lower right; as torch's CausalBias it needs no mask tensor and runs flash attention on CUDA (a
    # [W, S + W] boolean tensor sent every call to the memory-efficient kernel, which made the packed training step
    # no faster than the plain one on an H100)
    mask = causal_lower_right(width, shared + width)
    out = _sdpa(queries, keys_of(k), keys_of(v), scaling, mask=mask)  # [G, H, W, d]
    return out.transpose(0, 1).reshape(heads, count * width, head_dim)


def _repeat_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[..., Hkv, T, d] -> [..., Hkv * groups, T, d], query head h reading kv head h // groups (transformers' order).
    Done by hand for the masked call: SDPA's enable_gqa has no fused kernel with a mask tensor on every backend."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=-3)


def _sdpa(q, k, v, scaling, causal: bool = False, mask=None) -> torch.Tensor:
    if isinstance(mask, CausalBias):
        # what F.scaled_dot_product_attention does with a CausalBias (flash, else memory-efficient, else the mask
        # materialised; never cuDNN), called directly: under slimrl's training_attention guard F's function is a
        # wrapper, which CausalBias' __torch_function__ does not recognise
        return CausalBias._dispatch(q, k, v, mask, scale=scaling)
    # F.scaled_dot_product_attention is looked up at call time, so slimrl's training_attention guard applies
    if q.shape[-3] != k.shape[-3]:  # (the masked call has its keys repeated by hand)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scaling,
                                              enable_gqa=True)  # fmt: skip
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scaling)


def shared_prompt_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                            shared_prompt_layout: PackedLayout | None = None, **kwargs):  # fmt: skip
    """The function registered as ATTENTION_NAME: the packed attention for calls that carry a layout, SDPA (exactly
    transformers' own call) for the others. Returns (output [n, L, H, d], None) as transformers' functions do."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if shared_prompt_layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)  # fmt: skip
    if dropout > 0 or kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise ValueError("the shared-prompt attention computes full causal attention without dropout, sliding "
                         "windows or soft-capping; set shared_prompt_forward=False for this model.")  # fmt: skip
    shared_prompt_layout.calls += 1
    out = packed_attention(query, key, value, shared_prompt_layout, scaling)
    return out.transpose(1, 2).contiguous(), None


def _shared_prompt_mask(*args, **kwargs):
    """SDPA's mask, except inside a packed forward, whose attention builds its own per segment."""
    from transformers.masking_utils import sdpa_mask

    return None if _packing.get() else sdpa_mask(*args, **kwargs)


def register() -> None:
    """Register ATTENTION_NAME with transformers (idempotent; adds a name, changes no existing one)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if ATTENTION_NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionInterface.register(ATTENTION_NAME, shared_prompt_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, _shared_prompt_mask)


class _Route:
    """One config's switch: how many packed layouts are alive, and the implementation to restore."""

    def __init__(self, config):
        current = config._attn_implementation  # a copy of a routed config carries the name: SDPA is underneath
        self.config, self.live = config, 0
        self.previous = INNER_ATTENTION if current == ATTENTION_NAME else current


_routes: dict[int, _Route] = {}  # id(config) -> its switch, only while some packed layout of that model is alive


def _release(config_id: int) -> None:
    route = _routes.get(config_id)
    if route is None:
        return
    route.live -= 1
    if route.live == 0:
        route.config._attn_implementation = route.previous
        del _routes[config_id]


def _hold(config, layout: PackedLayout) -> None:
    """Route `config`'s attention to ATTENTION_NAME until `layout` is freed (with the graph that keeps it)."""
    if config._attn_implementation not in (INNER_ATTENTION, ATTENTION_NAME):
        raise ValueError(f"the shared-prompt attention replaces {INNER_ATTENTION!r}; this model runs "
                         f"{config._attn_implementation!r}. Load it with attn_implementation='sdpa' or set "
                         "shared_prompt_forward=False.")  # fmt: skip
    register()
    route = _routes.get(id(config))
    if route is None:
        route = _routes[id(config)] = _Route(config)
        config._attn_implementation = ATTENTION_NAME
    route.live += 1
    weakref.finalize(layout, _release, id(config))


def is_routed(config) -> bool:
    """Whether `config`'s attention currently goes through ATTENTION_NAME (a packed layout of it is alive)."""
    return id(config) in _routes


@contextlib.contextmanager
def routed_to_shared_prompt(config, layout: PackedLayout, attention_layers: int) -> Iterator[None]:
    """The context of one packed forward of the model whose config is `config`: its attention goes through
    ATTENTION_NAME (until `layout` is freed), its mask creation builds nothing, and on exit every one of its
    `attention_layers` attention layers must have read the layout, or the forward bypassed this function."""
    _hold(config, layout)
    before = layout.calls
    token = _packing.set(True)
    try:
        yield
    finally:
        _packing.reset(token)
    calls = layout.calls - before
    if calls != attention_layers:
        raise RuntimeError(
            f"the shared-prompt forward ran {calls} packed attention calls for {attention_layers} attention layers: "
            "this model's attention does not go through transformers' attention interface everywhere, so the packed "
            "rows were not attended as separate completions. Set shared_prompt_forward=False for this model."
        )
