"""Shared pieces of the model-loader tests: tiny checkpoints on disk (transformers, GGUF), prompts, greedy decoding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from slimrl.testing import tiny_model, tiny_tokenizer

# two prompts, the second left-padded with the tiny tokenizer's pad id 0
PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 11, 12, 13, 14]])
PROMPT_MASK = (PROMPT != 0).long()
CONTEXT = 256  # below the tiny configs' max_position_embeddings, so no context warning


def save_tiny(path: Path, arch: str = "llama", tokenizer=None, **overrides) -> Path:
    """A tiny model (seed 0) and the tiny tokenizer saved with save_pretrained, as a user's local checkpoint."""
    tiny_model(arch, **overrides).save_pretrained(path)
    (tokenizer if tokenizer is not None else tiny_tokenizer()).save_pretrained(path)
    return path


def greedy(model, new_tokens: int = 8) -> torch.Tensor:
    return model.generate(
        input_ids=PROMPT, attention_mask=PROMPT_MASK, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
    )


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=PROMPT, attention_mask=PROMPT_MASK).logits


# HF Llama parameter name -> llama.cpp tensor name
_GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def _rope_interleave(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows of each head with the two rotary halves interleaved; transformers undoes this on
    load, so the file must hold the interleaved order for the loaded model to equal the original."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, weight.shape[1]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(path: Path, model=None, tokenizer=None, chat_template: bool = True) -> Path:
    """Write a tiny Llama (fp32 tensors) with its byte-level tokenizer as a GGUF file, the way llama.cpp lays it out."""
    import gguf

    model = model if model is not None else tiny_model("llama")
    tokenizer = tokenizer if tokenizer is not None else tiny_tokenizer()
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)

    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    tokens = [token for token, _ in vocab] + [f"<unused{i}>" for i in range(config.vocab_size - len(vocab))]
    special = set(tokenizer.all_special_tokens) | {t for t in tokens if t.startswith("<|") or t.startswith("<unused")}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_scores([0.0] * len(tokens))  # no merges: a pure byte-level vocabulary
    writer.add_eos_token_id(tokenizer.eos_token_id)
    if chat_template:
        writer.add_chat_template(tokenizer.chat_template)

    state = model.state_dict()
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}  # fmt: skip
    for layer in range(config.num_hidden_layers):
        for hf_name, gguf_name in _GGUF_LAYER_NAMES.items():
            names[f"model.layers.{layer}.{hf_name}.weight"] = f"blk.{layer}.{gguf_name}.weight"
    for hf_name, gguf_name in names.items():
        tensor = state[hf_name].float().numpy()
        if ".attn_q." in gguf_name:
            tensor = _rope_interleave(tensor, config.num_attention_heads)
        elif ".attn_k." in gguf_name:
            tensor = _rope_interleave(tensor, config.num_key_value_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(tensor))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
