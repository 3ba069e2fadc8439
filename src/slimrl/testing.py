"""Tiny, offline building blocks for tests and benchmarks: a byte-level tokenizer and 2-layer models from configs.

Nothing here downloads anything. The tokenizer round-trips any text (bytes are the vocabulary), so reward functions
that parse completions work on tiny models exactly as on real ones.
"""

from __future__ import annotations

import torch

PAD, EOS, IM_START = "<|pad|>", "<|im_end|>", "<|im_start|>"
SPECIAL_TOKENS = [PAD, "<|endoftext|>", IM_START, EOS]

# ChatML, the template of SmolLM2 and Qwen2; `add_generation_prompt` opens the assistant turn.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_tokenizer():
    """A byte-level tokenizer of 260 tokens (256 bytes + 4 specials) with a ChatML chat template, left padding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, eos_token=EOS, bos_token=None, unk_token=None, padding_side="left"
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


TINY_VOCAB = 264  # 260 tokens rounded up, so the model has a few never-produced ids like real checkpoints


def tiny_config(arch: str = "llama", **overrides):
    """Config of a 2-layer, hidden-64 decoder of the given architecture ("llama" or "qwen2")."""
    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=3,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common)
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common)
    raise ValueError(f"unknown tiny architecture {arch!r}; use 'llama' or 'qwen2'")


def tiny_model(arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A randomly initialised tiny causal LM; the same seed gives the same weights."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    return model


def tiny_prompt_dataset(n: int = 16, conversational: bool = False):
    """A `datasets.Dataset` with a `prompt` column (and an `answer` column) of short arithmetic prompts."""
    from datasets import Dataset

    rows = []
    for i in range(n):
        a, b = i % 7 + 1, (3 * i) % 5 + 2
        text = f"What is {a}+{b}?"
        prompt = [{"role": "user", "content": text}] if conversational else text
        rows.append({"prompt": prompt, "answer": str(a + b)})
    return Dataset.from_list(rows)
