"""The in-process rollout engine over sharded training weights (FSDP2, DeepSpeed ZeRO-3).

Under FSDP2 and ZeRO-3 no rank holds a whole weight between gathers, and the engine reads whole tensors. Before each
rollout `whole_weights` gathers every parameter once (per rollout, so once per optimizer step or generation batch,
never per token) and gives the memory back when the rollout ends:
- FSDP2 (`fully_shard`, accelerate's `fsdp_version: 2`): every FSDP module is unsharded, so each module's parameters
  are the whole tensors (in FSDP's compute dtype) until they are resharded;
- ZeRO-3: every parameter is gathered by DeepSpeed, and ZeRO-3's per-module fetch/release hooks are lifted for the
  rollout (the engine calls a few modules itself, and those hooks would partition their weights again mid-rollout).

`check_engine_fits` runs before training: the gathered weights, this rank's share of the sharded training state and
one row of KV cache must fit in the device's memory, or the trainer says so and names the fixes.
"""

from __future__ import annotations

import contextlib
import os

import torch

GIB = 1024**3


def zero_stage(accelerator) -> int | None:
    """DeepSpeed's ZeRO stage where accelerate runs DeepSpeed, else None."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return None
    return getattr(getattr(accelerator.state, "deepspeed_plugin", None), "zero_stage", 0)


def sharding(accelerator) -> str | None:
    """"fsdp2", "fsdp1" or "zero3" where no rank holds the whole weights between gathers, else None."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        plugin = getattr(accelerator.state, "fsdp_plugin", None)
        return "fsdp2" if getattr(plugin, "fsdp_version", 1) == 2 else "fsdp1"
    return "zero3" if zero_stage(accelerator) == 3 else None


def sharded_training(accelerator) -> bool:
    """True under FSDP or DeepSpeed ZeRO-3."""
    return sharding(accelerator) is not None


@contextlib.contextmanager
def whole_weights(accelerator, wrapped_model):
    """Every parameter of the trainer's model whole on this rank for the duration (see the module's docstring);
    nothing to do without sharding. `wrapped_model`: the model as accelerate prepared it (the DeepSpeed engine under
    DeepSpeed, the FSDP2 module under FSDP2)."""
    kind = sharding(accelerator)
    if kind is None:
        yield
    elif kind == "fsdp2":
        from torch.distributed.fsdp import FSDPModule

        modules = [m for m in wrapped_model.modules() if isinstance(m, FSDPModule)]
        for module in modules:
            module.unshard()
        try:
            yield
        finally:
            for module in modules:
                module.reshard()
    elif kind == "zero3":
        import deepspeed
        from trl.models.utils import add_hooks, remove_hooks

        with deepspeed.zero.GatheredParameters(list(wrapped_model.parameters())):
            remove_hooks(wrapped_model)
            try:
                yield
            finally:
                add_hooks(wrapped_model)
    else:
        raise ValueError("slimrl's engine does not gather FSDP1's flat parameters: set fsdp_version: 2 in the "
                         "accelerate config (FSDP2), or use generation_backend='transformers'.")  # fmt: skip


def global_numel(parameter: torch.Tensor) -> int:
    """Elements of a parameter once gathered: a DTensor's global size, ZeRO-3's `ds_numel` (its data is empty between
    gathers), else its own."""
    return int(getattr(parameter, "ds_numel", 0) or parameter.numel())


def gathered_bytes(model: torch.nn.Module, compute_bytes: int | None = None) -> int:
    """Bytes of every weight once gathered: global sizes (DTensor shapes, ZeRO-3's `ds_numel`), floating-point ones
    in the compute dtype when mixed precision sets one (`compute_bytes`), others as stored."""
    total = 0
    for p in model.parameters():
        size = compute_bytes if compute_bytes and p.is_floating_point() else p.element_size()
        total += global_numel(p) * size
    return total


def training_share_bytes(model: torch.nn.Module, world_size: int) -> int:
    """This rank's share of the sharded training state: trainable weights with an fp32 copy, gradient and two Adam
    moments (16 bytes each), frozen ones as stored, all divided over the ranks."""
    total = 0
    for p in model.parameters():
        total += global_numel(p) * (16 if p.requires_grad else p.element_size())
    return total // max(world_size, 1)


def kv_row_bytes(config, seq_len: int, dtype_bytes: int = 2) -> int:
    """KV-cache bytes of one sequence of `seq_len` tokens."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * seq_len * dtype_bytes


def device_memory_bytes(device: torch.device) -> int:
    """Memory this process can have on `device`: the GPU's free memory plus what torch already holds there, or
    the host's available memory for the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device))
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def engine_fit_problem(model, *, world_size: int, device: torch.device, compute_bytes: int | None,
                       seq_len: int) -> str | None:  # fmt: skip
    """Why the gathered model will not fit on `device` beside this rank's training state, or None when it does."""
    from slimrl.models.unwrap import unwrap_model

    config = unwrap_model(model).config
    weights = gathered_bytes(model, compute_bytes)
    share = training_share_bytes(model, world_size)
    cache = kv_row_bytes(config, seq_len, compute_bytes or 2)
    available = device_memory_bytes(device)
    if weights + share + cache <= available:
        return None
    return (f"the model does not fit on one {device.type} device once gathered for slimrl's rollout engine: its whole "
            f"weights take {weights / GIB:.2f} GiB, this rank's share of the sharded training state about "
            f"{share / GIB:.2f} GiB and one row of KV cache {cache / GIB:.3f} GiB, against {available / GIB:.2f} GiB "
            "on the device. Fixes: train LoRA on the sharded base (FastLanguageModel.get_peft_model) so no gradient "
            "or optimizer state is kept for the base, load the base in 4 bits (load_in_4bit=True), shorten the rows "
            "(max_prompt_length, max_completion_length: a row's KV cache; more rows only split the rollout into "
            "waves), or generate with generation_backend='transformers' (TRL's path) or generation_backend='vllm' "
            "(TRL's vLLM backend)")  # fmt: skip
