"""GRPO's shared-prompt forward (trainers/common/shared_prompt.py, ops/shared_prompt_attention.py): the completions of
one prompt scored against one copy of its activations give the plain forward's log-probs, entropies and LoRA
gradients (fp32), through slimrl's offloaded checkpoints too; a GRPO step with it equals one without; where it cannot
run, the plain forward runs and the reason is logged once."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from peft import LoraConfig, get_peft_model
from trl.trainer.utils import add_fused_lm_head

import slimrl.trainers.grpo.trainer as grpo_trainer
from slimrl.models.checkpointing import enable_offloaded_checkpointing, offload_state
from slimrl.ops.shared_prompt_attention import ATTENTION_NAME, is_routed, routed_to_shared_prompt
from slimrl.testing import tiny_model
from slimrl.trainers.common.chunked_step import chunk_sequences
from slimrl.trainers.common.shared_prompt import (
    model_reason,
    pack_chunk,
    packed_logps_and_entropies,
    plan_shared_prompt,
    prompt_groups,
)
from tests.tolerances import assert_close
from tests.trainers.grpo_harness import build_trainer, generated_batch, loss_grads_metrics
from tests.trainers.step_compare import assert_logged_values_close, assert_same_step
from tests.trainers.trainer_cache import TrainerCache

ARCHS = [("llama", dict(num_key_value_heads=4)), ("qwen2", {})]  # qwen2: 4 query heads on 2 kv heads (GQA)
TEMPERATURE = 0.7


def lora_policy(arch: str, **overrides):
    """A tiny LoRA policy with TRL's fused LM head (log-probs and entropy at TEMPERATURE), as GRPO sets it up."""
    base = tiny_model(arch, **overrides)
    add_fused_lm_head(base, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                init_lora_weights=False))  # fmt: skip
    return model.train()


def grouped_batch(seed: int = 0) -> dict:
    """Three prompts of 6, 4 and 2 real tokens (left-padded to 6), their rows interleaved (0 0 1 1 1 2 2 0), and
    right-padded completions of 9, 3, 7, 1, 0, 5, 9 and 2 tokens."""
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(3, 6, dtype=torch.long)
    prompt_mask[1, :2], prompt_mask[2, :4] = 0, 0
    prompts = torch.randint(4, 260, (3, 6), generator=g) * prompt_mask
    rows = [0, 0, 1, 1, 1, 2, 2, 0]
    completion_mask = torch.zeros(8, 9, dtype=torch.long)
    for row, length in enumerate([9, 3, 7, 1, 0, 5, 9, 2]):
        completion_mask[row, :length] = 1
    return {"prompt_ids": prompts[rows], "prompt_mask": prompt_mask[rows],
            "completion_ids": torch.randint(4, 260, (8, 9), generator=g) * completion_mask,
            "completion_mask": completion_mask}  # fmt: skip


def plain_logps_and_entropies(model, inputs, chunk):
    """TRL's forward of a chunk (GRPOTrainer._get_per_token_logps_and_entropies): its rows, the fused head."""
    input_ids, attention_mask = chunk_sequences(inputs, chunk)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, : -chunk.width] = -100
    outputs = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
    return outputs.log_probs[:, -chunk.width :], outputs.entropy[:, -chunk.width :]


