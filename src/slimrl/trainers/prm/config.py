"""slimrl's PRMConfig: transformers' TrainingArguments plus the process reward model's settings, with the names and
defaults of TRL's last PRMConfig (0.2x: max_length, max_prompt_length, max_completion_length, disable_dropout,
step_separator, train_on_last_step_only, dataset_num_proc) and slimrl's chunked-step fields (SlimFields)."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import TrainingArguments

from slimrl.trainers.common.slim_fields import SlimFields, bf16_supported, setting

LENGTH_FIELDS = ("max_length", "max_prompt_length", "max_completion_length")


@dataclass
class PRMConfig(SlimFields, TrainingArguments):
    """Configuration of slimrl's PRMTrainer. Fields after TrainingArguments' own; every one has its help text."""

    # -- TrainingArguments defaults changed as TRL's PRMConfig changed them --------------------------------------
    learning_rate: float = setting(1e-5, "The initial learning rate for AdamW.")
    logging_steps: float = setting(
        10,
        "Log every this many optimizer steps (an integer), or a fraction of the training steps (a float below 1)."
    )
    gradient_checkpointing: bool = setting(
        True,
        "Recompute each layer's activations in the backward pass instead of keeping them (less memory, more compute)."
    )
    bf16: bool | None = setting(
        None,
        "bf16 mixed precision. None: on where the GPU supports bf16 (unless fp16), else off."
    )

    # -- PRM ------------------------------------------------------------------------------------------------------
    max_length: int | None = setting(
        1024,
        "Most tokens of a tokenised row (prompt + steps); longer rows lose their end. None: no limit."
    )
    max_prompt_length: int | None = setting(
        512,
        "Most tokens of the prompt (its BOS included); a longer prompt keeps its last tokens. None: no limit."
    )
    max_completion_length: int | None = setting(
        None,
        "Most tokens of the completion (the steps, each followed by the separator, joined); a longer one loses its "
        "end, and with it the labels of the steps cut off. None: no limit."
    )
    disable_dropout: bool = setting(True, "Turn every dropout of the model off (p=0) before training.")
    step_separator: str = setting(
        "\n",
        "Text appended after each step; the step's label is placed on the separator's last token."
    )
    train_on_last_step_only: bool = setting(
        False,
        "Train on the label of each row's last step only (the other steps' separators carry no label). Evaluation "
        "still scores every step."
    )
    dataset_num_proc: int | None = setting(None, "Processes that tokenise the datasets (None: this one).")

    def __post_init__(self):
        self._check_prm_fields()
        if self.bf16 is None:
            self.bf16 = not self.fp16 and bf16_supported(self.use_cpu)
        super().__post_init__()

    def _check_prm_fields(self) -> None:
        for name in LENGTH_FIELDS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive number of tokens, or None for no limit; got {value!r}.")
        if not isinstance(self.step_separator, str) or not self.step_separator:
            raise ValueError(
                f"step_separator must be a non-empty string (each step's label sits on its last token), got "
                f"{self.step_separator!r}. TRL's default is '\\n'."
            )


__all__ = ["PRMConfig"]
