"""GGUF export (Unsloth's `model.save_pretrained_gguf`): the model, LoRA merged in, as one llama.cpp file.

The file holds the weights (f16, bf16 or q8_0), the architecture's hyperparameters and the tokenizer with its chat
template (gguf_tokenizer.py), under llama.cpp's names; llama.cpp, Ollama and transformers'
`from_pretrained(directory, gguf_file=...)` load it. The only module of slimrl that imports `gguf` (extra "gguf").

Written with care for what is already there: everything that can be refused (architecture, method, tokenizer, rope,
non-finite weights) is refused before a byte is written; the file is written under a temporary name beside the target
and renamed over it only when complete, so a failed export leaves an earlier one intact. The live model is not
touched: merged weights W + scale * B @ A are computed into a new fp32 state dict on the CPU (a 4/8-bit base weight
dequantised first, see saving.merged_state_dict), which costs 4 bytes of host memory per parameter while it runs.
"""

from __future__ import annotations

import logging
import os
import tempfile
from functools import partial
from pathlib import Path

import numpy as np
import torch

from slimrl.models.gguf_tokenizer import GgufVocab, gguf_vocab
from slimrl.models.saving import merged_state_dict
from slimrl.models.unwrap import hf_model
from slimrl.ops.finite import NonFiniteError, nonfinite_tensors

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'slimrl[gguf]'  (or: pip install gguf)"
# method -> (llama.cpp file type, tensor type of the 2-D weights)
METHODS = {"f16": ("MOSTLY_F16", "F16"), "bf16": ("MOSTLY_BF16", "BF16"), "q8_0": ("MOSTLY_Q8_0", "Q8_0")}
ALIASES = {"not_quantized": "f16", "fast_quantized": "q8_0"}  # Unsloth's names for the same files
# transformers model_type -> llama.cpp architecture. llama.cpp's own converter writes Mistral as "llama" (same layers;
# its sliding window is not stored), so transformers reads such a file back as a LlamaForCausalLM.
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
ROTARY_INTERLEAVED = {"llama"}  # architectures whose q/k rows llama.cpp stores with the rotary halves interleaved
ROPE_TYPES = ("default", "linear", "llama3")
GGUF_MAGIC = b"GGUF"


def require_gguf():
    """Import gguf, or fail with the install command."""
    try:
        import gguf
    except ImportError as error:
        raise ImportError(f"GGUF export needs the gguf package, which is not installed. Install it with: "
                          f"{INSTALL_HINT}") from error  # fmt: skip
    return gguf


def quantization_methods(quantization_method: str | list[str] | tuple[str, ...]) -> list[str]:
    """The requested methods in canonical names ("f16", "bf16", "q8_0"); an error names the supported ones."""
    requested = [quantization_method] if isinstance(quantization_method, str) else list(quantization_method)
    methods = []
    for method in requested:
        name = ALIASES.get(str(method).lower(), str(method).lower())
        if name not in METHODS:
            raise ValueError(f"quantization_method {method!r} is not supported; GGUF export writes {list(METHODS)} "
                             f"(Unsloth's aliases: {ALIASES}). For smaller k-quants (q4_k_m, ...) quantise the "
                             "f16 file with llama.cpp's llama-quantize.")  # fmt: skip
        methods.append(name)
    return list(dict.fromkeys(methods))


