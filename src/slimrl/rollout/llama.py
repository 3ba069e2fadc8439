"""A compact forward of Llama-family decoders (Llama, Qwen2/2.5, Qwen3, Mistral, SmolLM2) over a live model.

The engine does not call the transformers layers: it runs its own forward (embedding, RMSNorm, RoPE, grouped-query
attention over a static cache, gated MLP) and reads every weight from the model's modules at call time. So a LoRA
adapter is live: an optimizer step changes the tensors this forward (and any CUDA graph captured from it) reads.

Projections come in two kinds (`linear_spec`):
- plain `nn.Linear`, and peft's LoRA `Linear` over a plain `nn.Linear` (vanilla LoRA, any number of active adapters):
  we apply `W x + b + sum(B (A x) * scale)` ourselves with the module's own tensors, in peft's order and dtypes
  (fp32 adapters on a bf16 base compute the update in fp32, as peft does). LoRA dropout is not applied: rollouts
  are inference, as in peft's eval mode.
- anything else (bitsandbytes `Linear4bit`/`Linear8bitLt`, LoRA over those, DoRA and other variants): we call the
  module, which dequantises or applies its variant itself.

The math mirrors transformers' (`LlamaRMSNorm`, `apply_rotary_pos_emb`, `repeat_kv`, position ids from the attention
mask's cumsum) so that greedy decoding reproduces `model.generate` token for token in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
# RoPE types whose cos/sin depend on the position alone; "dynamic" and "longrope" also depend on the sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class LinearSpec(NamedTuple):
    """How to apply one projection right now: call `module`, or compute from the tensors."""

    module: nn.Module | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    loras: tuple  # ((A [r, in], B [out, r], scale), ...) for the active adapters


class NormSpec(NamedTuple):
    weight: torch.Tensor
    eps: float


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers `*ForCausalLM` inside DDP, torch.compile and peft wrappers (LoRA layers stay injected)."""
    for _ in range(8):
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
            model = model.get_base_model()
        else:
            break
    return model


def supports(model: nn.Module) -> tuple[bool, str]:
    """(True, "") when the engine can run `model`, else (False, why): the reason names what is missing."""
    try:
        _check(unwrap_model(model))
    except UnsupportedModel as err:
        return False, str(err)
    return True, ""


class UnsupportedModel(ValueError):
    """The model is not a Llama-family decoder this forward implements; the message says why."""


