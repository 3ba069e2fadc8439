"""FastLanguageModel: load a causal LM and its tokenizer, add LoRA, switch between inference and training, save."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch

from slimrl.models import quantization
from slimrl.models.sources import resolve_source

logger = logging.getLogger(__name__)

LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Unused special tokens that are safe padding, in order of preference (Llama 3, ChatML, Qwen, generic).
PAD_CANDIDATES = ("<|finetune_right_pad_id|>", "<|pad|>", "<pad>", "[PAD]", "<|fim_pad|>")
GRADIENT_CHECKPOINTING_CHOICES = (True, False, "offload")


@dataclass
class LoadOptions:
    """What `from_pretrained` was asked for; the trainers and the rollout engine read it from `model.slimrl_options`.

    `fast_inference`, `gpu_memory_utilization` and `max_lora_rank` are recorded for the rollout engine, which sizes
    its KV cache from them.
    """

    max_seq_length: int
    dtype: torch.dtype
    load_in_4bit: bool = False
    load_in_8bit: bool = False
    fast_inference: bool = False
    gpu_memory_utilization: float = 0.5
    max_lora_rank: int = 64
    gradient_checkpointing: bool | str = False  # set by get_peft_model, restored by for_training


def cuda_available() -> bool:
    return torch.cuda.is_available()


def bf16_supported() -> bool:
    return torch.cuda.is_bf16_supported()


def choose_dtype(dtype: torch.dtype | str | None = None) -> torch.dtype:
    """An explicit dtype is honoured; otherwise bf16 on GPUs that support it, fp16 on other GPUs, fp32 on CPU."""
    if dtype is not None:
        if isinstance(dtype, str):
            name = dtype.replace("torch.", "")
            aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
            resolved = getattr(torch, aliases.get(name, name), None)
            if not isinstance(resolved, torch.dtype):
                raise ValueError(f"Unknown dtype {dtype!r}; use 'bfloat16', 'float16' or 'float32'.")
            return resolved
        return dtype
    if cuda_available():
        return torch.bfloat16 if bf16_supported() else torch.float16
    return torch.float32


def ensure_pad_token(tokenizer, model=None) -> None:
    """Give the tokenizer a pad token that is not EOS (padding must never mask EOS in training); pad on the left."""
    eos = tokenizer.eos_token_id
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == eos:
        vocab = tokenizer.get_vocab()
        candidates = [tok for tok in PAD_CANDIDATES if tok in vocab and vocab[tok] != eos]
        if not candidates and tokenizer.unk_token is not None and tokenizer.unk_token_id != eos:
            candidates = [tokenizer.unk_token]
        if candidates:
            tokenizer.pad_token = candidates[0]
        else:
            tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
            if model is not None and len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
                model.resize_token_embeddings(len(tokenizer))
    tokenizer.padding_side = "left"
    if model is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.pad_token_id = tokenizer.pad_token_id


def find_lora_targets(model) -> list[str]:
    """Names of the Llama-style projections the model actually has; an error lists its Linear layers otherwise."""
    linear_names = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) or quantization.is_quantized_linear(module):
            linear_names.add(name.rsplit(".", 1)[-1])
    targets = [name for name in LLAMA_PROJECTIONS if name in linear_names]
    if not targets:
        raise ValueError(
            f"No Llama-style projections ({', '.join(LLAMA_PROJECTIONS)}) in this model; its Linear layers are "
            f"named {sorted(linear_names)}. Pass target_modules=[...] to get_peft_model."
        )
    return targets


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
        """Load `(model, tokenizer)` from a local directory, the local HF cache, a .gguf file, or the embedded
        default "SmolLM2-135M-Instruct". Nothing is downloaded."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1].")
        dtype = choose_dtype(dtype)
        quant_config = quantization.quantization_config(load_in_4bit, load_in_8bit, compute_dtype=dtype)
        if quant_config is not None and not cuda_available():
            logger.warning("slimrl: %s-bit weights on the CPU run bitsandbytes' CPU kernels (slow; for testing).",
                           4 if load_in_4bit else 8)  # fmt: skip
        source = resolve_source(model_name)
        if device_map is None:
            device_map = {"": "cuda"} if cuda_available() else {"": "cpu"}
        model = AutoModelForCausalLM.from_pretrained(
            source.path,
            dtype=dtype,
            device_map=device_map,
            quantization_config=quant_config,
            trust_remote_code=trust_remote_code,
            **source.from_pretrained_kwargs(),
            **kwargs,
        )
        tokenizer = AutoTokenizer.from_pretrained(
            source.path, trust_remote_code=trust_remote_code, **source.from_pretrained_kwargs()
        )
        if source.gguf_file is not None:
            _forget_gguf_quantization(model)
        ensure_pad_token(tokenizer, model)
        context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if context is not None and max_seq_length > context:
            warnings.warn(
                f"max_seq_length={max_seq_length} exceeds the model's max_position_embeddings={context}; slimrl does "
                "not extend RoPE, so quality beyond that length is not guaranteed.",
                UserWarning,
                stacklevel=2,
            )
        model.slimrl_options = LoadOptions(
            max_seq_length=max_seq_length,
            dtype=dtype,
            load_in_4bit=load_in_4bit,
            load_in_8bit=load_in_8bit,
            fast_inference=fast_inference,
            gpu_memory_utilization=gpu_memory_utilization,
            max_lora_rank=max_lora_rank,
        )
        model.slimrl_tokenizer = tokenizer
        return model, tokenizer

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
        """Add a LoRA adapter (peft) to `model`; `target_modules=None` means all seven Llama-style projections."""
        from peft import LoraConfig, PeftModel, get_peft_model

        if isinstance(model, PeftModel):
            raise ValueError("This model already has a LoRA adapter; call get_peft_model once per base model.")
        if use_gradient_checkpointing == "unsloth":
            use_gradient_checkpointing = "offload"  # Unsloth's name for the same idea
        if use_gradient_checkpointing not in GRADIENT_CHECKPOINTING_CHOICES:
            raise ValueError(f"use_gradient_checkpointing must be True, False or 'offload', got "
                             f"{use_gradient_checkpointing!r}.")  # fmt: skip
        if r > getattr(getattr(model, "slimrl_options", None), "max_lora_rank", r):
            raise ValueError(f"r={r} exceeds max_lora_rank={model.slimrl_options.max_lora_rank} given to "
                             "from_pretrained; raise max_lora_rank or lower r.")  # fmt: skip
        for param in model.parameters():  # the base stays frozen; only the adapter (and modules_to_save) train
            param.requires_grad_(False)
        config = LoraConfig(
            r=r,
            lora_alpha=lora_alpha,
            lora_dropout=lora_dropout,
            bias=bias,
            target_modules=target_modules if target_modules is not None else find_lora_targets(model),
            use_rslora=use_rslora,
            modules_to_save=modules_to_save,
            task_type="CAUSAL_LM",
            **kwargs,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(random_state)
            peft_model = get_peft_model(model, config)
        options = getattr(model, "slimrl_options", None)
        if options is not None:
            options.gradient_checkpointing = use_gradient_checkpointing
        else:
            model.slimrl_options = LoadOptions(
                max_seq_length=getattr(model.config, "max_position_embeddings", 2048),
                dtype=model.dtype,
                gradient_checkpointing=use_gradient_checkpointing,
            )
        _set_gradient_checkpointing(peft_model, use_gradient_checkpointing)
        peft_model.config.use_cache = not use_gradient_checkpointing
        from slimrl.models.saving import attach_save_methods

        attach_save_methods(peft_model)
        return peft_model

    @staticmethod
    def for_inference(model):
        """Eval mode, KV cache on, gradient checkpointing off, left padding. Cheap when already in that mode."""
        if getattr(model, "_slimrl_mode", None) == "inference":
            return model
        model.eval()
        model.config.use_cache = True
        if getattr(model, "is_gradient_checkpointing", False):
            model.gradient_checkpointing_disable()
        _set_padding_side(model, "left")
        model._slimrl_mode = "inference"
        return model

    @staticmethod
    def for_training(model):
        """Train mode, KV cache off, gradient checkpointing as get_peft_model was asked. Cheap when already there."""
        if getattr(model, "_slimrl_mode", None) == "training":
            return model
        model.train()
        options = getattr(model, "slimrl_options", None)
        checkpointing = getattr(options, "gradient_checkpointing", False)
        model.config.use_cache = not checkpointing
        _set_gradient_checkpointing(model, checkpointing)
        _set_padding_side(model, "left")  # GRPO/TRL pad prompts on the left in training too
        model._slimrl_mode = "training"
        return model

    @staticmethod
    def save_lora(model, tokenizer, path, overwrite: bool = False) -> str:
        from slimrl.models.saving import save_lora

        return save_lora(model, tokenizer, path, overwrite=overwrite)

    @staticmethod
    def save_merged(model, tokenizer, path, dtype: torch.dtype = torch.float16, overwrite: bool = False) -> str:
        from slimrl.models.saving import save_merged

        return save_merged(model, tokenizer, path, dtype=dtype, overwrite=overwrite)


def _forget_gguf_quantization(model) -> None:
    """transformers dequantises GGUF weights while loading but still marks the model as GGUF-quantised, which makes
    Trainer refuse to train it. The weights in memory are plain tensors, so the mark is dropped."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _set_gradient_checkpointing(model, mode: bool | str) -> None:
    if not mode:
        if getattr(model, "is_gradient_checkpointing", False):
            model.gradient_checkpointing_disable()
        return
    if mode == "offload":
        from slimrl.models.checkpointing import enable_offloaded_checkpointing

        enable_offloaded_checkpointing(model)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()  # checkpointed LoRA layers need a grad-requiring input


def _set_padding_side(model, side: str) -> None:
    tokenizer = getattr(model, "slimrl_tokenizer", None)
    if tokenizer is not None:
        tokenizer.padding_side = side
