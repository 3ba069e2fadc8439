"""What GRPOTrainer checks at construction that TRL lets through: the context length (the dataset's columns are checked
in common/dataset_checks.py, shared by the online trainers; which batches are multimodal, in common/batches.py)."""

from __future__ import annotations

import warnings


def check_context_length(model, max_completion_length: int | None) -> None:
    """An error when the completions cannot fit the context slimrl was told to size for (FastLanguageModel's
    max_seq_length: the engine's cache and RoPE tables end there); a warning when they only pass the model's
    max_position_embeddings, which transformers' RoPE runs past as TRL does, at a quality the model was not trained
    for."""
    if max_completion_length is None:
        return
    limit = getattr(getattr(model, "slimrl_options", None), "max_seq_length", None)
    message = ("max_completion_length={} does not fit the model's context of {} tokens ({}) with any prompt. Lower "
               "max_completion_length below {} minus your longest prompt, or load the model with a larger "
               "max_seq_length.")  # fmt: skip
    if limit is not None:
        if max_completion_length >= limit:
            raise ValueError(message.format(max_completion_length, limit, "max_seq_length given to "
                                            "FastLanguageModel.from_pretrained", limit))  # fmt: skip
        return
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    limit = getattr(text_config, "max_position_embeddings", None)
    if limit is not None and max_completion_length >= limit:
        warnings.warn(message.format(max_completion_length, limit, "the model's max_position_embeddings", limit),
                      UserWarning, stacklevel=3)  # fmt: skip
