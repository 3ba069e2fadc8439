"""The rollout device's engine process: its own copy of the model, sent once by the trainer, then only the adapter.

`serve(host, port)` is the process's entry point (the trainer starts it with torch.multiprocessing's spawn). It joins
the trainer's channel (transport.py), receives the model's description and every tensor of its state once, builds
the same peft model on its device with slimrl's RolloutEngine over it, and then answers messages until "stop":
  {"op": "adapter", "groups": [(dtype, numel), ...]}  then one flat tensor per group: the trainable tensors, in the
                                                      order of `spec["adapter_names"]`, copied in place
  {"op": "generate", "prompts", "params", "max_new_tokens"}  -> the engine's RolloutOutput
  {"op": "dump"}                                      -> the adapter as held, sent as the trainer sends it
  {"op": "stop"}
"""

from __future__ import annotations

import torch

from slimrl.distributed.transport import ENGINE_UP, Channel, engine_store


def adapter_groups(tensors: list[torch.Tensor]) -> list[tuple[torch.dtype, list[int]]]:
    """Indices of `tensors` by dtype, in first-seen order: each group travels as one flat tensor."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, tensor in enumerate(tensors):
        groups.setdefault(tensor.dtype, []).append(i)
    return list(groups.items())


def send_adapter(channel: Channel, tensors: list[torch.Tensor]) -> int:
    """The tensors as one flat tensor per dtype, behind a small header; returns the tensors' bytes."""
    groups = adapter_groups(tensors)
    channel.send_object({"op": "adapter", "groups": [(dtype, sum(tensors[i].numel() for i in idx))
                                                     for dtype, idx in groups]})  # fmt: skip
    sent = 0
    for _, idx in groups:
        flat = torch.cat([tensors[i].detach().reshape(-1).cpu() for i in idx])
        channel.send_tensor(flat)
        sent += flat.numel() * flat.element_size()
    return sent


def recv_adapter_into(channel: Channel, message: dict, tensors: list[torch.Tensor]) -> None:
    groups = adapter_groups(tensors)
    if [(dtype, sum(tensors[i].numel() for i in idx)) for dtype, idx in groups] != message["groups"]:
        raise RuntimeError(f"adapter layout mismatch: the trainer sends {message['groups']}")
    with torch.no_grad():
        for _, idx in groups:
            flat = channel.recv_tensor((sum(tensors[i].numel() for i in idx),), tensors[idx[0]].dtype)
            offset = 0
            for i in idx:
                n = tensors[i].numel()
                tensors[i].copy_(flat[offset : offset + n].view_as(tensors[i]))
                offset += n


def build_model(spec: dict, channel: Channel):
    """The trainer's model rebuilt from its config and peft config, its state received tensor by tensor."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    device = torch.device(spec["device"])
    with torch.device(device):  # built where it runs; every weight is then overwritten by the trainer's
        base = AutoModelForCausalLM.from_config(spec["config"], dtype=spec["dtype"])
    model = get_peft_model(base, spec["peft_config"])
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            shape, dtype = spec["state"][name]
            tensor.copy_(channel.recv_tensor(shape, dtype))
    if spec.get("generation_config") is not None:
        model.generation_config = spec["generation_config"]
    return model.to(device).eval()


def serve(host: str, port: int) -> None:
    from slimrl.rollout.engine import RolloutEngine

    store = engine_store(host, port)
    store.set(ENGINE_UP, "1")
    channel = Channel(store, rank=1)
    spec = channel.recv_object()
    if spec["device"].startswith("cuda"):
        torch.cuda.set_device(torch.device(spec["device"]))
    else:  # on the CPU the trainer computes at the same time: half the cores each, not both spinning on all of them
        torch.set_num_threads(max(1, torch.get_num_threads() // 2))
    model = build_model(spec, channel)
    named = dict(model.named_parameters())
    adapter = [named[name] for name in spec["adapter_names"]]
    engine = RolloutEngine(model, max_seq_len=spec["max_seq_len"], **spec["engine_options"])
    while True:
        message = channel.recv_object()
        op = message["op"]
        if op == "adapter":
            recv_adapter_into(channel, message, adapter)
        elif op == "generate":
            output = engine.generate(message["prompts"], message["params"], max_new_tokens=message["max_new_tokens"])
            engine.release()
            channel.send_object(output)
        elif op == "dump":
            send_adapter(channel, adapter)
        elif op == "stop":
            return
        else:
            raise RuntimeError(f"unknown message {op!r}")
