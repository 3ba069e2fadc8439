"""One optimizer step of slimrl's GRPO and DPO trainers on a fixed global batch, as `one_step(kind, world, rank)`; run
as a module on two ranks (launch.py, or torch.distributed.run; 2 CPU processes over gloo, DistributedDataParallel as HF
Trainer sets it up), each rank saves its trainable weights before and after the step to `<out>/<kind>-rank<R>.pt`. The
step runs slimrl's whole training path as on a GPU, minus the copies to pinned memory: offloaded checkpoints with the
MLP recomputed in tiles, two chunks per micro-batch (the first backpropagated under no_sync), SGD, fp32; the gradients
are recorded as the optimizer step reads them. HF Trainer wraps a PEFT model with find_unused_parameters=True, whose
graph search must see every weight. test_allreduce_once.py compares the ranks with each other and with `one_step(kind,
1, 0)` run in one process on the whole global batch."""

from __future__ import annotations

import sys
import warnings

import torch

from tests.trainers import dpo_harness, grpo_harness

TRAINERS = ("grpo", "dpo")
GLOBAL_ROWS = {"grpo": grpo_harness.BATCH, "dpo": 4}  # completions / preference pairs in the one optimizer step
STEP = dict(offload_checkpoints=True, gradient_checkpointing=True, num_chunks=2, mlp_tile_tokens=3, optim="sgd",
            learning_rate=0.5, max_steps=1, logging_steps=1, seed=3)  # fmt: skip


def trainable(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def record_local_losses(trainer) -> list[float]:
    """The losses compute_loss returns on this rank (HF logs their mean over the ranks)."""
    losses, compute_loss = [], trainer.compute_loss

    def recording(*args, **kwargs):
        loss = compute_loss(*args, **kwargs)
        losses.append(float(loss.detach()))
        return loss

    trainer.compute_loss = recording
    return losses


def record_step_grads(trainer) -> dict[str, torch.Tensor]:
    """The trainable weights' gradients as the optimizer step reads them (reduced, clipped), filled during train()."""
    from transformers import TrainerCallback

    grads = {}

    class GradientsAtStep(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad})

    trainer.add_callback(GradientsAtStep())
    return grads


def grpo_trainer(world: int, rank: int, output_dir: str):
    rows = GLOBAL_ROWS["grpo"] // world
    trainer = grpo_harness.build_trainer("slimrl", per_device_train_batch_size=rows, output_dir=output_dir, **STEP)
    batch = grpo_harness.generated_batch(seed=0)
    batch["num_items_in_batch"] = batch["completion_mask"].sum().float()  # TRL's: the global batch's tokens
    local = {k: v[rank * rows : (rank + 1) * rows] if torch.is_tensor(v) and v.dim() else v for k, v in batch.items()}
    # rollouts fixed (each rank its rows of the global batch): generation samples per rank, and the point here is
    # what happens to the gradients, from the loss to the optimizer step
    trainer._generate_and_score_completions = lambda generation_batch: dict(local)
    return trainer


def dpo_trainer(world: int, rank: int, output_dir: str):
    pairs = GLOBAL_ROWS["dpo"]
    dataset = dpo_harness.preference_dataset(pairs)
    return dpo_harness.build_trainer("slimrl", dataset=dataset, per_device_train_batch_size=pairs // world,
                                     output_dir=output_dir, **STEP)  # fmt: skip


def one_step(kind: str, world: int, rank: int, output_dir: str) -> dict:
    """Trainable weights before and after one optimizer step, the rank's own losses and the offload counters."""
    from slimrl.models.checkpointing import offload_state

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = {"grpo": grpo_trainer, "dpo": dpo_trainer}[kind](world, rank, output_dir)
        before = trainable(trainer.model)
        local_losses = record_local_losses(trainer)
        grads = record_step_grads(trainer)
        trainer.train()
    state = offload_state(trainer.model)
    return {
        "before": before,
        "after": trainable(trainer.model),
        "grads": grads,
        "local_losses": local_losses,
        "offloaded": state.offloaded,
        "split_recomputes": state.split_recomputes,
        "mlp_tile_tokens": state.mlp_tile_tokens,
        "num_processes": trainer.accelerator.num_processes,
        "ddp": type(trainer.model_wrapped).__name__,
    }


def main(out_dir: str) -> None:
    from accelerate import PartialState

    from tests.distributed.worker_exit import write_logs_and_exit

    state = PartialState(cpu=True)
    for kind in TRAINERS:
        result = one_step(kind, state.num_processes, state.process_index, f"{out_dir}/{kind}-out")
        torch.save(result, f"{out_dir}/{kind}-rank{state.process_index}.pt")
    write_logs_and_exit({"trainers": list(TRAINERS)}, f"{out_dir}/logs.json")


if __name__ == "__main__":
    main(sys.argv[1])
