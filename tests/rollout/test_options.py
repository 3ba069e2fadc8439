"""EngineOptions: every flag decided by the device, errors that name the flag, tuned kernel settings as data."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from slimrl.rollout import fused_ops
from slimrl.rollout.engine import RolloutEngine
from slimrl.rollout.options import EngineOptions
from tests.rollout.helpers import KERNEL_DEVICE, build

DEVICE = torch.device(KERNEL_DEVICE)  # the Triton flags need CUDA, or the interpreter on a machine without it


def test_cpu_defaults_are_the_plain_eager_path():
    options = EngineOptions().resolve(torch.device("cpu"), torch.float32)
    assert (options.cuda_graphs, options.compile, options.tf32_adapters) == (False, False, False)
    assert not any((options.triton_lora, options.triton_attention, options.fused_decode, options.fused_sampling))
    assert options.kernel_choices is None and not options.deterministic


def test_impossible_settings_name_the_flag():
    with pytest.raises(ValueError, match="cuda_graphs and compile need the model on a CUDA device"):
        EngineOptions(cuda_graphs=True).resolve(torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="fused_decode=True needs triton_lora=True"):
        EngineOptions(fused_decode=True, triton_lora=False).resolve(DEVICE, torch.float32)
    with pytest.raises(ValueError, match="attention_splits=0: give 1 ... 256"):
        EngineOptions(attention_splits=0).resolve(DEVICE, torch.float32)


def test_fused_decode_loads_the_tuned_settings_and_describe_reports_them():
    model = build("llama", hidden_size=64, num_attention_heads=2, num_key_value_heads=1).to(DEVICE)
    engine = RolloutEngine(model, triton_lora=True, fused_decode=True, deterministic=True)
    described = engine.describe()
    gpu = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else fused_ops.FALLBACK_GPU
    own = fused_ops.tuned_path(gpu)
    fallback = fused_ops.tuned_path(fused_ops.FALLBACK_GPU)
    assert described["choices_file"] == (own if own.is_file() else fallback).name
    assert described["kernel_choices"]["down@64"]["split_k"] == 4
    assert described["deterministic"] and described["head_dim"] == 32 and described["kv_cache_bytes"] == 0


def test_tuned_files_round_trip(tmp_path):  # (what each shipped file covers: the test below)
    choices, path = fused_ops.choices_for(torch.device("cpu"))
    copy = tmp_path / "GPU.json"
    fused_ops.save_choices(copy, choices, "GPU", written_by="test")
    assert fused_ops.load_choices(copy) == choices
    assert json.loads(copy.read_text())["written_by"] == "test"
    assert fused_ops.tuned_path("NVIDIA H100 80GB HBM3").name == path.name


def test_every_shipped_tuned_file_names_its_gpu_and_covers_every_group_and_bucket():
    """Each GPU's file (the H100's, the H200's, ...) is found under the name its own `gpu` field maps to, and holds a
    setting for every fused group at every row bucket, so no GPU falls back piecemeal."""
    files = sorted(fused_ops.TUNED.glob("*.json"))
    assert {f.name for f in files} >= {"NVIDIA_H100_80GB_HBM3.json", "NVIDIA_H200.json"}
    for path in files:
        assert fused_ops.tuned_path(json.loads(path.read_text())["gpu"]) == path, path.name
        choices = fused_ops.load_choices(path)
        assert set(choices) == set(fused_ops.GROUPS), path.name
        assert all(set(buckets) == set(fused_ops.ROW_BUCKETS) for buckets in choices.values()), path.name


def test_explicit_kernel_choices_replace_the_tuned_ones():
    choices, _ = fused_ops.choices_for(torch.device("cpu"))
    choices["o"][64] = dataclasses.replace(choices["o"][64], block_n=64)
    options = EngineOptions(triton_lora=True, fused_decode=True, kernel_choices=choices)
    resolved = options.resolve(DEVICE, torch.float32)
    assert resolved.kernel_choices["o"][64].block_n == 64 and resolved.choices_file is None
