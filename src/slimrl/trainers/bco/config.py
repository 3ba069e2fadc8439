"""slimrl's BCOConfig: TRL 0.2x's BCO settings on top of TRL 1.16's KTOConfig (the unpaired-data machinery BCO runs
on: tokenisation, collation, reference model, precomputed reference log-probs), plus slimrl's fields (SlimFields).

TRL 0.2x's names and defaults: beta 0.1, max_length 1024, max_prompt_length, max_completion_length,
truncation_mode "keep_end", precompute_ref_log_probs, and the density-ratio matching (UDM) settings
prompt_sample_size 1024, min_density_ratio 0.5, max_density_ratio 10.0 (read only when the trainer is given an
`embedding_func` and an `embedding_tokenizer`: see udm.py). KTO's own knobs (loss_type, desirable_weight,
undesirable_weight) have no meaning for BCO and are refused when changed.
"""

from __future__ import annotations

from dataclasses import dataclass

from slimrl.trainers.common.slim_fields import SlimFields, setting
from slimrl.trainers.common.trl_originals import trl_original

# TRL's KTOConfig, also when slimrl's KTO is patched into trl before this module is imported
TRLKTOConfig = trl_original("trl", "KTOConfig")

TRUNCATION_MODES = ("keep_end", "keep_start")


@dataclass
class BCOConfig(SlimFields, TRLKTOConfig):
    """Configuration of slimrl's BCOTrainer. TRL 0.2x's BCOConfig fields; the rest are TRL 1.16's KTOConfig ones."""

    learning_rate: float = setting(5e-7, "The initial learning rate for AdamW (TRL 0.2x BCO examples' value).")
    train_sampling_strategy: str = setting(
        "random",
        "Sampler of the training dataloader: 'random', 'sequential' or 'group_by_length'. BCO builds no mismatched "
        "completions, so any order works.",
    )
    loss_type: str = setting("bco", "Fixed: BCO's loss, -log sigmoid(+-(r - delta)). Any other value is refused.")
    max_prompt_length: int | None = setting(
        None,
        "Longest prompt in tokens: a longer prompt is cut to this many (its last tokens with truncation_mode "
        "'keep_end', its first with 'keep_start') before max_length cuts the sequence from the right. None: no cut.",
    )
    max_completion_length: int | None = setting(
        None,
        "Longest completion in tokens: a longer completion keeps its first this many. None: only max_length applies.",
    )
    truncation_mode: str = setting("keep_end", "Which end of a prompt longer than max_prompt_length is kept.")
    prompt_sample_size: int = setting(
        1024,
        "Density-ratio matching (UDM, on when the trainer gets embedding_func and embedding_tokenizer): at most this "
        "many prompts per label of the train dataset, sampled with `seed`, fit the classifier telling thumbs-up "
        "prompts from thumbs-down ones.",
    )
    min_density_ratio: float = setting(
        0.5, "UDM: lower clamp of a thumbs-down example's loss weight, the estimated density ratio p / (1 - p)."
    )
    max_density_ratio: float = setting(10.0, "UDM: upper clamp of a thumbs-down example's loss weight.")

    def __post_init__(self):
        check_bco_fields(self)
        super().__post_init__()


def check_bco_fields(args) -> None:
    """BCO's own settings, and KTO's knobs that BCO has no use for, with the change to make."""
    if args.loss_type != "bco":
        raise ValueError(f"BCOConfig has one loss, 'bco'; got loss_type={args.loss_type!r}. Leave loss_type unset "
                         "(for KTO's losses use slimrl.KTOConfig and slimrl.KTOTrainer).")  # fmt: skip
    for name in ("desirable_weight", "undesirable_weight"):
        if getattr(args, name) != 1.0:
            raise ValueError(f"{name}={getattr(args, name)} is a KTO setting; BCO weighs every example alike (TRL "
                             f"0.2x's BCO had no such weight). Leave {name} at 1.0.")  # fmt: skip
    if not args.beta > 0:
        raise ValueError(f"beta must be > 0 (the implicit reward is beta * log-ratio), got {args.beta}.")
    if args.truncation_mode not in TRUNCATION_MODES:
        raise ValueError(f"truncation_mode must be one of {', '.join(TRUNCATION_MODES)}, got {args.truncation_mode!r}.")
    for name in ("max_prompt_length", "max_completion_length"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"{name} must be a positive number of tokens or None, got {value}.")
    if args.prompt_sample_size < 1:
        raise ValueError(f"prompt_sample_size must be at least 1 prompt per label, got {args.prompt_sample_size}.")
    if not 0 < args.min_density_ratio <= args.max_density_ratio:
        raise ValueError("min_density_ratio must be > 0 and at most max_density_ratio, got "
                         f"{args.min_density_ratio} and {args.max_density_ratio}.")  # fmt: skip
