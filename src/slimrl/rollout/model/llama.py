"""The engine's one forward of a decoder over a live model: Llama, Qwen2/2.5, Qwen3, Mistral, SmolLM2 (the plain
path), Phi-3 (fused projections read as row slices, views.py), Gemma 2 and Gemma 3 text (their norms, GeGLU, soft-caps
and per-layer RoPE as data in features.py's `Recipe`) and the MoE models Qwen3-MoE and Mixtral (routed experts in
moe.py), with per-layer sliding windows.

The engine does not call the transformers layers: it runs this forward (embedding, RMSNorm, RoPE, grouped-query
attention over a static cache, gated MLP) and reads every weight from the model's modules at call time
(`views.linear_spec`), so a LoRA adapter is live: an optimizer step changes the tensors this forward (and any CUDA
graph captured from it) reads. One forward serves prefill and decode, eager and fused: its pieces (`GroupedOps`)
are the plain functions of `reference.py` or their compiled / Triton versions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from slimrl.ops.fused import Compiled
from slimrl.rollout.model.features import recipe_for
from slimrl.rollout.model.moe import SparseSpec, StagedFactors, routed_mlp, sparse_identity, sparse_spec
from slimrl.rollout.model.reference import (
    EAGER_GROUPED,
    GroupedOps,
    apply_linear,
    live_columns_mask,
    pieces_for,
    project,
    softcap,
    softcapped_attention,
)
from slimrl.rollout.model.views import (
    FusedRows,
    LayerModules,
    NormSpec,
    UnsupportedModel,
    check_supported,
    embed_tokens,
    layer_modules,
    layer_windows,
    linear_spec,
    norm_spec,
    spec_identity,
    unwrap_model,
)


class Decoder:
    """The modules of a supported model and its shapes; `forward` runs the engine's layers over them."""

    def __init__(self, model: nn.Module):
        causal_lm = unwrap_model(model)
        check_supported(causal_lm)
        inner = causal_lm.model
        config = causal_lm.config
        self.causal_lm = causal_lm
        self.embed = causal_lm.get_input_embeddings()
        self.norm = inner.norm
        self.lm_head = causal_lm.get_output_embeddings()
        self.rotary = inner.rotary_emb
        self.layers = [layer_modules(layer) for layer in inner.layers]
        first = inner.layers[0].self_attn
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = first.head_dim
        self.scaling = float(first.scaling)
        self.recipe = recipe_for(config)  # what the architecture does other than Llama's forward (features.py)
        self._recipe_pieces: dict[bool, tuple] = {}
        types = self.recipe.rope_layer_types
        self.rope_kinds = sorted(set(types)) if types else None  # a RoPE table per layer type (Gemma 3)
        self.rope_slots = [self.rope_kinds.index(t) for t in types] if types else None
        self.vocab_size = self.lm_head.weight.shape[0] if hasattr(self.lm_head, "weight") else config.vocab_size
        # each layer's sliding window (None: global), honoured by the prefill mask and the decode step's columns
        self.windows = layer_windows(causal_lm)
        self.device = self.embed.weight.device
        # the experts' LoRA factors laid out once per rollout (moe.StagedFactors): set by the engine's generate
        self.staged: StagedFactors | None = None
        with torch.no_grad():
            self.dtype = embed_tokens(self.embed, torch.zeros(1, dtype=torch.long, device=self.device)).dtype

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def rope_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [length, D] for positions 0..length-1, from the model's own rotary module (rope scaling
        included), in the activation dtype as transformers uses them. With a table per layer type (Gemma 3's local
        base for sliding layers): [length, kinds * D], kind k in columns k*D..(k+1)*D-1, so that one row gather
        serves every layer (`layer_rope` picks a layer's columns)."""
        positions = torch.arange(length, device=self.device)[None]
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        kinds = [()] if self.rope_kinds is None else [(kind,) for kind in self.rope_kinds]
        tables = [self.rotary(probe, positions, *kind) for kind in kinds]
        for cos, _ in tables:
            if cos.shape[-1] != self.head_dim:
                raise UnsupportedModel(f"partial rotary embeddings ({cos.shape[-1]} of {self.head_dim} dims)")
        if len(tables) == 1:
            return tables[0][0][0].contiguous(), tables[0][1][0].contiguous()
        return torch.cat([cos[0] for cos, _ in tables], -1), torch.cat([sin[0] for _, sin in tables], -1)

    def layer_rope(self, index: int, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s cos/sin [N, D] from the rows of `rope_tables`: its layer type's columns, else all."""
        if self.rope_slots is None:
            return cos, sin
        first = self.rope_slots[index] * self.head_dim
        return cos[:, first : first + self.head_dim], sin[:, first : first + self.head_dim]

    def recipe_ops(self, ops: GroupedOps) -> GroupedOps:
        """The pieces the forward runs: `ops` as given for Llama's recipe; else the recipe's own norm and activation
        (`reference.pieces_for`), compiled when `ops` are, with `ops`' LoRA op and no fused decode kernels (they
        implement Llama's norm and SiLU)."""
        if self.recipe.llama_pieces:
            return ops
        compiled = isinstance(ops.rms_norm, Compiled)
        if compiled not in self._recipe_pieces:
            pieces = pieces_for(self.recipe.norm, self.recipe.activation)
            self._recipe_pieces[compiled] = tuple(Compiled(fn) for fn in pieces) if compiled else pieces
        return GroupedOps(*self._recipe_pieces[compiled], ops.add_lora)

    def layer_args(self, layer: LayerModules):
        """The live specs of one layer's tensors, read now (not cached: adapters may have changed)."""
        q_norm = norm_spec(layer.q_norm) if layer.q_norm is not None else None
        k_norm = norm_spec(layer.k_norm) if layer.k_norm is not None else None
        pre = (norm_spec(layer.input_norm), linear_spec(layer.q), linear_spec(layer.k), linear_spec(layer.v))
        post = (linear_spec(layer.o), norm_spec(layer.post_norm))
        if layer.sparse is not None:  # a mixture-of-experts block (Qwen3-MoE, Mixtral)
            return pre, (q_norm, k_norm), post, sparse_spec(layer.sparse, self.staged)
        mlp = (linear_spec(layer.gate), linear_spec(layer.up), linear_spec(layer.down))
        return pre, (q_norm, k_norm), post, mlp

    def forward(self, ids, cos, sin, attend, ops: GroupedOps = EAGER_GROUPED, mark_dynamic: bool = False):
        """Hidden states after the final norm. ids [N] (flattened tokens), cos/sin [N, D] of their positions (rows of
        `rope_tables`: [N, kinds * D] with a table per layer type);
        attend(layer_index, q, k, v) -> [N, heads * D] does the attention (prefill or decode, with the cache; k and
        v are None when a fused kernel has written them into the cache already). Cut for few launches: projections
        sharing an input are applied as a group (one LoRA update for q/k/v, one for gate/up), each residual add is
        fused with the norm after it, and `ops.fused` (when bound to a decode step) runs whole projections as
        kernels. `ops` are the reference functions by default (eager, CPU) or compiled / Triton ones on CUDA; an
        architecture whose recipe is not Llama's runs its own norm and activation instead (`recipe_ops`).
        mark_dynamic: tell torch.compile that N varies, so one compiled kernel set serves every batch and prompt
        length."""
        mark = _mark_rows_dynamic if mark_dynamic and ids.shape[0] > 1 else _unmarked
        n, heads, kv_heads, dim = ids.shape[0], self.heads, self.kv_heads, self.head_dim
        ops = self.recipe_ops(ops)
        hidden = embed_tokens(self.embed, ids)
        mark(hidden, cos, sin)
        begin = getattr(ops.add_lora, "begin", None)
        if begin is not None:  # one zeroed LoRA workspace for the whole forward (4 projection groups per layer)
            first = self.layer_args(self.layers[0])
            specs = (*first[0][1:], *first[2][:1], *(() if isinstance(first[3], SparseSpec) else first[3]))
            rank = max((a.shape[0] for spec in specs for a, _, _ in spec.loras), default=0)
            begin(n, 4 * self.num_layers, rank, hidden.device)
        delta = None
        for index, layer in enumerate(self.layers):
            (norm, q, k, v), (q_norm, k_norm), (o, post_norm), mlp = self.layer_args(layer)
            if delta is not None:
                mark(delta)
            hidden, h = _add_norm(ops, hidden, delta, norm)
            fused, (layer_cos, layer_sin) = ops.fused, self.layer_rope(index, cos, sin)
            query = None if fused is None else fused.qkv(index, h, (q, k, v), q_norm, k_norm, layer_cos, layer_sin)
            if query is not None:  # k and v are in the cache already
                attn = attend(index, query.view(n, heads, dim), None, None)
            else:
                query, key, value = project(h, (q, k, v), ops.add_lora)
                query, key = query.view(n, heads, dim), key.view(n, kv_heads, dim)
                mark(query, key)
                query, key = ops.qk_norm_rope(query, key, q_norm, k_norm, layer_cos, layer_sin)
                attn = attend(index, query, key, value.view(n, kv_heads, dim))
            out = None if fused is None else fused.linear(attn, o, "o")
            if out is None:
                (out,) = project(attn, (o,), ops.add_lora)
            out = _out_norm(ops, out, layer.attn_out_norm)
            mark(hidden, out)
            hidden, h = _add_norm(ops, hidden, out, post_norm)
            delta = _out_norm(ops, self._mlp(h, mlp, ops, mark), layer.mlp_out_norm)
        mark(hidden, delta)
        return _add_norm(ops, hidden, delta, norm_spec(self.norm))[1]

    def _mlp(self, h: torch.Tensor, specs, ops: GroupedOps, mark) -> torch.Tensor:
        """The layer's gated MLP of its post-attention-norm output h [N, hidden]: fused kernels where the ops have
        them bound, else the grouped projections; a sparse block's routed experts (moe.py: during a decode step with
        the fused kernels bound, `kernels.moe`'s launches)."""
        if isinstance(specs, SparseSpec):
            return routed_mlp(h, specs, ops.fused)
        gate, up, down = specs
        fused = ops.fused
        act = None if fused is None else fused.gate_up(h, gate, up, down)
        if act is None:
            gate_out, up_out = project(h, (gate, up), ops.add_lora)
            mark(gate_out, up_out)
            act = ops.silu_mul(gate_out, up_out)
        delta = None if fused is None else fused.linear(act, down, "down")
        if delta is None:
            (delta,) = project(act, (down,), ops.add_lora)
        return delta

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, V] in the model's dtype, as transformers' lm_head gives them (soft-capped where the model caps them)."""
        logits = apply_linear(hidden, linear_spec(self.lm_head))
        cap = self.recipe.final_softcap
        return logits if cap is None else softcap(logits, cap)

    def fingerprint(self) -> tuple:
        """Identity of every tensor and constant a captured graph bakes in; a change means capture again."""
        parts = [self.embed.weight.data_ptr(), self.norm.weight.data_ptr()]
        if self.staged is not None:
            parts.append(self.staged.identity())
        for layer in self.layers:
            if layer.sparse is not None:
                parts.append(sparse_identity(layer.sparse))
            for module in (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down):
                if module is None:  # a sparse layer's dense MLP
                    continue
                identity = spec_identity(linear_spec(module))
                # a slice of a fused projection shares its data: its bounds say which rows the graph reads
                parts.append((identity, module.start, module.stop) if isinstance(module, FusedRows) else identity)
            for norm in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm, layer.attn_out_norm,
                         layer.mlp_out_norm):  # fmt: skip
                parts.append(None if norm is None else (norm.weight.data_ptr(), norm_spec(norm).eps))
        parts.append(spec_identity(linear_spec(self.lm_head)))
        return tuple(parts)


def _add_norm(ops: GroupedOps, hidden, delta, norm: NormSpec):
    """(hidden + delta, its RMSNorm), delta None meaning no add: the fused kernel when the ops have one bound to a
    decode step, else the ops' own (compiled) functions."""
    if ops.fused is not None:
        done = ops.fused.add_rms_norm(hidden, delta, norm)
        if done is not None:
            return done
    if delta is None:
        return hidden, ops.rms_norm(hidden, norm.weight, norm.eps)
    return ops.add_rms_norm(hidden, delta, norm.weight, norm.eps)


def _out_norm(ops: GroupedOps, x: torch.Tensor, norm) -> torch.Tensor:
    """A sandwich norm (Gemma) of an attention or MLP output before its residual add; x itself where there is none."""
    if norm is None:
        return x
    spec = norm_spec(norm)
    return ops.rms_norm(x, spec.weight, spec.eps)


def _mark_rows_dynamic(*tensors) -> None:
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)


