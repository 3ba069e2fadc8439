"""Gradients are all-reduced exactly once under DDP: after one optimizer step of slimrl's GRPO and DPO trainers on 2 CPU
processes (gloo), both ranks hold the same gradients and trainable weights bit for bit, and the gradient the step
used equals (fp32) that of one process stepping on the whole global batch. A loss path that bypassed DDP (the
unwrapped model, a backward of its own) would leave each rank trained on its own half; one whose weights DDP's
reducer cannot see would raise "marked as ready twice", as the offloaded checkpoints did on two H100s (issue 29). See
allreduce_once.py for the step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.bench.test_scaling_smoke import free_port
from tests.distributed.allreduce_once import TRAINERS, one_step
from tests.distributed.launch import run_two_processes
from tests.tolerances import assert_close


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("allreduce")
    run_two_processes("tests.distributed.allreduce_once", [str(out)], free_port(), timeout=600)
    assert json.loads((out / "logs.json").read_text())["num_processes"] == 2
    return out


@pytest.mark.parametrize("kind", TRAINERS)
def test_ranks_step_identically_and_as_one_process_on_the_global_batch(kind, two_ranks, tmp_path):
    ranks = [torch.load(two_ranks / f"{kind}-rank{r}.pt") for r in range(2)]
    for rank in ranks:  # slimrl's offloaded, tiled, chunked path ran under HF's DDP on each rank
        assert rank["num_processes"] == 2 and rank["ddp"] == "DistributedDataParallel"
        assert rank["offloaded"] > 0 and rank["split_recomputes"] > 0 and rank["mlp_tile_tokens"] == 3
    assert ranks[0]["local_losses"] != ranks[1]["local_losses"], "the ranks saw the same rows: nothing to reduce"
    names = list(ranks[0]["after"])
    assert names and names == list(ranks[1]["after"]) == list(ranks[0]["grads"])
    for name in names:
        assert torch.equal(ranks[0]["before"][name], ranks[1]["before"][name])
        assert torch.equal(ranks[0]["grads"][name], ranks[1]["grads"][name]), f"{name}: the ranks' gradients differ"
        assert torch.equal(ranks[0]["after"][name], ranks[1]["after"][name]), f"{name}: the ranks' weights differ"

    single = one_step(kind, world=1, rank=0, output_dir=str(tmp_path / kind))
    assert single["offloaded"] > 0 and single["split_recomputes"] > 0
    for name in names:
        assert torch.equal(single["before"][name], ranks[0]["before"][name])
        expected = single["grads"][name]
        assert expected.abs().max() > 0, f"{name}: no gradient on one process, so the comparison proves nothing"
        scale = expected.abs().max()
        assert_close(ranks[0]["grads"][name] / scale, expected / scale, "grad_fp32", name=f"{kind}: gradient of {name}")
