"""The trainers' `fast_lora` setting (trainers/common/chunked_trainer.py): unset it stays off on the CPU; True switches
the model's LoRA layers to the fused functions, and a GRPO step then equals one through peft's forward (fp32); FSDP or
DeepSpeed refuse True with the reason (their per-module weight gathering would not see the fused reads)."""

import pytest
import torch

import slimrl.distributed.sharded as sharded
from slimrl.models.fast_lora import describe_fast_lora, is_fast_lora
from tests.trainers.grpo_harness import BATCH, build_trainer, generated_batch, loss_grads_metrics
from tests.trainers.step_compare import assert_same_step

CONFIG = dict(loss_type="dapo", beta=0.0, num_chunks=2)
# Part of the harness's batch: both left-padded prompts (their completions full-length), a 1-token and an empty
# completion, and the first 3 completion columns. The 2 chunks (rows grouped by completion length) get two rows each.
# On the CPU the fused attention's RoPE kernel runs in Triton's interpreter at a cost per token row: the whole batch
# (8 rows of up to 17 tokens) took about three times as long.
ROWS, COLUMNS = [0, 3, 4, 7], 3


def smaller(batch: dict) -> dict:
    small = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() and value.size(0) == BATCH:
            value = value[ROWS]
            if key not in ("prompt_ids", "prompt_mask") and value.dim() == 2:
                value = value[:, :COLUMNS]  # per-token tensors of the completions
        small[key] = value
    small["num_items_in_batch"] = small["completion_mask"].sum().float() * 2  # as the harness counts it
    return small


def test_unset_is_off_on_the_cpu():
    assert build_trainer("slimrl", **CONFIG).args.fast_lora is None
    assert not is_fast_lora(build_trainer("slimrl", **CONFIG).model)


def test_on_it_switches_the_layers_and_the_step_is_unchanged():
    plain, fast = build_trainer("slimrl", fast_lora=False, **CONFIG), build_trainer("slimrl", fast_lora=True, **CONFIG)
    assert not is_fast_lora(plain.model)
    switched = describe_fast_lora(fast.model)
    assert switched["mlp"] == 2 and switched["linear"] == 8, switched  # 2 layers: their MLPs and q, k, v, o
    batch = smaller(generated_batch(old_logps=True))
    assert_same_step(loss_grads_metrics(plain, batch), loss_grads_metrics(fast, batch), "fast LoRA",
                     nonzero_reference=True)  # fmt: skip


def test_sharded_training_refuses_it(monkeypatch):
    monkeypatch.setattr(sharded, "zero_stage", lambda accelerator: 3)
    with pytest.raises(ValueError, match="fast_lora=True cannot run under FSDP or DeepSpeed"):
        build_trainer("slimrl", fast_lora=True, **CONFIG)