def gguf_architecture(config) -> str:
    """llama.cpp's architecture for a transformers config; refuses what this exporter cannot write faithfully."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ValueError(f"GGUF export supports Llama, Mistral, Qwen2 and Qwen3 models; this is {model_type!r} "
                         f"({(getattr(config, 'architectures', None) or ['?'])[0]}). Save it with "
                         "save_pretrained_merged and convert that with llama.cpp's convert_hf_to_gguf.py.")  # fmt: skip
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"llama.cpp runs {model_type} with SiLU; this model uses {config.hidden_act!r}.")
    rope_type = rope_parameters(config).get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"GGUF export writes RoPE of types {ROPE_TYPES}; this model uses {rope_type!r}. Save it with "
                         "save_pretrained_merged and convert that with llama.cpp's convert_hf_to_gguf.py.")  # fmt: skip
    return ARCHITECTURES[model_type]


def rope_parameters(config) -> dict:
    """RoPE settings under either transformers' 5.x name (rope_parameters) or 4.x's (rope_scaling, rope_theta)."""
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return rope


def gguf_file_name(method: str) -> str:
    return f"model.{METHODS[method][1]}.gguf"


def save_pretrained_gguf(
    model, save_directory, tokenizer=None, quantization_method: str | list[str] = "q8_0", overwrite: bool = False,
    push_to_hub: bool = False,
) -> str | list[str]:  # fmt: skip
    """Unsloth's `save_pretrained_gguf`: write `save_directory/model.<TYPE>.gguf`, LoRA merged in, and return its path
    (a list of paths when `quantization_method` is a list).

    quantization_method: "f16", "bf16" or "q8_0" (Unsloth's "not_quantized" and "fast_quantized" are read as f16 and
    q8_0). Works on a model with or without a LoRA adapter; a 4/8-bit base is dequantised before the merge. An earlier
    GGUF file of the same name is replaced; any other file there only with overwrite=True.
    """
    if push_to_hub:
        raise NotImplementedError("slimrl works offline and does not push to the hub; upload the saved file with "
                                  "huggingface_hub.upload_file where there is network.")  # fmt: skip
    methods = quantization_methods(quantization_method)
    config = hf_model(model).config.get_text_config()
    arch = gguf_architecture(config)
    if tokenizer is None:
        raise ValueError("save_pretrained_gguf needs the tokenizer: a GGUF file carries it (tokens, merges, chat "
                         "template). Pass the tokenizer from FastLanguageModel.from_pretrained.")  # fmt: skip
    gguf = require_gguf()
    vocab = gguf_vocab(tokenizer, config.vocab_size)
    directory = Path(save_directory).expanduser()
    targets = [directory / gguf_file_name(method) for method in methods]
    for target in targets:
        _check_target(target, overwrite)
    tensors = gguf_tensors(model, config, arch, gguf)
    directory.mkdir(parents=True, exist_ok=True)
    for method, target in zip(methods, targets, strict=True):
        _write_atomically(target, partial(_write_file, gguf, arch=arch, config=config, vocab=vocab, tensors=tensors,
                                          method=method))  # fmt: skip
        logger.info("slimrl: wrote %s (%.1f MiB)", target, target.stat().st_size / 2**20)
    paths = [str(target) for target in targets]
    return paths[0] if isinstance(quantization_method, str) else paths


def _check_target(target: Path, overwrite: bool) -> None:
    if target.parent.exists() and not target.parent.is_dir():
        raise FileExistsError(f"{target.parent} is a file; choose a directory to save the GGUF file into.")
    if target.is_dir():
        raise FileExistsError(f"{target} is a directory; remove it or choose another save directory.")
    if target.exists() and not overwrite:
        with open(target, "rb") as handle:
            if handle.read(4) != GGUF_MAGIC:
                raise FileExistsError(f"{target} exists and is not a GGUF file; pass overwrite=True to replace it or "
                                      "choose another directory.")  # fmt: skip


def _write_atomically(target: Path, write) -> None:
    """`write(path)` into a temporary sibling, renamed over `target` only once it returns."""
    handle, staging = tempfile.mkstemp(prefix=f".{target.name}.saving-", dir=target.parent)
    os.close(handle)
    try:
        write(staging)
        os.replace(staging, target)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


def gguf_tensors(model, config, arch: str, gguf) -> dict[str, np.ndarray]:
    """The merged fp32 weights under llama.cpp's tensor names, q/k rows in llama.cpp's order where it wants them."""
    with torch.no_grad():  # the LoRA delta is computed from trainable tensors; no graph is wanted
        state = merged_state_dict(model, torch.float32)
    bad = nonfinite_tensors(state)
    if bad:
        raise NonFiniteError(f"Refusing to export GGUF: these merged weights hold NaN or infinite values: "
                             f"{', '.join(bad)}. Resume from the last good checkpoint.")  # fmt: skip
    embed, head = state.get("model.embed_tokens.weight"), state.get("lm_head.weight")
    if head is not None and embed is not None and torch.equal(head, embed):
        del state["lm_head.weight"]  # tied: llama.cpp reads no output.weight as "use the embedding"
    arch_id = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    out, unplaced = {}, []
    for key, tensor in state.items():
        stem, _, suffix = key.rpartition(".")
        name = names.get_name(stem)
        if name is None:
            unplaced.append(key)
            continue
        if arch in ROTARY_INTERLEAVED and name.endswith((".attn_q", ".attn_k")):
            tensor = interleave_rotary_halves(tensor, heads if name.endswith(".attn_q") else kv_heads)
        out[f"{name}.{suffix}"] = tensor.numpy()
    if unplaced:
        raise ValueError(f"These weights have no place in a llama.cpp {arch!r} file: {unplaced[:5]}. Save the "
                         "model with save_pretrained_merged and convert it with llama.cpp's "
                         "convert_hf_to_gguf.py.")  # fmt: skip
    if rope_parameters(config)["rope_type"] == "llama3":
        out["rope_freqs.weight"] = llama3_rope_factors(config)
    return out


def interleave_rotary_halves(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's order for a llama-type q/k projection: per head, rows (i, i + d/2) of transformers' split-halves
    rotary layout become neighbours (2i, 2i + 1). transformers' GGUF loader undoes exactly this."""
    rows = weight.shape[0]
    halves = weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
    return halves.transpose(1, 2).reshape(weight.shape).contiguous()


