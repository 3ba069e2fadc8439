"""Sharded training on 2 CPU processes (gloo): FSDP2 and DeepSpeed ZeRO-3 through accelerate, slimrl's chunked step
(2 chunks inside a 2-step gradient accumulation) and its rollout engine over the gathered weights log the same curve
as TRL under the same config and seed (under FSDP2 also with TRL's generation path), with LoRA on the sharded base
and in full fine-tuning; the engine saw every
weight whole inside each rollout, and the weights were sharded again after it. Also: the checks before training for
a model that cannot be gathered, and the MLP tiles under DeepSpeed."""

from __future__ import annotations

import json

import pytest

from tests.distributed.launch import run_two_processes
from tests.trainers.test_grpo_train_parity import assert_same_curves


@pytest.mark.parametrize("mode, port, distributed_type", [("fsdp2", 29541, "DistributedType.FSDP"),
                                                          ("zero3", 29542, "DistributedType.DEEPSPEED")])  # fmt: skip
def test_two_process_sharded_training_matches_trl(tmp_path, mode, port, distributed_type):
    out = tmp_path / "logs.json"
    run_two_processes("tests.distributed.sharded_train", [mode, str(out)], port, timeout=900)
    logs = json.loads(out.read_text())
    assert logs["num_processes"] == 2 and logs["distributed_type"] == distributed_type
    if mode == "fsdp2":  # TRL's generation path with slimrl's chunked step (run under FSDP2 only: sharded_train.py)
        assert_same_curves(logs["trl"], logs["slimrl"])
    assert_same_curves(logs["trl"], logs["slimrl_engine"])
    assert_same_curves(logs["trl_full"], logs["slimrl_engine_full"])  # full fine-tuning, every weight sharded
    engine = logs["engine"]
    assert engine["backend"] == "engine" and engine["built"]
    # one gather per generation batch (here one per optimizer step: 3 steps), whole inside, sharded after
    assert engine["gathers"] == [{"whole_inside": True, "sharded_after": True}] * 3
    assert logs["engine_full_gathers"] == [{"whole_inside": True, "sharded_after": True}] * 3


def test_a_model_too_large_to_gather_is_refused_before_training(monkeypatch):
    from slimrl.distributed import sharded
    from slimrl.trainers.rollouts import engine_rollouts
    from tests.trainers.grpo_harness import build_trainer

    monkeypatch.setattr(engine_rollouts, "sharded_training", lambda accelerator: True)
    monkeypatch.setattr(engine_rollouts, "sharding", lambda accelerator: "zero3")
    monkeypatch.setattr(sharded, "device_memory_bytes", lambda device: 4096)
    refused = r"does not fit on one cpu device once gathered.*4 bits.*generation_backend='vllm'"
    with pytest.raises(ValueError, match=refused):
        build_trainer("slimrl", generation_backend="engine")
    # with the backend left to slimrl, the trainer generates through TRL's path instead (and says why)
    assert build_trainer("slimrl", generation_backend="auto").generation_backend == "transformers"


def test_fsdp1_is_refused_for_the_engine_by_name(monkeypatch):
    from slimrl.trainers.rollouts import engine_rollouts
    from tests.trainers.grpo_harness import build_trainer

    monkeypatch.setattr(engine_rollouts, "sharded_training", lambda accelerator: True)
    monkeypatch.setattr(engine_rollouts, "sharding", lambda accelerator: "fsdp1")
    with pytest.raises(ValueError, match="fsdp_version: 2"):
        build_trainer("slimrl", generation_backend="engine")


def test_the_gathered_size_counts_global_shapes_in_the_compute_dtype():
    import torch

    from slimrl.distributed.sharded import engine_fit_problem, gathered_bytes, training_share_bytes
    from slimrl.testing import tiny_model

    model = tiny_model("llama").float()
    numel = sum(p.numel() for p in model.parameters())
    assert gathered_bytes(model) == 4 * numel
    assert gathered_bytes(model, compute_bytes=2) == 2 * numel
    assert training_share_bytes(model, world_size=2) == 16 * numel // 2
    # a ZeRO-3 parameter holds no data between gathers; its size is its ds_numel
    first = next(model.parameters())
    first.ds_numel = first.numel()
    first.data = torch.empty(0)
    assert gathered_bytes(model) == 4 * numel
    assert engine_fit_problem(model, world_size=2, device=torch.device("cpu"), compute_bytes=None, seq_len=64) is None


def test_offload_settings_follow_who_reduces_the_gradients():
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from slimrl.trainers.common.chunked_trainer import offload_settings

    def accelerator(kind, stage=None, processes=2):
        return SimpleNamespace(distributed_type=kind, num_processes=processes, state=SimpleNamespace(
            deepspeed_plugin=SimpleNamespace(zero_stage=stage)))  # fmt: skip

    def settings(*args, **kwargs):
        chosen = offload_settings(accelerator(*args, **kwargs), 4096)
        return chosen.mlp_tile_tokens, chosen.weights_in_graph

    # DeepSpeed's hooks run inside the recompute and take a weight's gradient once per backward (ZeRO-2/3)
    assert settings(DistributedType.DEEPSPEED, 3) == (0, False)
    assert settings(DistributedType.DEEPSPEED, 2) == (0, False)
    assert "ZeRO-2" in offload_settings(accelerator(DistributedType.DEEPSPEED, 2), 4096).untiled_because
    assert settings(DistributedType.DEEPSPEED, 1) == (4096, False)
    assert settings(DistributedType.FSDP) == (4096, False)  # reduce-scatter once per layer, from the recompute
    # DDP and one process: the weights' gradients come back through the checkpoint node, once per backward, tiled
    for kind in (DistributedType.MULTI_GPU, DistributedType.MULTI_CPU, DistributedType.NO):
        assert settings(kind) == (4096, True)
    assert settings(DistributedType.MULTI_GPU, processes=1) == (4096, True)
    assert offload_settings(accelerator(DistributedType.MULTI_GPU), 0).untiled_because is None