def _check(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(
            f"architecture {model_type!r} ({type(model).__name__}) is not one the rollout engine implements "
            f"({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    inner = getattr(model, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, name):
            raise UnsupportedModel(f"{type(model).__name__} has no model.{name}; not a standard decoder layout")
    if getattr(model, "lm_head", None) is None:
        raise UnsupportedModel(f"{type(model).__name__} has no lm_head")
    act = getattr(config, "hidden_act", None)
    if act not in ("silu", "swish"):
        raise UnsupportedModel(f"hidden_act {act!r} is not supported (the engine implements silu)")
    rope_type = getattr(inner.rotary_emb, "rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedModel(
            f"rope type {rope_type!r} depends on the sequence length; supported: {', '.join(STATIC_ROPE_TYPES)}"
        )
    device_map = getattr(model, "hf_device_map", None)
    if device_map and len({str(d) for d in device_map.values()}) > 1:
        raise UnsupportedModel("the model is spread over several devices (device_map); the engine needs one device")
    if any(p.device.type == "meta" for p in model.parameters()):
        raise UnsupportedModel("some weights are on the meta device (offloaded); the engine needs them resident")
    for i, layer in enumerate(inner.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        if attn is None or mlp is None or not all(hasattr(attn, n) for n in names):
            raise UnsupportedModel(f"layer {i} lacks self_attn.q/k/v/o_proj or mlp")
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            raise UnsupportedModel(f"layer {i} has no gated MLP (gate_proj, up_proj, down_proj)")
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not (hasattr(norm, "weight") and hasattr(norm, "variance_epsilon")):
                raise UnsupportedModel(f"layer {i} has a norm that is not an RMSNorm ({type(norm).__name__})")


# -- live views of the model's tensors --------------------------------------------------------------------------


def _lora_linear_spec(module: nn.Module) -> LinearSpec | None:
    """The spec of a vanilla peft LoRA Linear over a plain nn.Linear, or None when the module must be called."""
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:  # peft is a dependency, but a model without adapters needs none of it
        return None
    if not isinstance(module, LoraLinear):
        return None
    base = module.base_layer
    if type(base) is not nn.Linear or getattr(module, "fan_in_fan_out", False):
        return None
    if module.merged:
        # peft unmerges inside forward when adapters are disabled; let it
        return None if module.disable_adapters else LinearSpec(None, base.weight, base.bias, ())
    if module.disable_adapters:
        return LinearSpec(None, base.weight, base.bias, ())
    loras = []
    variants = getattr(module, "lora_variant", {}) or {}
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        lora_a, lora_b = module.lora_A[name], module.lora_B[name]
        if name in variants or type(lora_a) is not nn.Linear or lora_b.bias is not None:
            return None
        loras.append((lora_a.weight, lora_b.weight, float(module.scaling[name])))
    return LinearSpec(None, base.weight, base.bias, tuple(loras))


def linear_spec(module: nn.Module) -> LinearSpec:
    """What applying `module` means at this moment (adapters enabled or not, merged or not, which are active)."""
    if type(module) is nn.Linear:
        return LinearSpec(None, module.weight, module.bias, ())
    spec = _lora_linear_spec(module)
    return spec if spec is not None else LinearSpec(module, None, None, ())


def norm_spec(module: nn.Module) -> NormSpec:
    return NormSpec(module.weight, float(module.variance_epsilon))


def apply_linear(x: torch.Tensor, spec: LinearSpec) -> torch.Tensor:
    """`spec` applied to x [N, in]; for LoRA the same ops, order and dtypes as peft's `Linear.forward`."""
    if spec.module is not None:
        return spec.module(x)
    y = F.linear(x, spec.weight, spec.bias)
    if not spec.loras:
        return y
    out_dtype = y.dtype
    for lora_a, lora_b, scale in spec.loras:
        y = y + F.linear(F.linear(x.to(lora_a.dtype), lora_a), lora_b) * scale
    return y.to(out_dtype)


# -- the math, as transformers does it ----------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: normalise in fp32, round to the input dtype, then scale by the weight."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] rotated by cos/sin [N, D] of each token's position."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin


def attention_inputs(hidden, norm, q, k, v, q_norm, k_norm, cos, sin, heads: int, kv_heads: int, head_dim: int):
    """input RMSNorm, q/k/v projections, Qwen3's per-head q/k norms, RoPE. hidden [N, H] -> q [N, heads, D],
    k and v [N, kv_heads, D]."""
    n = hidden.shape[0]
    h = rms_norm(hidden, norm.weight, norm.eps)
    query = apply_linear(h, q).view(n, heads, head_dim)
    key = apply_linear(h, k).view(n, kv_heads, head_dim)
    value = apply_linear(h, v).view(n, kv_heads, head_dim)
    if q_norm is not None:
        query = rms_norm(query, q_norm.weight, q_norm.eps)
        key = rms_norm(key, k_norm.weight, k_norm.eps)
    return apply_rope(query, cos, sin), apply_rope(key, cos, sin), value


def attention_output_and_mlp(attn, hidden, o, post_norm, gate, up, down):
    """o projection and residual, post-attention RMSNorm, SiLU-gated MLP and residual: the layer's new hidden."""
    hidden = hidden + apply_linear(attn, o)
    h = rms_norm(hidden, post_norm.weight, post_norm.eps)
    return hidden + apply_linear(F.silu(apply_linear(h, gate)) * apply_linear(h, up), down)


def final_norm(hidden, norm):
    return rms_norm(hidden, norm.weight, norm.eps)


def add_rms_norm(hidden, delta, norm_weight, eps: float):
    """(hidden + delta, its RMSNorm): a residual add and the next norm, one kernel when compiled."""
    hidden = hidden + delta
    return hidden, rms_norm(hidden, norm_weight, eps)


def qk_norm_rope(query, key, q_norm, k_norm, cos, sin):
    """Qwen3's per-head q/k RMSNorm (when present), then RoPE. query [N, heads, D], key [N, kv_heads, D]."""
    if q_norm is not None:
        query = rms_norm(query, q_norm.weight, q_norm.eps)
        key = rms_norm(key, k_norm.weight, k_norm.eps)
    return apply_rope(query, cos, sin), apply_rope(key, cos, sin)


def silu_mul(gate, up):
    return F.silu(gate) * up


def add_lora_(x: torch.Tensor, items) -> None:
    """items: [(y [M, n], (A [r, K], B [n, r], scale))]; y += B(A(x)) * scale in place, as peft computes it."""
    for y, (lora_a, lora_b, scale) in items:
        y.copy_((y + F.linear(F.linear(x.to(lora_a.dtype), lora_a), lora_b) * scale).to(y.dtype))


class GroupedOps(NamedTuple):
    """The pieces of `Decoder.forward_grouped`: plain functions here; compiled ones and Triton LoRA on CUDA."""

    rms_norm: object
    add_rms_norm: object
    qk_norm_rope: object
    silu_mul: object
    add_lora: object  # add_lora(x, items), in place
    fused: object = None  # fused_decode.FusedDecode bound to a decode step, or None


EAGER_GROUPED = GroupedOps(rms_norm, add_rms_norm, qk_norm_rope, silu_mul, add_lora_)


def project(x: torch.Tensor, specs, add_lora) -> list[torch.Tensor]:
    """Apply projections that share the input x: base GEMMs, then one grouped LoRA update for all of them.

    Same values as `apply_linear` per spec (peft's math); several active adapters fall back to it, since peft keeps
    their running sum in the adapter dtype."""
    outs = [s.module(x) if s.module is not None else F.linear(x, s.weight, s.bias) for s in specs]
    single = [(y, s.loras[0]) for y, s in zip(outs, specs, strict=True) if s.module is None and len(s.loras) == 1]
    if single:
        add_lora(x, single)
    for i, s in enumerate(specs):
        if s.module is None and len(s.loras) > 1:
            outs[i] = apply_linear(x, s)
    return outs


class Blocks(NamedTuple):
    """The three pure functions of a layer's forward; the engine swaps in torch.compile'd versions on CUDA."""

    attention_inputs: object
    attention_output_and_mlp: object
    final_norm: object


EAGER_BLOCKS = Blocks(attention_inputs, attention_output_and_mlp, final_norm)


# -- the decoder ----------------------------------------------------------------------------------------------------


@dataclass
class LayerModules:
    input_norm: nn.Module
    q: nn.Module
    k: nn.Module
    v: nn.Module
    o: nn.Module
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    post_norm: nn.Module
    gate: nn.Module
    up: nn.Module
    down: nn.Module


class Decoder:
    """The modules of a supported model and its shapes; `forward` runs our layers over them."""

    def __init__(self, model: nn.Module):
        causal_lm = unwrap_model(model)
        _check(causal_lm)
        inner = causal_lm.model
        config = causal_lm.config
        self.causal_lm = causal_lm
        self.embed = causal_lm.get_input_embeddings()
        self.norm = inner.norm
        self.lm_head = causal_lm.get_output_embeddings()
        self.rotary = inner.rotary_emb
        self.layers = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                LayerModules(
                    input_norm=layer.input_layernorm,
                    q=attn.q_proj,
                    k=attn.k_proj,
                    v=attn.v_proj,
                    o=attn.o_proj,
                    q_norm=getattr(attn, "q_norm", None),
                    k_norm=getattr(attn, "k_norm", None),
                    post_norm=layer.post_attention_layernorm,
                    gate=mlp.gate_proj,
                    up=mlp.up_proj,
                    down=mlp.down_proj,
                )
            )
        first = inner.layers[0].self_attn
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = first.head_dim
        self.scaling = float(first.scaling)
        self.vocab_size = self.lm_head.weight.shape[0] if hasattr(self.lm_head, "weight") else config.vocab_size
        windows = [getattr(layer.self_attn, "sliding_window", None) for layer in inner.layers]
        if model_window := (getattr(config, "sliding_window", None) if config.model_type == "mistral" else None):
            windows.append(model_window)
        self.sliding_window = min((w for w in windows if w), default=None)
        self.device = self.embed.weight.device
        with torch.no_grad():
            self.dtype = self.embed(torch.zeros(1, dtype=torch.long, device=self.device)).dtype

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def rope_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [length, D] for positions 0..length-1, from the model's own rotary module (rope scaling
        included), in the activation dtype as transformers uses them."""
        positions = torch.arange(length, device=self.device)[None]
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        cos, sin = self.rotary(probe, positions)
        if cos.shape[-1] != self.head_dim:
            raise UnsupportedModel(f"partial rotary embeddings ({cos.shape[-1]} of {self.head_dim} dims)")
        return cos[0].contiguous(), sin[0].contiguous()

    def layer_args(self, layer: LayerModules):
        """The live specs of one layer's tensors, read now (not cached: adapters may have changed)."""
        q_norm = norm_spec(layer.q_norm) if layer.q_norm is not None else None
        k_norm = norm_spec(layer.k_norm) if layer.k_norm is not None else None
        pre = (norm_spec(layer.input_norm), linear_spec(layer.q), linear_spec(layer.k), linear_spec(layer.v))
        post = (linear_spec(layer.o), norm_spec(layer.post_norm))
        mlp = (linear_spec(layer.gate), linear_spec(layer.up), linear_spec(layer.down))
        return pre, (q_norm, k_norm), post, mlp

    def forward(self, ids, cos, sin, attend, blocks: Blocks = EAGER_BLOCKS, mark_dynamic: bool = False):
        """Hidden states after the final norm. ids [N] (flattened tokens), cos/sin [N, D] of their positions;
        attend(layer_index, q, k, v) -> [N, heads * D] does the attention (prefill or decode, with the cache).
        mark_dynamic: tell torch.compile that N varies, so one compiled kernel set serves every batch and prompt
        length."""
        mark = _mark_rows_dynamic if mark_dynamic and ids.shape[0] > 1 else _unmarked
        hidden = self.embed(ids)
        mark(cos, sin)
        for index, layer in enumerate(self.layers):
            (norm, q, k, v), (q_norm, k_norm), (o, post_norm), (gate, up, down) = self.layer_args(layer)
            mark(hidden)
            query, key, value = blocks.attention_inputs(
                hidden, norm, q, k, v, q_norm, k_norm, cos, sin, self.heads, self.kv_heads, self.head_dim
            )
            attn = attend(index, query, key, value)
            mark(attn)
            hidden = blocks.attention_output_and_mlp(attn, hidden, o, post_norm, gate, up, down)
        mark(hidden)
        return blocks.final_norm(hidden, norm_spec(self.norm))

    def forward_grouped(self, ids, cos, sin, attend, ops: GroupedOps = EAGER_GROUPED, mark_dynamic: bool = False):
        """The same forward as `forward`, cut for few launches: projections sharing an input are applied as a group
        (one LoRA update for q/k/v, one for gate/up) and each residual add is fused with the norm after it."""
        mark = _mark_rows_dynamic if mark_dynamic and ids.shape[0] > 1 else _unmarked
        n, heads, kv_heads, dim = ids.shape[0], self.heads, self.kv_heads, self.head_dim
        hidden = self.embed(ids)
        mark(hidden, cos, sin)
        begin = getattr(ops.add_lora, "begin", None)
        if begin is not None:  # one zeroed LoRA workspace for the whole forward (4 projection groups per layer)
            first = self.layer_args(self.layers[0])
            specs = (*first[0][1:], *first[2][:1], *first[3])
            rank = max((a.shape[0] for spec in specs for a, _, _ in spec.loras), default=0)
            begin(n, 4 * self.num_layers, rank, hidden.device)
        delta = None
        for index, layer in enumerate(self.layers):
            (norm, q, k, v), (q_norm, k_norm), (o, post_norm), (gate, up, down) = self.layer_args(layer)
            if delta is not None:
                mark(delta)
            hidden, h = _add_norm(ops, hidden, delta, norm)
            fused = ops.fused
            query = None if fused is None else fused.qkv(index, h, (q, k, v), q_norm, k_norm, cos, sin)
            if query is not None:  # k and v are in the cache already
                attn = attend(index, query.view(n, heads, dim), None, None)
            else:
                query, key, value = project(h, (q, k, v), ops.add_lora)
                query, key = query.view(n, heads, dim), key.view(n, kv_heads, dim)
                mark(query, key)
                query, key = ops.qk_norm_rope(query, key, q_norm, k_norm, cos, sin)
                attn = attend(index, query, key, value.view(n, kv_heads, dim))
            out = None if fused is None else fused.linear(attn, o, "o")
            if out is None:
                (out,) = project(attn, (o,), ops.add_lora)
            mark(hidden, out)
            hidden, h = _add_norm(ops, hidden, out, post_norm)
            act = None if fused is None else fused.gate_up(h, gate, up, down)
            if act is None:
                gate_out, up_out = project(h, (gate, up), ops.add_lora)
                mark(gate_out, up_out)
                act = ops.silu_mul(gate_out, up_out)
            delta = None if fused is None else fused.linear(act, down, "down")
            if delta is None:
                (delta,) = project(act, (down,), ops.add_lora)
        mark(hidden, delta)
        return _add_norm(ops, hidden, delta, norm_spec(self.norm))[1]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, V] in the model's dtype, as transformers' lm_head gives them."""
        return apply_linear(hidden, linear_spec(self.lm_head))

    def fingerprint(self) -> tuple:
        """Identity of every tensor and constant a captured graph bakes in; a change means capture again."""
        parts = [self.embed.weight.data_ptr(), self.norm.weight.data_ptr()]
        for layer in self.layers:
            for module in (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down):
                parts.append(_spec_identity(linear_spec(module)))
            for norm in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm):
                parts.append(None if norm is None else (norm.weight.data_ptr(), float(norm.variance_epsilon)))
        parts.append(_spec_identity(linear_spec(self.lm_head)))
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


def _mark_rows_dynamic(*tensors) -> None:
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)


def _unmarked(*tensors) -> None:
    pass


def _spec_identity(spec: LinearSpec):
    if spec.module is not None:
        return ("module", id(spec.module))
    bias = None if spec.bias is None else spec.bias.data_ptr()
    loras = tuple((a.data_ptr(), b.data_ptr(), a.dtype, b.dtype, scale) for a, b, scale in spec.loras)
    return (spec.weight.data_ptr(), spec.weight.dtype, bias, loras)


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
    if mask is None:  # no padding: plain causal attention, query head h reading kv head h // group
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=decoder.scaling, enable_gqa=True)
    else:
        if heads != kv_heads:  # query head h reads kv head h // group, as transformers' repeat_kv
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=decoder.scaling)
    return out.transpose(1, 2).reshape(batch * length, heads * dim)


def decode_attention(
    decoder: Decoder, cache, layer: int, column: torch.Tensor, q, k, v, mask, kernel=None, starts=None
):
    """One new token per sequence: write its K/V at `column`, attend over the cache row's live columns.

    q [B, heads, D], k/v [B, kv_heads, D], mask [B, 1, 1, S] additive. `kernel` (attention_kernel.decode_attention)
    reads each row's columns [starts[b], column] directly; without it, SDPA with the mask, where the query heads that
    share a kv head are laid out as that head's queries ([B, kv_heads, group, D]), so nothing is repeated.
    """
    batch = q.shape[0]
    heads, kv_heads, dim = decoder.heads, decoder.kv_heads, decoder.head_dim
    if k is not None:  # else the fused q/k/v kernel has written them
        cache.write_column(layer, column, k, v)
    keys, values = cache.keys[layer], cache.values[layer]
    if kernel is not None:
        return kernel(q, keys, values, starts, column, decoder.scaling, layer).reshape(batch, heads * dim)
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, dim)
    if q.is_cuda:  # cuDNN's kernel, the default pick on Hopper, is slow for a handful of queries against a mask
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=decoder.scaling)
    else:
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=decoder.scaling)
    return out.reshape(batch, heads * dim)


def prefill_mask(real: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [b, 1, P, P]: causal over real (non-pad) keys. A pad query also sees itself, so that no row is
    all -inf (which gives NaN rows, and 0 * NaN would reach real tokens through the cache)."""
    length = real.shape[1]
    index = torch.arange(length, device=real.device)
    causal = index[None, :] <= index[:, None]  # [P(query), P(key)]
    allowed = (causal[None] & real[:, None, :]) | torch.eye(length, dtype=torch.bool, device=real.device)[None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=real.device)
    return mask.masked_fill_(~allowed, float("-inf"))[:, None]
