"""The trainer's end of the rollout device: `RemoteRolloutEngine` starts the engine process (rollout_server.py) on
`generation_device`, sends it the model once, and then, whenever the trainer's optimizer has stepped since the last
rollout, only the trainable tensors (the LoRA adapter): megabytes, not the merged model.

It has the local engine's `generate(prompts, params, max_new_tokens)` and `release()`, plus `submit` / `collect`
for one request in flight, which is how `async_generation` overlaps the next step's rollout with this step's
training (trainers/rollouts/async_rollouts.py).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from slimrl.distributed.rollout_server import recv_adapter_into, send_adapter, serve
from slimrl.distributed.transport import Channel, tensor_backend, trainer_store, wait_for_engine


def check_generation_device(device: str, model, num_processes: int = 1, sharded: bool = False) -> torch.device:
    """The rollout device as a torch.device, or an error naming the fix: it must exist, the model must carry a LoRA
    adapter (the only tensors sent after each step), and there is one training process, unsharded."""
    try:
        parsed = torch.device(device)
    except RuntimeError as error:
        message = f"generation_device={device!r} is not a device ({error}); use e.g. 'cuda:1' or 'cpu'."
        raise ValueError(message) from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count()
        index = parsed.index if parsed.index is not None else 0
        if index >= count:
            raise ValueError(f"generation_device={device!r} does not exist: this machine has {count} CUDA "
                             "device(s). Name one of them, or leave generation_device unset to generate on the "
                             "training GPU.")  # fmt: skip
    elif parsed.type != "cpu":
        raise ValueError(f"generation_device={device!r}: the rollout process runs on 'cuda:N' or 'cpu'.")
    if not hasattr(model, "peft_config") or not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"generation_device={device!r} sends the engine process only the LoRA adapter after each "
                         "optimizer step, and this model has none: add one (FastLanguageModel.get_peft_model, or "
                         "peft_config=LoraConfig(...)), or leave generation_device unset to generate over the full "
                         "weights in the training process.")  # fmt: skip
    if num_processes > 1 or sharded:
        shards = " with sharded weights" if sharded else ""
        raise ValueError(f"generation_device={device!r} pairs one training process with one engine process, and "
                         f"this run has {num_processes} training process(es){shards}. "
                         "Launch one process (examples/accelerate/rollout_device.yaml), or leave generation_device "
                         "unset: then every rank generates with its own engine over its weights (ddp.yaml, "
                         "fsdp2.yaml, zero3.yaml).")  # fmt: skip
    return parsed


class RemoteRolloutEngine:
    """slimrl's rollout engine in its own process on `device`, fed the trainer's adapter after each optimizer step."""

    def __init__(self, model, device: str, max_seq_len: int | None = None, **engine_options):
        import torch.multiprocessing as mp

        self.device = check_generation_device(device, model)
        self.adapter_names = [name for name, param in model.named_parameters() if param.requires_grad]
        named = dict(model.named_parameters())
        self._adapter = [named[name] for name in self.adapter_names]
        store = trainer_store()
        self.process = mp.get_context("spawn").Process(target=serve, args=("127.0.0.1", store.port), daemon=True)
        self.process.start()
        wait_for_engine(store, self.process)
        self.channel = Channel(store, rank=0)
        self._send_model(model, max_seq_len, engine_options)
        self.synced_version = None  # the trainer's optimizer step whose adapter the engine holds
        self.sync_bytes: list[int] = []  # bytes of each adapter sync, in order
        self.model_bytes = self.channel.bytes_sent  # the one-time copy of the whole model
        self.pending = None  # the prompts of the request in flight, if any
        self.last_stats: dict = {}

    def _send_model(self, model, max_seq_len, engine_options) -> None:
        from slimrl.models.quantization import is_quantized_model

        state = model.state_dict()  # a bitsandbytes base: its packed weights and quantisation constants
        base = model.get_base_model()
        trainer_device = next(model.parameters()).device
        backend = tensor_backend(trainer_device, self.device)
        quantization = base.config.quantization_config if is_quantized_model(base) else None
        self.channel.send_object({
            "device": str(self.device), "config": base.config, "dtype": base.dtype, "model_class": type(base),
            "quantization": quantization.to_dict() if quantization is not None else None,
            "peft_configs": dict(model.peft_config), "active_adapter": model.active_adapter,
            "adapter_names": self.adapter_names,
            "generation_config": getattr(model, "generation_config", None),
            "state": {name: (tuple(t.shape), t.dtype) for name, t in state.items()},
            "max_seq_len": max_seq_len, "engine_options": engine_options,
            "tensor_backend": backend,
        })  # fmt: skip
        if backend == "nccl":  # both ends switch at this point of the conversation
            self.channel.use_nccl(trainer_device)
        for tensor in state.values():  # in state_dict order, which the engine process's copy shares
            self.channel.send_tensor(tensor)

    @contextlib.contextmanager
    def _talking(self, what: str):
        """A channel error while the engine process is dead is reported as its death, with what was under way."""
        try:
            yield
        except RuntimeError as error:
            self.process.join(timeout=5)  # a peer's closed socket can be seen a moment before its exit
            if self.process.is_alive():
                raise
            raise RuntimeError(f"The rollout device's engine process on {self.device} exited (code "
                               f"{self.process.exitcode}) while {what}; its traceback, if it raised, is printed "
                               "above. Fix what it names (an out-of-memory: fewer rows per rollout or a smaller "
                               "max_seq_length), or train without generation_device.") from error  # fmt: skip

    def sync(self, version) -> int:
        """Send the adapter unless the engine already holds `version`'s; returns the bytes sent."""
        if version == self.synced_version:
            return 0
        with self._talking("receiving the adapter"):
            sent = send_adapter(self.channel, self._adapter)
        self.synced_version = version
        self.sync_bytes.append(sent)
        return sent

    def submit(self, prompts: list[list[int]], params, max_new_tokens=None) -> None:
        if self.pending is not None:
            raise RuntimeError("a rollout request is already in flight; collect it first")
        prompts = [list(map(int, p)) for p in prompts]
        if params.seed is None:  # drawn here, from the trainer's seeded generator: the run reproduces
            params = dataclasses.replace(params, seed=int(torch.randint(0, 2**62, (1,)).item()))
        with self._talking("receiving a rollout request"):
            self.channel.send_object({"op": "generate", "prompts": prompts, "params": params,
                                      "max_new_tokens": max_new_tokens})  # fmt: skip
        self.pending, self._pending_version = prompts, self.synced_version

    def collect(self):
        """The in-flight request's RolloutOutput (blocks until the engine process has it); its stats say which
        adapter version generated it (`adapter_version`, the trainer's optimizer step at the last sync)."""
        if self.pending is None:
            raise RuntimeError("no rollout request in flight")
        with self._talking("generating a rollout"):
            output = self.channel.recv_object()
        self.pending = None
        if isinstance(output, dict) and "engine_error" in output:
            raise RuntimeError(f"The rollout device's engine raised while generating:\n{output['engine_error']}")
        output.stats["adapter_version"] = self._pending_version
        self.last_stats = output.stats
        return output

    def generate(self, prompts, params, max_new_tokens=None):
        self.submit(prompts, params, max_new_tokens)
        return self.collect()

    def release(self, keep_graph: bool = True) -> None:
        """Nothing to give back: the engine's memory is on its own device."""

    def adapter_held(self) -> list[torch.Tensor]:
        """The adapter's tensors as the engine process holds them now (a copy, for checks)."""
        held = [torch.empty_like(t, device="cpu") for t in self._adapter]
        self.channel.send_object({"op": "dump"})
        recv_adapter_into(self.channel, self.channel.recv_object(), held)
        return held

    def engine_facts(self) -> dict:
        """What the engine process holds: {"quantized": its base is 4/8-bit, "state_bytes": its model's state}."""
        if self.pending is not None:
            raise RuntimeError("a rollout request is in flight; collect it first")
        self.channel.send_object({"op": "describe"})
        return self.channel.recv_object()

    def close(self) -> None:
        if self.process.is_alive():
            if self.pending is not None:
                self.collect()
            self.channel.send_object({"op": "stop"})
            self.process.join(timeout=60)

    def describe(self) -> dict:
        return {"device": str(self.device), "process": self.process.pid, "transport": self.channel.backend,
                "model_bytes": self.model_bytes,
                "sync_bytes": self.sync_bytes[-1] if self.sync_bytes else 0, "syncs": len(self.sync_bytes)}  # fmt: skip
