"""Builds TRL's and slimrl's DPO trainers on identical tiny models, a preference batch to feed both, the comparison
of one compute_loss + backward, and of a few steps of trainer.train().

Run as a module on two ranks (test_dpo_parity's DDP test, through launch.py; or under torch.distributed.run), it trains
both trainers with DDP on the CPU and writes rank 0's logs as JSON to the path given as its argument."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
import trl
from datasets import Dataset
from peft import LoraConfig

import slimrl
from slimrl.testing import tiny_model, tiny_tokenizer
from tests.trainers import step_compare

# Eight pairs of different lengths: an empty prompt (its first completion token has no label, so the shifted and
# unshifted completion masks differ), pairs whose rejected answer is the longer one, and lengths from 2 to 21 tokens.
PAIRS = [
    ("", "Hi there.", "Go."),
    ("2+2?", "4", "It is five."),
    ("Colour?", "Blue.", "7"),
    ("Yes?", "Yes.", "No."),
    ("Spell cat.", "C-A-T, cat.", "K."),
    ("Sky?", "Blue.", "Green."),
    ("Count.", "1 2 3", "1 3 2 5 4"),
    ("Paris?", "Yes.", "Lyon, or Nice."),
]
NUM_PAIRS = len(PAIRS)
LORA = dict(r=4, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)


def preference_dataset(n: int = NUM_PAIRS, conversational: bool = False) -> Dataset:
    rows = [PAIRS[i % NUM_PAIRS] for i in range(n)]
    if conversational:
        return Dataset.from_dict({
            "prompt": [[{"role": "user", "content": p}] for p, _, _ in rows],
            "chosen": [[{"role": "assistant", "content": c}] for _, c, _ in rows],
            "rejected": [[{"role": "assistant", "content": r}] for _, _, r in rows],
        })  # fmt: skip
    return Dataset.from_dict({"prompt": [p for p, _, _ in rows], "chosen": [c for _, c, _ in rows],
                              "rejected": [r for _, _, r in rows]})  # fmt: skip


def dpo_config(kind: str = "slimrl", **overrides):
    settings = dict(output_dir="/tmp/slimrl-test-dpo", per_device_train_batch_size=NUM_PAIRS, report_to="none",
                    save_strategy="no", bf16=False, use_cpu=True, disable_tqdm=True, beta=0.5)  # fmt: skip
    settings.update(overrides)
    if kind == "trl":
        settings.pop("num_chunks", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return (trl.DPOConfig if kind == "trl" else slimrl.DPOConfig)(**settings)


def build_trainer(kind: str, arch: str = "llama", reference: str = "disabled_adapter", dataset=None,
                  trainer_kwargs: dict | None = None, **config):  # fmt: skip
    """kind: "trl" (unpatched TRL) or "slimrl". reference: how the reference log-probs come about:
    "disabled_adapter" (a LoRA made by the trainer from peft_config), "ref_adapter" (a PeftModel given to the
    trainer: TRL copies its adapter as "ref"; the trained adapter is then moved off it), or "ref_model" (full
    fine-tuning against a separate reference model). Extra keyword arguments go to the config."""
    trainer_cls = trl.DPOTrainer if kind == "trl" else slimrl.DPOTrainer
    kwargs = dict(trainer_kwargs or {})
    if reference == "disabled_adapter":
        model = tiny_model(arch)
        kwargs.setdefault("peft_config", LoraConfig(**LORA))
    elif reference == "ref_adapter":
        from peft import get_peft_model

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            model = get_peft_model(tiny_model(arch), LoraConfig(**LORA))
    else:
        model, kwargs["ref_model"] = tiny_model(arch, seed=0), tiny_model(arch, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trainer_cls(model=model, args=dpo_config(kind, **config),
                              train_dataset=preference_dataset() if dataset is None else dataset,
                              processing_class=tiny_tokenizer(), **kwargs)  # fmt: skip
    if reference == "ref_adapter":  # the trained adapter starts away from its "ref" copy, so log-ratios are not 0
        generator = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, param in trainer.model.named_parameters():
                if ".default." in name:
                    param.add_(0.2 * torch.randn(param.shape, generator=generator))
    return trainer


def preference_batch(trainer, n: int = NUM_PAIRS, greedy_pairs: tuple[int, ...] = (1, 3)) -> dict:
    """A micro-batch of the trainer's first `n` pairs, collated by its own collator (right-padded rows). The chosen
    completions of `greedy_pairs` are replaced by the policy's own greedy tokens, so that some chosen tokens are the
    model's top-1 prediction and `mean_token_accuracy` is not trivially 0 for a random model."""
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(n)])
    model = trainer.model
    with torch.no_grad():
        for row in greedy_pairs:
            for column in batch["completion_mask"][row, 1:].nonzero().flatten().add(1).tolist():
                logits = model(input_ids=batch["input_ids"][row : row + 1, :column]).logits  # [1, column, V]
                batch["input_ids"][row, column] = logits[0, -1].argmax()
    return batch


loss_grads_metrics = step_compare.loss_grads_metrics  # divided for accumulation, as HF Trainer divides


def assert_same_step(expected, actual, label: str, train: bool = True) -> None:
    """Loss, every gradient (none of TRL's may be zero) and every metric, at the fp32 tolerances."""
    step_compare.assert_same_step(expected, actual, label, train, nonzero_reference=True)


TIMING = ("runtime", "per_second", "_time")  # logged values that measure time, not training


def train_log(kind: str, **config) -> list[dict]:
    """The logged entries of a few optimizer steps of trainer.train() (3 steps of 2 accumulated micro-batches of 2
    pairs unless `config` says otherwise), from a fixed seed."""
    settings = dict(dataset=preference_dataset(12), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    max_steps=3, logging_steps=1, learning_rate=5e-3, seed=7)  # fmt: skip
    settings.update(config)
    trainer = build_trainer(kind, **settings)
    trainer.train()
    assert not trainer.__dict__.get("_fallback_reasons_logged"), "slimrl's chunked path fell back to TRL's loss"
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def assert_same_curves(reference: list[dict], ours: list[dict], steps: int = 3) -> None:
    """Every logged value of every step, at rel 1e-4: the optimizer steps carry the first step's fp32
    summation-order difference forward."""
    assert len(ours) == len(reference) == steps
    losses = [entry["loss"] for entry in reference]
    assert len(set(losses)) == steps, f"the curve does not move: {losses}"
    for step, (expected, actual) in enumerate(zip(reference, ours, strict=True)):
        compared = [name for name in expected if not any(word in name for word in TIMING)]
        assert set(compared) <= set(actual), f"step {step}: missing {set(compared) - set(actual)}"
        for name in compared:
            assert actual[name] == pytest.approx(expected[name], rel=1e-4, abs=1e-6), f"step {step}: {name}"


if __name__ == "__main__":  # python -m torch.distributed.run --nproc_per_node 2 -m tests.trainers.dpo_harness OUT
    from tests.distributed.worker_exit import write_logs_and_exit

    warnings.simplefilter("ignore")
    config = dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.1], max_steps=2)
    logs = {"trl": train_log("trl", **config), "slimrl": train_log("slimrl", num_chunks=2, **config)}
    write_logs_and_exit(logs, sys.argv[1])