def _unmarked(*tensors) -> None:
    pass


# -- attention over the static cache --------------------------------------------------------------------------------


def prefill_attention(decoder: Decoder, cache, layer: int, rows: slice, q, k, v, mask, batch: int, length: int):
    """Causal attention over a left-padded block of prompts; stores their K/V in the cache.

    q [b*P, heads, D], k/v [b*P, kv_heads, D], mask [b, 1, P, P] additive, or None when no row has padding (plain
    causal attention, which SDPA runs with its flash kernels). Returns [b*P, heads*D].
    """
    heads, kv_heads, dim = decoder.heads, decoder.kv_heads, decoder.head_dim
    q = q.view(batch, length, heads, dim).transpose(1, 2)
    k = k.view(batch, length, kv_heads, dim).transpose(1, 2)
    v = v.view(batch, length, kv_heads, dim).transpose(1, 2)
    cache.write_prompt(layer, rows, k, v)
    if decoder.recipe.attn_softcap is not None:  # Gemma 2's soft-capped scores: eager attention (SDPA cannot)
        out = softcapped_attention(q, k, v, mask, decoder.scaling, decoder.recipe.attn_softcap)
        return out.transpose(1, 2).reshape(batch * length, heads * dim)
    if mask is None:  # no padding: plain causal attention, query head h reading kv head h // group
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=decoder.scaling, enable_gqa=True)
    else:
        if heads != kv_heads:  # query head h reads kv head h // group, as transformers' repeat_kv
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=decoder.scaling)
    return out.transpose(1, 2).reshape(batch * length, heads * dim)


