"""The tokenizer as GGUF metadata: what llama.cpp (and transformers' GGUF loader) rebuild a tokenizer from.

A GGUF file carries no tokenizer.json. It lists the tokens by id, a type per token, the BPE merges, the special token
ids, whether BOS/EOS are added, the name of the rule that splits text before BPE ("pre") and the chat template, under
llama.cpp's key names. This module reads those from a fast (tokenizers-backed) Hugging Face tokenizer into plain
Python data; gguf_export.py writes them. Two tokenizer kinds are supported, the ones llama.cpp calls
  "gpt2":  byte-level BPE (Llama 3, Qwen2/3, SmolLM2, Mistral's Tekken), and
  "llama": SentencePiece-style BPE with byte fallback (Llama 2, Mistral 7B v0.1-v0.3).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

# The regexes that split text before BPE, as tokenizer.json files spell them, and llama.cpp's names for them.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # the same rule with single digits
SPLIT_NAMES = {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2"}
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a SentencePiece byte-fallback token


@dataclass
class GgufVocab:
    model: str  # llama.cpp's tokenizer kind: "gpt2" or "llama"
    pre: str  # llama.cpp's name for the pre-tokenizer
    tokens: list[str]
    token_types: list[str]  # names of gguf.TokenType: NORMAL, CONTROL, USER_DEFINED, UNKNOWN, UNUSED, BYTE
    scores: list[float]
    merges: list[str]  # "left right", best first
    special_ids: dict[str, int] = field(default_factory=dict)  # "bos" | "eos" | "unk" | "pad" -> token id
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool = False
    chat_template: str | dict | None = None


def gguf_vocab(tokenizer, vocab_size: int) -> GgufVocab:
    """The tokenizer's GGUF metadata, its token list padded to the model's `vocab_size` embedding rows.

    Raises ValueError, before anything is written, for a tokenizer llama.cpp cannot represent.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"GGUF export needs a fast tokenizer (tokenizers-backed); {type(tokenizer).__name__} is not. "
                         "Load it with AutoTokenizer.from_pretrained(..., use_fast=True).")  # fmt: skip
    spec = json.loads(backend.to_str())
    model = spec["model"]
    kind = _tokenizer_kind(spec)
    tokens = _token_list(tokenizer, vocab_size)
    token_types = _token_types(tokenizer, tokens, kind)
    # llama.cpp's SentencePiece tokenizer merges the pair whose result scores highest; SentencePiece numbers its pieces
    # best first, so minus the id keeps that order. Merges are written too, which transformers' loader prefers.
    scores = [-float(i) if kind_ == "NORMAL" else 0.0 for i, kind_ in enumerate(token_types)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    probe = tokenizer("a")["input_ids"]  # what encoding adds around text, seen rather than guessed from settings
    return GgufVocab(
        model=kind,
        pre=_pre_tokenizer_name(spec) if kind == "gpt2" else "default",
        tokens=tokens,
        token_types=token_types,
        scores=scores,
        merges=merges,
        special_ids=_special_ids(tokenizer),
        add_bos=bos is not None and len(probe) > 1 and probe[0] == bos,
        add_eos=eos is not None and len(probe) > 1 and probe[-1] == eos,
        add_space_prefix=kind == "llama" and _adds_space_prefix(spec),
        chat_template=getattr(tokenizer, "chat_template", None) or None,
    )


def _tokenizer_kind(spec: dict) -> str:
    model = spec["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"GGUF export supports BPE tokenizers (byte-level, or SentencePiece-style with byte "
                         f"fallback); this one is {model.get('type')}.")  # fmt: skip
    # ByteLevel first: every byte is then a token, so a byte_fallback flag beside it changes nothing (transformers
    # 5.17 sets it on the byte-level tokenizers it reads from GGUF files)
    if "ByteLevel" in json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")]):
        return "gpt2"
    if model.get("byte_fallback"):
        return "llama"
    raise ValueError("GGUF export supports byte-level BPE tokenizers and SentencePiece-style BPE with byte "
                     "fallback; this BPE tokenizer is neither (no ByteLevel pre-tokenizer or decoder, no "
                     "byte_fallback).")  # fmt: skip


def _token_list(tokenizer, vocab_size: int) -> list[str]:
    """Tokens by id; ids the tokenizer never produces (embedding rows past its vocabulary) get llama.cpp's filler."""
    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    top = max(by_id) + 1
    if top > vocab_size:
        raise ValueError(f"The tokenizer has ids up to {top - 1} but the model's embedding has {vocab_size} "
                         "rows; resize the embeddings (model.resize_token_embeddings(len(tokenizer))) before "
                         "exporting.")  # fmt: skip
    return [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]


def _token_types(tokenizer, tokens: list[str], kind: str) -> list[str]:
    added = getattr(tokenizer, "added_tokens_decoder", {})
    known = set(tokenizer.get_vocab())
    special = set(tokenizer.all_special_tokens) | {t.content for t in added.values() if t.special}
    unk = tokenizer.unk_token
    types = []
    for i, token in enumerate(tokens):
        if token not in known:
            types.append("UNUSED")
        elif token in special:
            types.append("UNKNOWN" if token == unk and kind == "llama" else "CONTROL")
        elif i in added:
            types.append("USER_DEFINED")  # an added token that is not special (e.g. <think>): matched whole
        elif kind == "llama" and BYTE_TOKEN.fullmatch(token):
            types.append("BYTE")
        else:
            types.append("NORMAL")
    return types


def _special_ids(tokenizer) -> dict[str, int]:
    ids = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "unk": tokenizer.unk_token_id,
           "pad": tokenizer.pad_token_id}  # fmt: skip
    return {name: int(i) for name, i in ids.items() if i is not None}


def _pre_tokenizer_name(spec: dict) -> str:
    """llama.cpp's name for how a byte-level tokenizer splits text before BPE; "default" with a warning if unknown."""
    steps = _flatten(spec.get("pre_tokenizer"))
    splits = [s["pattern"].get("Regex") for s in steps if s.get("type") == "Split"]
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    digits = [s for s in steps if s.get("type") == "Digits" and s.get("individual_digits")]
    if len(splits) == 1 and splits[0] in SPLIT_NAMES and len(steps) == 2 and byte_level:
        return SPLIT_NAMES[splits[0]]
    if not splits and byte_level and byte_level[0].get("use_regex", True):
        if len(steps) == 1:
            return "gpt2"  # GPT-2's own regex, which ByteLevel applies
        if len(steps) == 2 and digits:
            return "smollm"  # each digit apart, then GPT-2's regex
    if len(steps) == 1 and byte_level:
        return "default"  # no splitting rule beyond bytes; llama.cpp's default applies
    logger.warning("slimrl: llama.cpp has no name for this tokenizer's pre-tokenizer (%s); the GGUF says 'default' "
                   "and llama.cpp may split text differently from the Hugging Face tokenizer.", steps)  # fmt: skip
    return "default"


def _flatten(pre_tokenizer: dict | None) -> list[dict]:
    if pre_tokenizer is None:
        return []
    if pre_tokenizer.get("type") == "Sequence":
        return [step for inner in pre_tokenizer["pretokenizers"] for step in _flatten(inner)]
    return [pre_tokenizer]


def _adds_space_prefix(spec: dict) -> bool:
    """SentencePiece-style tokenizers put '▁' before the text either with a Metaspace pre-tokenizer or a Prepend
    normalizer (older tokenizer.json files)."""
    steps = _flatten(spec.get("pre_tokenizer"))
    if any(s.get("type") == "Metaspace" and s.get("prepend_scheme", "always") != "never" for s in steps):
        return True
    normalizer = spec.get("normalizer") or {}
    inner = normalizer.get("normalizers", [normalizer]) if normalizer.get("type") == "Sequence" else [normalizer]
    return any(n.get("type") == "Prepend" for n in inner)
