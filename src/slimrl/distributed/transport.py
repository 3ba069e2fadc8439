"""A two-process channel over torch.distributed for the rollout device: the trainer is rank 0, the engine process
rank 1, in process groups of their own (a `TCPStore` and groups built directly on it, so the trainer's own default
group, if accelerate made one, is left alone).

Python objects (requests, replies) are pickled into a uint8 tensor behind an int64 length and always travel over
gloo. Tensors (the model once, then the adapter) travel over gloo through host memory, or, once both ends call
`use_nccl` (trainer and engine on two different GPUs: `tensor_backend`), GPU to GPU over NCCL. NCCL refuses two
ranks on one GPU, so an engine beside training on the same GPU stays on gloo. Every send is matched by one recv on
the other side, in order; a side never sends while the other is blocked sending to it (the trainer always collects
a reply before it sends the next message).
"""

from __future__ import annotations

import datetime
import pickle
import time

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(minutes=30)  # a rollout of a large batch can take minutes; a dead peer fails then


def trainer_store(host: str = "127.0.0.1") -> dist.TCPStore:
    """The trainer's rendezvous store, on a free port (`store.port` is what the engine process connects to)."""
    return dist.TCPStore(host, 0, 2, True, wait_for_workers=False, timeout=TIMEOUT)


def engine_store(host: str, port: int) -> dist.TCPStore:
    return dist.TCPStore(host, port, 2, False, timeout=TIMEOUT)


ENGINE_UP = "slimrl/engine_up"  # set by the engine process once it has reached the store


def wait_for_engine(store: dist.TCPStore, process, poll_s: float = 0.2) -> None:
    """Block until the engine process has reached the store; if it exits first (a failed import, a bad device), say
    so at once instead of waiting out the channel's timeout."""
    deadline = time.monotonic() + TIMEOUT.total_seconds()
    while not store.check([ENGINE_UP]):
        if not process.is_alive():
            raise RuntimeError(f"The rollout device's engine process exited (code {process.exitcode}) before it "
                               "connected to the trainer; its traceback is printed above it. Fix what it names, "
                               "or train without generation_device.")  # fmt: skip
        if time.monotonic() > deadline:
            raise TimeoutError(f"The rollout device's engine process did not connect within {TIMEOUT}.")
        time.sleep(poll_s)


def tensor_backend(trainer_device: torch.device, engine_device: torch.device) -> str:
    """"nccl" when the trainer and the engine are on two different CUDA devices (and NCCL is built in), else "gloo"."""
    trainer_device, engine_device = torch.device(trainer_device), torch.device(engine_device)
    if trainer_device.type != "cuda" or engine_device.type != "cuda" or not dist.is_nccl_available():
        return "gloo"
    return "nccl" if (trainer_device.index or 0) != (engine_device.index or 0) else "gloo"


class Channel:
    """One end of the trainer <-> engine-process channel. Building it blocks until the other end builds its own."""

    def __init__(self, store: dist.TCPStore, rank: int):
        self.store = store
        self.rank, self.peer = rank, 1 - rank
        self.group = dist.ProcessGroupGloo(store, rank, 2, TIMEOUT)
        self.nccl, self.device = None, torch.device("cpu")  # where received tensors land
        self.bytes_sent = 0

    @property
    def backend(self) -> str:
        return "gloo" if self.nccl is None else "nccl"

    def use_nccl(self, device: torch.device) -> None:
        """From here on tensors go GPU to GPU over NCCL; this end's tensors live on `device` (this process's GPU).
        Both ends call it at the same point of the conversation."""
        torch.cuda.set_device(device)
        self.device = torch.device(device)
        self.nccl = dist.ProcessGroupNCCL(dist.PrefixStore("slimrl/nccl/", self.store), self.rank, 2)

    def send_tensor(self, tensor: torch.Tensor) -> None:
        if self.nccl is None:
            self._gloo_send(tensor)
            return
        tensor = tensor.detach().to(self.device).contiguous()
        self.nccl.send([tensor], self.peer, 0).wait()
        self.bytes_sent += tensor.numel() * tensor.element_size()

    def recv_tensor(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """The peer's next tensor: on this end's GPU over NCCL, else on the CPU."""
        if self.nccl is None:
            return self._gloo_recv(shape, dtype)
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        self.nccl.recv([tensor], self.peer, 0).wait()
        return tensor

    def _gloo_send(self, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().contiguous().cpu()
        self.group.send([tensor], self.peer, 0).wait()
        self.bytes_sent += tensor.numel() * tensor.element_size()

    def _gloo_recv(self, shape, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype)
        self.group.recv([tensor], self.peer, 0).wait()
        return tensor

    def send_object(self, obj) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self._gloo_send(torch.tensor([data.numel()], dtype=torch.int64))
        self._gloo_send(data)

    def recv_object(self):
        size = int(self._gloo_recv((1,), torch.int64).item())
        return pickle.loads(self._gloo_recv((size,), torch.uint8).numpy().tobytes())
