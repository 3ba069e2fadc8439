"""Worker of test_ddp_tiles.py (2 ranks by launch.py or torch.distributed.run, CPU, gloo): one backward of a tiny Qwen2
with LoRA under DistributedDataParallel and slimrl's offloaded checkpointing, the MLP recomputed whole (tile 0) and in
tiles (tile 4 of 16 tokens), with DDP searching the graph for unused parameters (HF Trainer's choice for a PEFT model)
and without. Each rank also backpropagates an unwrapped copy on its own tokens; the mean of those gradients over the
ranks is what DDP must produce. Rank 0 writes per case: whether the backward ran, its error, and the largest difference
from that mean."""

from __future__ import annotations

import sys

import torch


def lora_model(tile: int):
    from peft import LoraConfig, get_peft_model

    from slimrl.models.checkpointing import enable_offloaded_checkpointing
    from slimrl.testing import tiny_model

    model = tiny_model("qwen2", seed=0)
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=4, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    with torch.no_grad():  # lora_B away from zero, so every adapter weight gets a gradient
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.02)
    model.train()
    enable_offloaded_checkpointing(model, tile, min_offload_bytes=0)
    return model


def lora_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for n, p in model.named_parameters() if p.requires_grad])


def main(out: str) -> None:
    import torch.distributed as dist
    from accelerate import PartialState
    from torch.nn.parallel import DistributedDataParallel

    from tests.distributed.worker_exit import write_logs_and_exit

    state = PartialState(cpu=True)
    ids = torch.randint(10, 200, (1, 16), generator=torch.Generator().manual_seed(state.process_index))
    logs = {}
    for tile in (0, 4):
        plain = lora_model(tile)
        plain(input_ids=ids, labels=ids).loss.backward()
        expected = lora_grads(plain)
        dist.all_reduce(expected)
        expected /= state.num_processes
        for find_unused in (True, False):
            case = f"tile={tile},find_unused={find_unused}"
            wrapped = DistributedDataParallel(lora_model(tile), find_unused_parameters=find_unused)
            try:
                wrapped(input_ids=ids, labels=ids).loss.backward()
            except RuntimeError as error:
                logs[case] = {"ran": False, "error": str(error)[:400]}
                break  # a reducer that raised is left half-way through its buckets
            difference = (lora_grads(wrapped.module) - expected).abs().max().item()
            logs[case] = {"ran": True, "max_abs_difference": difference, "scale": expected.abs().max().item()}
    # why slimrl refuses ddp_static_graph=True: the chunked step's inner chunks are backpropagated under no_sync, and
    # DDP's static graph fails on such a pass (slim_fields.check_slim_fields)
    static = DistributedDataParallel(lora_model(0), static_graph=True)
    try:
        with static.no_sync():
            static(input_ids=ids, labels=ids).loss.backward()
        static(input_ids=ids, labels=ids).loss.backward()
        logs["static_graph_after_no_sync"] = {"ran": True}
    except RuntimeError as error:
        logs["static_graph_after_no_sync"] = {"ran": False, "error": str(error)[:400]}
    write_logs_and_exit(logs, out)


if __name__ == "__main__":
    main(sys.argv[1])