def decode_attention(decoder: Decoder, cache, layer: int, column: torch.Tensor, q, k, v, mask, kernel=None,
                     starts=None, write_column=None, source=None):  # fmt: skip
    """One new token per sequence: write its K/V at `column`, attend over the cache row's live columns.

    q [B, heads, D], k/v [B, kv_heads, D], mask [B, 1, 1, S] additive. `kernel` (kernels.attention.decode_attention)
    reads each row's columns [starts[b], column] directly; without it, SDPA with the mask, where the query heads that
    share a kv head are laid out as that head's queries ([B, kv_heads, group, D]), so nothing is repeated.
    With a shared prompt cache (`kv_cache`), K/V go to `write_column` of the rows' own columns, and the plain paths
    read each row's prompt from its prefix row `source[b]` (`StaticKVCache.rows`).
    """
    batch = q.shape[0]
    heads, kv_heads, dim = decoder.heads, decoder.kv_heads, decoder.head_dim
    if k is not None:  # else the fused q/k/v kernel has written them
        cache.write_column(layer, column if write_column is None else write_column, k, v)
    if decoder.recipe.attn_softcap is not None:  # Gemma 2's soft-capped scores: eager (not SDPA, not the kernel)
        keys, values = cache.rows(layer, source)
        if kernel is not None:  # the runner keeps no mask beside the kernel
            mask = live_columns_mask(starts, column, keys.shape[2], q.dtype)
        out = softcapped_attention(q[:, :, None], keys, values, mask, decoder.scaling, decoder.recipe.attn_softcap)
        return out.reshape(batch, heads * dim)
    if kernel is not None:
        return kernel(q, cache.keys[layer], cache.values[layer], starts, column, decoder.scaling,
                      layer).reshape(batch, heads * dim)  # fmt: skip
    keys, values = cache.rows(layer, source)
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, dim)
    if q.is_cuda:  # cuDNN's kernel, the default pick on Hopper, is slow for a handful of queries against a mask
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=decoder.scaling)
    else:
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=decoder.scaling)
    return out.reshape(batch, heads * dim)
