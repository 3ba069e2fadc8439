"""The parity tests' trainer cache survives another test resetting accelerate's global state in between."""

from __future__ import annotations

import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from transformers import TrainingArguments

from tests.trainers.paired_harness import build_trainer, collated_batch, loss_grads_metrics
from tests.trainers.trainer_cache import TrainerCache, accelerate_state_alive


def test_a_reset_between_tests_makes_the_cache_rebuild(tmp_path):
    cache = TrainerCache()
    cache["cpo"] = build_trainer("cpo", "trl", loss_type="sigmoid")
    assert "cpo" in cache and accelerate_state_alive()

    # What another test does on the same pytest worker: new arguments, their device read, no trainer built after.
    assert TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]).device.type == "cpu"
    assert not accelerate_state_alive()
    stale = dict.__getitem__(cache, "cpo")
    try:
        device = stale.accelerator.device
    except AttributeError as error:
        assert "_reset_state" in str(error)  # the failure CI met with a plain dict
    else:
        raise AssertionError(f"a reset left the stale trainer usable on {device}; the cache's premise no longer holds")

    assert "cpo" not in cache and len(cache) == 0
    cache["cpo"] = rebuilt = build_trainer("cpo", "trl", loss_type="sigmoid")
    loss = loss_grads_metrics(rebuilt, collated_batch(rebuilt))[0]
    assert loss.isfinite()
