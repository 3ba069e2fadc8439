"""W2's other model shapes (issue 33), beside W1's: Gemma-3-1B's text model and Qwen3-30B-A3B's layer shape, with
random weights from a seed, bf16, LoRA r=64 on all linear layers as peft puts them; `common.model_for` picks one by
name. Each is built on its device in its dtype (no fp32 copy on the host: the MoE one holds 31 GB of weights), and
each has a --tiny version of the same family with the same features (sliding windows, experts) for CPU smoke runs.

Gemma-3-1B (google/gemma-3-1b-pt's config.json): vocab 262144, hidden 1152, intermediate 6912, 26 layers, 4 heads,
1 KV head, head_dim 256, query_pre_attn_scalar 256, sliding window 512 on five layers of every six (the sixth is
global), RoPE base 1e6 on global and 1e4 on sliding layers, no soft-capping (Gemma 3 has none: transformers'
Gemma3TextConfig defaults both caps to None), tied embeddings. At W2's 256 + 256 tokens the window spans the whole
sequence, so its sliding layers read as much cache as its global ones there.

Qwen3-MoE: Qwen3-30B-A3B's layers (hidden 2048, 32 heads, 4 KV heads, head_dim 128, 128 experts, 8 per token,
moe_intermediate_size 768, top-k probabilities renormalised, untied embeddings, vocab 151936), but 24 of its 48
layers (`QWEN3_MOE_LAYERS_OF_REAL_MODEL`): 24 layers are 15.6B parameters (31 GB in bf16) plus 2.0B of fp32 LoRA
(8 GB), which leaves room on an 80 GB H100 for TRL's generate (peft materialises every expert's LoRA delta per layer
and call) and a batch-256 KV cache; 48 layers would need about 77 GB (72 GiB) for weights and LoRA alone.

peft 0.21 on transformers 5.x turns "all-linear" on a Qwen3-MoE block into LoRA on the attention projections and,
through `target_parameters`, on the router weight (`mlp.gate.weight`) and the experts' 3-D `gate_up_proj` (rank
doubled: it is two projections) and `down_proj`; `lora_targets` reads what it did from the model, for the report.
"""

from __future__ import annotations

import re

from common import with_lora

GEMMA3_1B = dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                 num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                 sliding_window=512, max_position_embeddings=32768)  # fmt: skip
# the same features at CPU size: a window shorter than the smoke run's 64-token prompts, a sliding and a global layer
GEMMA3_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
                   max_position_embeddings=2048)  # fmt: skip
GEMMA3_LOCAL_PER_GLOBAL = 5  # five sliding layers, then a global one (sliding_window_pattern 6)

QWEN3_MOE_LAYERS_OF_REAL_MODEL = 48
QWEN3_MOE = dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                 moe_intermediate_size=768, intermediate_size=6144, max_position_embeddings=40960)  # fmt: skip
QWEN3_MOE_TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      intermediate_size=128, max_position_embeddings=2048)  # fmt: skip


def gemma3_config(tiny: bool = False, context: int = 32768):
    """Gemma-3-1B's text config (or the tiny one); `context`: the longest prompt + completion it must take."""
    from transformers import Gemma3TextConfig

    shape = dict(GEMMA3_TINY if tiny else GEMMA3_1B)
    shape["max_position_embeddings"] = max(shape["max_position_embeddings"], context)
    period = 2 if tiny else GEMMA3_LOCAL_PER_GLOBAL + 1
    layer_types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
                   for i in range(shape["num_hidden_layers"])]  # fmt: skip
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}  # fmt: skip
    # no soft-capping: Gemma 3 has none (said here, as the defaults could change)
    return Gemma3TextConfig(**shape, layer_types=layer_types, rope_parameters=rope, final_logit_softcapping=None,
                            attn_logit_softcapping=None, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                            tie_word_embeddings=True)  # fmt: skip


def qwen3_moe_config(tiny: bool = False, context: int = 32768):
    """Qwen3-30B-A3B's layer shape with 24 layers (see the module docstring), or the tiny one; every layer sparse."""
    from transformers import Qwen3MoeConfig

    shape = dict(QWEN3_MOE_TINY if tiny else QWEN3_MOE)
    shape["max_position_embeddings"] = max(shape["max_position_embeddings"], context)
    return Qwen3MoeConfig(**shape, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1e6,
                          tie_word_embeddings=False, rms_norm_eps=1e-6)  # fmt: skip