def llama3_rope_factors(config) -> np.ndarray:
    """Llama 3's per-frequency RoPE divisors, which llama.cpp reads from a rope_freqs tensor: the ratio of plain
    inverse frequencies to the Llama-3-scaled ones transformers computes for this config."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = rope_parameters(config)
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    plain = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    return (plain / scaled.double()).float().numpy()


def _write_file(gguf, path: str, *, arch: str, config, vocab: GgufVocab, tensors: dict, method: str) -> None:
    writer = gguf.GGUFWriter(path, arch)
    try:
        _add_hyperparameters(writer, gguf, config, method)
        _add_tokenizer(writer, gguf, vocab)
        for name, array in tensors.items():
            data, raw_type = _encode(gguf, array, method, name)
            writer.add_tensor(name, data, raw_dtype=raw_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def _encode(gguf, array: np.ndarray, method: str, name: str):
    """(data, raw GGML type or None) for one tensor. Norms, biases and rope factors stay F32, as llama.cpp keeps
    them; q8_0 needs rows in blocks of 32, so a weight whose rows are not falls back to F16 as in llama.cpp."""
    types = gguf.GGMLQuantizationType
    if array.ndim == 1:
        return array.astype(np.float32), None
    wanted = types[METHODS[method][1]]
    block = gguf.GGML_QUANT_SIZES[wanted][0]
    if wanted == types.F16 or array.shape[-1] % block:
        if wanted != types.F16:
            logger.info("slimrl: %s has rows of %d, not a multiple of %d; stored as F16", name, array.shape[-1], block)
        return array.astype(np.float16), None
    return gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), wanted), wanted


def _add_hyperparameters(writer, gguf, config, method: str) -> None:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = rope_parameters(config)
    writer.add_name(_model_name(config))
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.num_key_value_heads or heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType[METHODS[method][0]])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    window = getattr(config, "sliding_window", None)
    if window and (getattr(config, "use_sliding_window", True)) and window < config.max_position_embeddings:
        logger.warning("slimrl: the GGUF file has no sliding window (llama.cpp runs %s with full attention); this "
                       "model was configured with a window of %d tokens.", config.model_type, window)  # fmt: skip


def _model_name(config) -> str:
    source = str(getattr(config, "_name_or_path", "") or "").rstrip("/")
    name = Path(source).name or config.model_type
    # transformers' GGUF loader reads a "llama" file named exactly "mistral" as Mistral, then finds no gguf-py
    # architecture of that name and fails; the capitalised name reads back as the (identical) Llama.
    return "Mistral" if name == "mistral" else name


def _add_tokenizer(writer, gguf, vocab: GgufVocab) -> None:
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types([gguf.TokenType[name] for name in vocab.token_types])
    writer.add_token_scores(vocab.scores)
    writer.add_token_merges(vocab.merges)  # nothing is written for a tokenizer without merges
    adders = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id, "unk": writer.add_unk_token_id,
              "pad": writer.add_pad_token_id}  # fmt: skip
    for name, token_id in vocab.special_ids.items():
        adders[name](token_id)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    writer.add_add_space_prefix(vocab.add_space_prefix)
    template = vocab.chat_template
    if isinstance(template, dict):  # several named templates: llama.cpp keeps "default" and names the rest
        template = [{"name": name, "template": text} for name, text in template.items()]
    if template:
        writer.add_chat_template(template)
