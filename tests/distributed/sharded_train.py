"""Run by test_sharded_training.py on 2 ranks (launch.py; or torchrun) (CPU, gloo): TRL's and slimrl's GRPO trainers
under FSDP2 or DeepSpeed ZeRO-3 from the same seed; rank 0 writes the logs as JSON. slimrl runs its chunked step (2
chunks), once with TRL's transformers generation and once with its engine over the gathered weights.

usage: python -m tests.distributed.sharded_train {fsdp2|zero3} OUT.json
"""

import contextlib
import sys
import warnings

warnings.simplefilter("ignore")

from slimrl.distributed.sharded import global_numel  # noqa: E402
from tests.distributed.worker_exit import write_logs_and_exit  # noqa: E402
from tests.trainers.distributed_train import split_group_log, split_group_trainer  # noqa: E402

ZERO3 = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
         "gradient_accumulation_steps": "auto", "zero_allow_untested_optimizer": True}  # fmt: skip
FSDP2 = dict(fsdp="full_shard", fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})


def allow_fsdp_on_cpu() -> None:
    """accelerate turns FSDP on only for accelerator devices (its state keeps MULTI_CPU on a CPU run even with an
    FSDP plugin); torch's FSDP2 itself runs on the CPU over gloo. This makes accelerate's state FSDP when the trainer
    passes an FSDP plugin, so everything after it (accelerate's fully_shard preparation, the trainers) is the real
    FSDP2 path."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = init


def skip_deepspeed_shm_build() -> None:
    """DeepSpeed's CPU accelerator compiles its shared-memory all-reduce (the `deepspeed_shm_comm` extension: about
    three minutes of the 2-core CI machine, every run, as CI starts without a build cache) when its communication
    backend starts. Only `inference_all_reduce`, DeepSpeed inference's tensor parallelism, uses it; ZeRO-3's training
    collectives go through torch.distributed either way (and without it so does that one)."""
    import importlib

    # by module name: the attribute `deepspeed.comm.torch` is the torch package (deepspeed.comm re-exports it)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def full_tiny_model():
    """The tiny Llama without an adapter, the same weights each call."""
    import torch

    from slimrl.testing import tiny_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return tiny_model("llama")


def local_numel(parameter) -> int:
    """Elements this rank holds of a parameter right now (a DTensor's shard, ZeRO-3's gathered or empty data)."""
    to_local = getattr(parameter, "to_local", None)
    return (to_local() if to_local is not None else parameter.data).numel()


def watch_gathers() -> list[dict]:
    """Records, for every rollout of slimrl's engine, whether every weight was whole inside `whole_weights` and
    sharded again after it."""
    from slimrl.trainers.rollouts import engine_rollouts

    records: list[dict] = []
    original = engine_rollouts.whole_weights

    @contextlib.contextmanager
    def watched(accelerator, wrapped_model):
        # (FSDP2 swaps the module's registered parameters between sharded and whole: read them each time)
        with original(accelerator, wrapped_model):
            whole = all(local_numel(p) == global_numel(p) for p in wrapped_model.parameters())
            yield
        held = sum(local_numel(p) for p in wrapped_model.parameters())
        total = sum(global_numel(p) for p in wrapped_model.parameters())
        records.append({"whole_inside": whole, "sharded_after": held < total})
    engine_rollouts.whole_weights = watched
    return records


if __name__ == "__main__":
    mode, out_path = sys.argv[1], sys.argv[2]
    if mode == "fsdp2":
        allow_fsdp_on_cpu()
        config = dict(FSDP2)
    else:
        skip_deepspeed_shm_build()
        config = dict(deepspeed=ZERO3)
    config["gradient_accumulation_steps"] = 2  # the chunked step inside an accumulation (DeepSpeed's boundary)
    logs = {"trl": split_group_log("trl", **config)}
    if mode == "fsdp2":  # TRL's generation under sharding with slimrl's chunked step (ZeRO-3 runs the engine only: the
        # chunked step is the same, and each ZeRO-3 trainer pays DeepSpeed's start-up on this 2-core machine)
        logs["slimrl"] = split_group_log("slimrl", num_chunks=2, generation_backend="transformers", **config)
    gathers = watch_gathers()
    trainer = split_group_trainer("slimrl", num_chunks=2, generation_backend="engine", **config)
    logs["slimrl_engine"] = trainer.state.log_history
    logs["engine"] = {"backend": trainer.generation_backend, "built": trainer.rollout_engine is not None,
                      "gathers": list(gathers)}  # fmt: skip
    # full fine-tuning: every weight trained and sharded (no LoRA), engine on; beta 0 (a reference model would be
    # loaded by name, and the tiny model has none)
    logs["trl_full"] = split_group_log("trl", model=full_tiny_model(), beta=0.0, **config)
    logs["slimrl_engine_full"] = split_group_log("slimrl", model=full_tiny_model(), beta=0.0, num_chunks=2,
                                                 generation_backend="engine", **config)  # fmt: skip
    logs["engine_full_gathers"] = gathers[len(logs["engine"]["gathers"]):]
    write_logs_and_exit(logs, out_path)
