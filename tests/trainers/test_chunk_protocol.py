"""Every chunked trainer declares the chunk-plan protocol of trainers/common/chunked_trainer.py with its one signature
per method, and none rewrites the template that runs it."""

from __future__ import annotations

import inspect
import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import pytest

import slimrl
from slimrl.trainers.common.chunked_trainer import ChunkedTrainerMixin

TRAINERS = ["GRPOTrainer", "RLOOTrainer", "OnlineDPOTrainer", "PPOTrainer", "SFTTrainer", "DPOTrainer", "KTOTrainer",
            "ORPOTrainer", "CPOTrainer", "RewardTrainer", "DistillationTrainer", "BCOTrainer", "PRMTrainer",
            "XPOTrainer"]  # fmt: skip
DECLARED = ("_plan_micro_batch", "_chunk_loss", "_log_chunk_metrics", "_one_piece_reason")
TEMPLATE = ("_loss_in_chunks_or_one_piece", "_chunked_loss", "_run_chunks")
NO_ONE_PIECE_PATH = {"PPOTrainer"}  # slimrl's own loss: no TRL loss to fall back to


def positional(function) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(function).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("name", TRAINERS)
def test_the_trainer_declares_each_method_of_the_protocol_with_its_signature(name):
    trainer = getattr(slimrl, name)
    assert issubclass(trainer, ChunkedTrainerMixin)
    for method in DECLARED:
        if method == "_one_piece_reason" and name in NO_ONE_PIECE_PATH:
            continue
        declared, protocol = getattr(trainer, method), getattr(ChunkedTrainerMixin, method)
        assert declared is not protocol, f"{name} does not declare {method}"
        ours, theirs = positional(declared), positional(protocol)
        assert len(ours) == len(theirs), f"{name}.{method}{inspect.signature(declared)} is not the protocol's " \
                                         f"{method}{inspect.signature(protocol)}"  # fmt: skip
        for mine, wanted in zip(ours, theirs, strict=True):
            if wanted.name in ("mode", "num_items_in_batch", "return_outputs", "chunk", "totals", "model"):
                assert mine.name == wanted.name, f"{name}.{method}: parameter {mine.name!r} where the protocol has " \
                                                 f"{wanted.name!r}"  # fmt: skip


@pytest.mark.parametrize("name", TRAINERS)
def test_no_trainer_rewrites_the_template(name):
    trainer = getattr(slimrl, name)
    for method in TEMPLATE:
        assert getattr(trainer, method) is getattr(ChunkedTrainerMixin, method), f"{name} overrides {method}"