def scored(model, inputs, chunk, forward):
    """(log-probs, entropies, every LoRA gradient) of a token-weighted loss over the chunk's scores."""
    model.zero_grad(set_to_none=True)
    logps, entropies = forward(model, inputs, chunk)
    weights = torch.randn(logps.shape, generator=torch.Generator().manual_seed(3)).to(logps.device)
    mask = inputs["completion_mask"][chunk.rows, : chunk.width]
    ((logps * weights + 0.3 * entropies) * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logps.detach(), entropies.detach(), grads


def assert_same_scores(packed, plain, label: str) -> None:
    assert_close(packed[0], plain[0], name=f"{label}: logps")
    assert_close(packed[1], plain[1], name=f"{label}: entropies")
    assert packed[2].keys() == plain[2].keys() and plain[2]
    for name, grad in plain[2].items():
        scale = grad.abs().max().item()
        assert scale > 0, f"{label}: the plain gradient of {name} is zero"
        assert_close(packed[2][name] / scale, grad / scale, "grad_fp32", name=f"{label}: grad of {name}")


def packed_forward(model, inputs, chunk):
    return packed_logps_and_entropies(model, inputs, chunk, contextlib.nullcontext())


@pytest.mark.parametrize("arch,overrides", ARCHS, ids=[a for a, _ in ARCHS])
def test_packed_forward_equals_the_plain_forward(arch, overrides):
    model = lora_policy(arch, **overrides)
    inputs = grouped_batch()
    assert [rows.tolist() for rows in prompt_groups(inputs["prompt_ids"], inputs["prompt_mask"])] == [
        [0, 1, 7], [2, 3, 4], [5, 6]]  # fmt: skip
    for num_chunks in (1, 2):
        chunks = plan_shared_prompt(model, inputs, lambda units, n=num_chunks: n).chunks
        assert len(chunks) == num_chunks and sorted(torch.cat([c.rows for c in chunks]).tolist()) == list(range(8))
        for chunk in chunks:
            label = f"{arch}, {num_chunks} chunks, rows {chunk.rows.tolist()}"
            assert_same_scores(scored(model, inputs, chunk, packed_forward),
                               scored(model, inputs, chunk, plain_logps_and_entropies), label)  # fmt: skip
    assert model.config._attn_implementation == "sdpa" and not is_routed(model.config)


@pytest.mark.cuda
def test_on_cuda_in_bf16_the_segments_run_flash_attention():
    """On a GPU the segments' lower-right causal attention runs flash attention (no mask tensor; a boolean mask sent
    every call to the memory-efficient kernel), and the packed scores stay the plain forward's within bf16."""
    from torch.profiler import ProfilerActivity, profile

    from slimrl.ops.attention_backends import training_attention

    model = lora_policy("qwen2").to("cuda", torch.bfloat16)
    inputs = {k: v.cuda() for k, v in grouped_batch().items()}
    chunk = plan_shared_prompt(model, inputs, lambda units: 1).chunks[0]
    with training_attention():  # as the trainer's step runs it
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            packed = scored(model, inputs, chunk, packed_forward)
        plain = scored(model, inputs, chunk, plain_logps_and_entropies)
    kernels = [e.key for e in prof.key_averages()]
    # torch's own flash kernels are "pytorch_flash::..."; the memory-efficient ones "fmha_cutlassF/B..."
    assert any("pytorch_flash" in k for k in kernels) and not any("fmha_cutlass" in k for k in kernels), kernels
    mask = inputs["completion_mask"][chunk.rows].bool()
    assert_close(packed[0][mask].float(), plain[0][mask].float(), "bf16", name="logps")
    for name, grad in plain[2].items():
        scale = grad.abs().max().item()
        assert_close(packed[2][name].float() / scale, grad.float() / scale, "bf16_sum", name=f"grad of {name}")


def test_each_prompt_is_computed_once_per_group():
    """A chunk of the three groups packs 3 rows of 5 shared tokens + 3, 3 and 2 segments of the chunk's 9 columns:
    48 tokens against the plain forward's 8 rows x (6 + 9)."""
    inputs = grouped_batch()
    chunk = plan_shared_prompt(lora_policy("qwen2"), inputs, lambda units: 1).chunks[0]
    packed = pack_chunk(inputs, chunk)
    assert tuple(packed.input_ids.shape) == (3, 5 + 3 * 9)
    assert packed.layout.shared_starts == [0, 2, 4] and packed.layout.segments == [3, 3, 2]
    assert int((packed.shift_labels != -100).sum()) == int(inputs["completion_mask"].sum())  # every token scored once


def test_chunks_hold_whole_groups_and_auto_never_splits_one():
    """More chunks than groups: capped at one group a chunk; unless the count comes from the memory plan (auto), which
    then says a packed group does not fit, and the plain forward runs."""
    model, inputs = lora_policy("qwen2"), grouped_batch()
    chunks = plan_shared_prompt(model, inputs, lambda units: 5).chunks
    assert sorted(sorted(c.rows.tolist()) for c in chunks) == [[0, 1, 7], [2, 3, 4], [5, 6]]
    plan = plan_shared_prompt(model, inputs, lambda units: 5, memory_planned=True)
    assert plan.chunks is None and "never split" in plan.reason
    assert plan_shared_prompt(model, inputs, lambda units: 3, memory_planned=True).chunks is not None


def test_offloaded_checkpoints_recompute_the_packed_attention_in_backward():
    """slimrl's offloaded checkpoints (the CUDA default; plain copies on a CPU) recompute each layer in the backward:
    the attention stays routed while the packed graph lives, a plain forward meanwhile is SDPA's, and after the
    backward the model's attention is SDPA again."""
    model = lora_policy("qwen2")
    enable_offloaded_checkpointing(model, mlp_tile_tokens=16)
    inputs = grouped_batch(seed=1)
    chunk = plan_shared_prompt(model, inputs, lambda units: 1).chunks[0]
    plain = scored(model, inputs, chunk, plain_logps_and_entropies)
    with torch.no_grad():
        plain_again = plain_logps_and_entropies(model, inputs, chunk)[0]

    def packed_then_plain(model, inputs, chunk):
        logps, entropies = packed_forward(model, inputs, chunk)
        assert is_routed(model.config) and model.config._attn_implementation == ATTENTION_NAME
        with torch.no_grad():  # another forward while the packed graph waits for its backward
            assert_close(plain_logps_and_entropies(model, inputs, chunk)[0], plain_again, name="plain while routed")
        return logps, entropies

    recomputes = offload_state(model).split_recomputes
    assert_same_scores(scored(model, inputs, chunk, packed_then_plain), plain, "offloaded checkpoints")
    assert offload_state(model).split_recomputes == recomputes + model.config.num_hidden_layers
    assert not is_routed(model.config) and model.config._attn_implementation == "sdpa"


def test_a_forward_that_bypasses_the_packed_attention_is_an_error():
    model = lora_policy("llama")
    inputs = grouped_batch()
    packed = pack_chunk(inputs, plan_shared_prompt(model, inputs, lambda units: 1).chunks[0])
    with pytest.raises(RuntimeError, match="attention interface"):  # 2 layers ran, 3 were expected
        with torch.no_grad(), routed_to_shared_prompt(model.config, packed.layout, 3):
            model(input_ids=packed.input_ids, position_ids=packed.position_ids, shift_labels=packed.shift_labels,
                  fused_lm_head=True, shared_prompt_layout=packed.layout)  # fmt: skip
    del packed
    assert not is_routed(model.config)


# -- the trainer ------------------------------------------------------------------------------------------------------

_trainers = TrainerCache()
CONFIG = dict(loss_type="dapo", beta=0.04, entropy_coef=0.05, top_entropy_quantile=0.7, temperature=TEMPERATURE)


def trainer(shared: bool):
    if shared not in _trainers:
        _trainers[shared] = build_trainer("slimrl", shared_prompt_forward=shared, **CONFIG)
    return _trainers[shared]


def shared_prompt_batch() -> dict:
    """The harness's generated batch with two prompts of 3 and 4 real tokens over interleaved rows (0 2 5 7 and
    1 3 4 6): GRPO's groups of 4."""
    batch = generated_batch(old_logps=True, ref_logps=True)
    for rows, source in (([0, 2, 5, 7], 0), ([1, 3, 4, 6], 3)):
        batch["prompt_ids"][rows] = batch["prompt_ids"][source].clone()
        batch["prompt_mask"][rows] = batch["prompt_mask"][source].clone()
    return batch


def spy_on_packed_forward(monkeypatch) -> list:
    """The chunk of every packed forward the trainer runs, recorded as it runs."""
    chunks = []

    def spy(model, inputs, chunk, autocast):
        chunks.append(chunk)
        return packed_logps_and_entropies(model, inputs, chunk, autocast)

    monkeypatch.setattr(grpo_trainer, "packed_logps_and_entropies", spy)
    return chunks


@pytest.mark.parametrize("num_chunks", [1, 2])
def test_grpo_step_with_the_shared_prompt_equals_the_plain_step(num_chunks, monkeypatch):
    """Loss, every LoRA gradient and every logged metric, with the entropy bonus, the top-entropy mask (a
    gradient-free packed pass at 2 chunks) and the KL term."""
    calls = spy_on_packed_forward(monkeypatch)
    plain, shared = trainer(False), trainer(True)
    for t in (plain, shared):
        t.args.num_chunks = num_chunks
    batch = shared_prompt_batch()
    expected = loss_grads_metrics(plain, batch)
    actual = loss_grads_metrics(shared, batch)
    assert_same_step(expected, actual, f"shared prompt, num_chunks={num_chunks}", nonzero_reference=True)
    assert len(calls) == (1 if num_chunks == 1 else 4)  # the loss's chunks, at 2 also the top-entropy pass's
    assert all(len(chunk.groups) == 2 // num_chunks for chunk in calls)
    assert shared.shared_prompt_fallbacks == []


def test_fallback_logs_its_reason_once_and_runs_the_plain_forward(caplog, monkeypatch):
    monkeypatch.setattr(grpo_trainer, "packed_logps_and_entropies", None)  # the packed forward must not run
    plain, shared = trainer(False), trainer(True)
    batch = generated_batch(old_logps=True, ref_logps=True)  # every row has a prompt of its own
    with caplog.at_level(logging.WARNING, logger="slimrl.trainers"):
        for _ in range(2):
            actual = loss_grads_metrics(shared, batch)
    assert_same_step(loss_grads_metrics(plain, batch), actual, "fallback")
    lines = [r.getMessage() for r in caplog.records if "shared-prompt forward does not run" in r.getMessage()]
    assert len(lines) == 1 and "no two rows of the micro-batch share a prompt" in lines[0], lines
    assert shared.shared_prompt_fallbacks == [lines[0].split("because ")[1].split("; the plain")[0]]


def test_models_the_packed_forward_cannot_serve_are_named():
    assert "attn_implementation='eager'" in model_reason(tiny_model("llama", attn_implementation="eager"))
    assert "sliding-window" in model_reason(tiny_model("qwen2", use_sliding_window=True, sliding_window=4))
    assert "attention interface" in model_reason(torch.nn.Linear(2, 2))
    assert model_reason(lora_policy("qwen2")) is None


def digit_reward(completions, **kwargs):
    return [sum(ch.isdigit() for ch in text) / 4 - len(text) / 20 for text in completions]


def test_training_with_the_shared_prompt_logs_the_plain_runs_values(monkeypatch):
    """trainer.train(), offloaded checkpoints on: 2 steps from one generation of 4 prompts x 4, TRL's shuffled rows
    in micro-batches of 8 (partial groups), same seed; every logged value agrees with the plain forward's run."""
    chunks = spy_on_packed_forward(monkeypatch)

    def train_log(shared: bool) -> list[dict]:
        run = build_trainer("slimrl", shared_prompt_forward=shared, reward_funcs=digit_reward, max_steps=2,
                            logging_steps=1, learning_rate=5e-3, seed=7, steps_per_generation=2, loss_type="grpo",
                            offload_checkpoints=True, gradient_checkpointing=True, max_completion_length=6,
                            generation_kwargs={"sequence_bias": {(3,): 4.0}})  # fmt: skip
        run.train()
        assert run.shared_prompt_fallbacks == []
        return run.state.log_history

    timing = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second",
              "train_tokens_per_second", "peak_gpu_memory_GiB"}  # fmt: skip
    plain = train_log(False)
    assert not chunks and all(entry["grad_norm"] > 0 for entry in plain if "grad_norm" in entry)
    assert_logged_values_close(plain, train_log(True), timing)
    assert len(chunks) == 2 and all(len(chunk.groups) < 8 for chunk in chunks)  # one packed forward a micro-batch
