"""Worker of test_one_gpu_ddp.py: slimrl's GRPO trainer with two processes on one GPU over gloo, its CUDA path fully on.

Two-GPU machines are lent only at times, and NCCL refuses two ranks on one GPU, so the ranks share cuda:0 and talk
over gloo (which reduces CUDA tensors through the host). Everything else is as on two GPUs: HF Trainer wraps the PEFT
model in DistributedDataParallel (find_unused_parameters=True, its choice for a PEFT model), each rank generates its
share of the prompts' groups with its own rollout engine (CUDA graphs, Triton kernels), and the step runs the
offloaded checkpoints (every checkpoint copied to pinned host memory on the side stream: min_offload_bytes 0), the MLP
recomputed in tiles, the layer passes replayed as CUDA graphs where their shapes repeat, the fused element-wise ops
(on every layer call: FUSED_MIN_TOKENS 1) and two chunks per micro-batch in bf16. Rank 0 writes what ran, the losses,
and whether the ranks' trainable weights are identical after training (all-gathered); a failure in training is
written with its traceback.

usage: python -m torch.distributed.run --nproc_per_node 2 -m tests.distributed.one_gpu_ddp OUT.json
"""

from __future__ import annotations

import os
import sys
import traceback

os.environ["LOCAL_RANK"] = "0"  # both ranks on cuda:0: accelerate and HF take the device from LOCAL_RANK

def length_reward(completions, **kwargs) -> list[float]:
    return [min(len(completion), 40) / 40 for completion in completions]


def count_calls(module, name: str, counts: dict) -> None:
    original = getattr(module, name)

    def counted(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return original(*args, **kwargs)

    setattr(module, name, counted)


def build_trainer(output_dir: str):
    import torch
    from peft import LoraConfig, get_peft_model

    import slimrl
    from slimrl.testing import tiny_model, tiny_prompt_dataset, tiny_tokenizer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
        model = get_peft_model(tiny_model("llama", dtype=torch.bfloat16), lora)
    args = slimrl.GRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=4, num_generations=4, max_completion_length=48,
        max_steps=3, logging_steps=1, learning_rate=1e-3, bf16=True, report_to="none", save_strategy="no",
        disable_tqdm=True, ddp_backend="gloo", gradient_checkpointing=True, num_chunks=2, mlp_tile_tokens=16,
        generation_backend="engine", seed=0,
    )  # fmt: skip
    return slimrl.GRPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=tiny_prompt_dataset(),
                              processing_class=tiny_tokenizer())  # fmt: skip


def main(out: str) -> None:
    import torch
    import torch.distributed as dist

    from slimrl.models import checkpointing, recompute
    from slimrl.rollout.engine import RolloutEngine
    from tests.distributed.worker_exit import write_logs_and_exit

    recompute.FUSED_MIN_TOKENS = 1
    calls: dict[str, int] = {}
    for name in ("mlp_forward", "norm_forward"):
        count_calls(recompute, name, calls)
    count_calls(RolloutEngine, "generate", calls)
    logs: dict = {}
    try:
        trainer = build_trainer(f"/tmp/one_gpu_ddp_{os.environ['RANK']}")
        state = checkpointing.offload_state(trainer.model)
        state.min_offload_bytes = 0
        trainer.train()
        logs.update(
            ran=True,
            device=str(trainer.accelerator.device),
            wrapper=type(trainer.model_wrapped).__name__,
            losses=[entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
            grad_norms=[entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry],
            offloaded=state.offloaded,
            side_streams=len(state.side),
            split_recomputes=state.split_recomputes,
            mlp_tile_tokens=state.mlp_tile_tokens,
            calls=calls,
            graphs={name: getattr(state.graphs, name, None) for name in ("captures", "replays", "failures")},
        )
        weights = torch.cat([p.detach().float().flatten() for p in trainer.model.parameters() if p.requires_grad])
        gathered = [torch.empty_like(weights) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, weights)
        logs["ranks_identical"] = all(torch.equal(gathered[0], other) for other in gathered[1:])
        logs["weights_numel"] = weights.numel()
    except Exception as error:  # the test reads the error; the other rank may be stuck in a collective
        logs.update(ran=False, error=f"{type(error).__name__}: {error}"[:2000])
        logs["traceback"] = traceback.format_exc()[-4000:]
        if dist.get_rank() == 0:
            import json

            with open(out, "w") as f:
                json.dump(logs, f)
        sys.stdout.flush()
        os._exit(1)
    write_logs_and_exit(logs, out)


if __name__ == "__main__":
    main(sys.argv[1])