# Llama-3.1-8B (meta-llama/Llama-3.1-8B's config.json, its llama3 RoPE scaling included): issue 34's memory row at
# 8 completions of 20,480 tokens, the setting Unsloth publishes a figure for
LLAMA31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
                  tie_word_embeddings=False)  # fmt: skip
LLAMA_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
                  tie_word_embeddings=False)  # fmt: skip
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip


def llama8b_config(tiny: bool = False, context: int = 32768):
    """Llama-3.1-8B's config (or a tiny Llama with the same RoPE scaling)."""
    from transformers import LlamaConfig

    shape = dict(LLAMA_TINY if tiny else LLAMA31_8B)
    shape["max_position_embeddings"] = max(shape["max_position_embeddings"], context)
    return LlamaConfig(**shape, rope_parameters=dict(LLAMA3_ROPE))


CONFIGS = {"gemma3-1b": gemma3_config, "qwen3-moe": qwen3_moe_config, "llama8b": llama8b_config}


def build(name: str, tiny: bool = False, device: str = "cuda", dtype=None, seed: int = 0, context: int = 32768,
          lora_rank: int | None = 64, lora_b_std: float | None = None):  # fmt: skip
    """Model `name` of CONFIGS with random weights from `seed`, made in `dtype` (bf16 by default) on `device`, and
    unless lora_rank is None peft LoRA on all linear layers (as `common.with_lora`; r=8 at most when tiny), its
    adapter made on the device too; no EOS (completions run to full length), pad id 1 as W1's."""
    import torch
    from transformers import AutoModelForCausalLM

    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}: pick one of {', '.join(CONFIGS)} (or w1, through common.model_for)")
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(CONFIGS[name](tiny, context), dtype=dtype or torch.bfloat16)
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 1
        if lora_rank is None:
            return model
        return with_lora(model, min(lora_rank, 8) if tiny else lora_rank, seed, lora_b_std)


def lora_targets(model) -> dict[str, dict]:
    """Where peft put LoRA, by name inside a decoder layer ("self_attn.q_proj", "mlp.experts.gate_up_proj", ...): the
    layers that have it and its rank."""
    from peft.tuners.lora import LoraLayer

    found: dict[str, dict] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        where = re.sub(r"(\.base_layer)+", "", re.sub(r"^.*\.layers\.\d+\.", "", name))
        parameter = getattr(module, "parameter_name", None)  # a ParamWrapper holds LoRA on one parameter
        where = f"{where}.{parameter}" if parameter else where
        entry = found.setdefault(where, {"layers": 0, "rank": sorted(set(module.r.values()))})
        entry["layers"] += 1
    return dict(sorted(found.items()))


def expert_bytes(model) -> int:
    """Bytes of the experts' weights and their LoRA (a batch reads only the experts its tokens are routed to)."""
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if ".experts." in name)


def describe(name: str, model) -> dict:
    """What the report says about the model: its name, config summary, parameter counts and LoRA placement."""
    config = model.config
    keys = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "sliding_window", "query_pre_attn_scalar", "final_logit_softcapping",
            "attn_logit_softcapping", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
            "tie_word_embeddings", "rope_parameters")  # fmt: skip
    summary = {k: getattr(config, k) for k in keys if getattr(config, k, None) is not None}
    if summary.get("model_type") == "qwen2":  # W1: Qwen2's sliding_window is unused (use_sliding_window False)
        summary.pop("sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        summary["layer_types"] = {kind: types.count(kind) for kind in sorted(set(types))}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = dict(model.named_parameters())  # (a tied embedding once)
    lora = [p for n, p in params.items() if "lora_" in n]
    described = {"name": name, "architecture": type(base).__name__, "config": summary,
                 "parameters": sum(p.numel() for p in params.values()) - sum(p.numel() for p in lora),
                 "dtype": str(base.get_input_embeddings().weight.dtype).removeprefix("torch."),
                 "lora_parameters": sum(p.numel() for p in lora),
                 "lora_dtype": str(lora[0].dtype).removeprefix("torch.") if lora else None,
                 "lora_targets": lora_targets(model),
                 # what TRL's generate path runs through transformers (its defaults for this model)
                 "attn_implementation": getattr(config, "_attn_implementation", None)}  # fmt: skip
    if getattr(config, "num_experts", None):
        described["experts_implementation"] = getattr(config, "_experts_implementation", None)
    if name == "qwen3-moe":
        described["layers_of_real_model"] = QWEN3_MOE_LAYERS_OF_REAL_MODEL
    return described
