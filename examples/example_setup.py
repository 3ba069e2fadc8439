"""What the runnable examples share: the model they train and their `--smoke` flag. Each example imports it as a
sibling (`python examples/<file>.py` puts this folder on the path; tests/test_examples.py does the same).

    from example_setup import load_model, parse_with_smoke
"""

from __future__ import annotations

import argparse

import torch


def parse_with_smoke(parser: argparse.ArgumentParser, smoke_defaults: dict, argv=None) -> argparse.Namespace:
    """`parser`'s arguments; with --smoke, `smoke_defaults` replace the defaults, never the flags given."""
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**smoke_defaults)
        args = parser.parse_args(argv)
    return args


def load_model(smoke: bool, cuda: bool, seed: int, lora: bool = True):
    """The embedded SmolLM2-135M-Instruct, or with `smoke` slimrl.testing's tiny model; with a LoRA adapter (r=16,
    alpha 32) unless `lora` is False."""
    from slimrl import FastLanguageModel

    if smoke:
        from slimrl.testing import tiny_model, tiny_tokenizer

        model, tokenizer = tiny_model("llama", seed=seed), tiny_tokenizer()
    else:
        model, tokenizer = FastLanguageModel.from_pretrained("SmolLM2-135M-Instruct", max_seq_length=256,
                                                             dtype=None if cuda else torch.float32)  # fmt: skip
    if lora:
        model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, use_gradient_checkpointing=False,
                                                 random_state=seed)  # fmt: skip
    return model, tokenizer
