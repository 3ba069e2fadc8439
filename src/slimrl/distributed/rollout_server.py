"""The rollout device's engine process: its own copy of the model, sent once by the trainer, then only the adapter.

`serve(host, port)` is the process's entry point (the trainer starts it with torch.multiprocessing's spawn). It joins
the trainer's channel (transport.py), receives the model's description and every tensor of its state once, builds
the same peft model on its device with slimrl's RolloutEngine over it, and then answers messages until "stop" (or until
the trainer's end of the connection closes: one line on stderr, and the process ends).
The base is loaded from the received state by transformers' loader, as the trainer's was; a 4-bit or 8-bit base travels
as bitsandbytes serialises it (packed weights and quantisation constants) and is loaded back pre-quantised, so the
engine's base is the trainer's bit for bit and as small on its device. Messages:
  {"op": "adapter", "groups": [(dtype, numel), ...]}  then one flat tensor per group: the trainable tensors, in the
                                                      order of `spec["adapter_names"]`, copied in place
  {"op": "generate", "prompts", "params", "max_new_tokens"}  -> the engine's RolloutOutput, or {"engine_error":
                                                      its traceback} when generate raised (an out-of-memory too)
  {"op": "dump"}                                      -> the adapter as held, sent as the trainer sends it
  {"op": "describe"}                                  -> {"quantized", "state_bytes"} of the engine's model
  {"op": "stop"}
"""

from __future__ import annotations

import copy
import sys
import traceback

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
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx])  # the channel moves it (host or GPU)
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
    """The trainer's model rebuilt in this process: its state received tensor by tensor (in the trainer's
    state_dict order, as `spec["state"]` lists it), the base loaded from it by transformers' own loader (pre-quantised
    for a bitsandbytes base, whose config carries its quantisation), the same LoRA over it with the trainer's adapter
    tensors in the trainer's dtypes. Built as the trainer's was, so the two compute the same numbers."""
    from peft import get_peft_model

    from slimrl.models.quantization import keep_cpu_4bit_layout

    device = torch.device(spec["device"])
    state = {name: channel.recv_tensor(shape, dtype) for name, (shape, dtype) in spec["state"].items()}
    base_state, adapter_state = split_peft_state(state)
    config = copy.deepcopy(spec["config"])
    if spec.get("quantization") is not None:
        config.quantization_config = spec["quantization"]  # a dict, as a pre-quantised checkpoint's config has it
    base = spec["model_class"].from_pretrained(None, config=config, state_dict=base_state, dtype=spec["dtype"],
                                               device_map={"": device})  # fmt: skip
    keep_cpu_4bit_layout(base)  # as the trainer's loader does: the same bits on every CPU
    active = spec["active_adapter"]  # and every other adapter the trainer's model carries (TRL's "ref" one)
    model = get_peft_model(base, spec["peft_configs"][active], adapter_name=active)
    for name, adapter_config in spec["peft_configs"].items():
        if name != active:
            model.add_adapter(name, adapter_config)
    model.set_adapter(active)
    rebuilt = model.state_dict(keep_vars=True)
    if set(rebuilt) != set(state):
        raise RuntimeError("the rollout device rebuilt a model whose state differs from the trainer's: missing "
                           f"{sorted(set(state) - set(rebuilt))[:5]}, extra {sorted(set(rebuilt) - set(state))[:5]}")
    for name, tensor in adapter_state.items():  # in the trainer's dtype (peft may have made them fp32)
        rebuilt[name].data = tensor.to(rebuilt[name].device)
    if spec.get("generation_config") is not None:
        model.generation_config = spec["generation_config"]
    return model.eval()


# peft's names for what LoRA adds to a module (everything else of a wrapped module is its base layer's)
ADAPTER_PARTS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector.",
                 ".modules_to_save.")  # fmt: skip


def split_peft_state(state: dict) -> tuple[dict, dict]:
    """A peft model's state as (the base model's state under the base's own names, the adapter's state)."""
    base, adapter = {}, {}
    for name, tensor in state.items():
        if any(part in name for part in ADAPTER_PARTS):
            adapter[name] = tensor
            continue
        plain = name.removeprefix("base_model.model.").replace(".base_layer.", ".").replace(".original_module.", ".")
        base[plain] = tensor
    return base, adapter


def state_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


# how gloo reports the other end's socket closing (torch 2.11-2.13): the trainer exited or was killed without "stop"
PEER_GONE = ("Connection closed by peer", "Connection reset by peer")


def next_message(channel: Channel) -> dict | None:
    """The trainer's next message, or None when the trainer is gone (its process ended without sending "stop": killed,
    crashed, or exited before its engine was closed): the engine then stops with one line on stderr, not gloo's
    traceback. Any other failure raises."""
    try:
        return channel.recv_object()
    except RuntimeError as error:
        if not any(text in str(error) for text in PEER_GONE):
            raise
    print("slimrl: the engine process stops: the trainer process closed its connection without stopping the engine "
          "(it exited, crashed or was killed)", file=sys.stderr, flush=True)  # fmt: skip
    return None


def serve(host: str, port: int) -> None:
    from slimrl.rollout.engine import RolloutEngine

    store = engine_store(host, port)
    store.set(ENGINE_UP, "1")
    channel = Channel(store, rank=1)
    spec = channel.recv_object()
    if spec["device"].startswith("cuda"):
        torch.cuda.set_device(torch.device(spec["device"]))
        if spec.get("tensor_backend") == "nccl":  # the trainer is on another GPU: tensors come GPU to GPU
            channel.use_nccl(torch.device(spec["device"]))
    else:  # on the CPU the trainer computes at the same time: half the cores each, not both spinning on all of them
        torch.set_num_threads(max(1, torch.get_num_threads() // 2))
    model = build_model(spec, channel)
    named = dict(model.named_parameters())
    adapter = [named[name] for name in spec["adapter_names"]]
    engine = RolloutEngine(model, max_seq_len=spec["max_seq_len"], **spec["engine_options"])
    while True:
        message = next_message(channel)
        if message is None:
            return
        op = message["op"]
        if op == "adapter":
            recv_adapter_into(channel, message, adapter)
        elif op == "generate":
            if message["params"].sampler == "multinomial":  # it draws on torch's generator: seeded by the trainer
                torch.manual_seed(message["params"].seed)
            try:
                reply = engine.generate(message["prompts"], message["params"], max_new_tokens=message["max_new_tokens"])
            except Exception:  # noqa: BLE001 - the trainer raises it, with this traceback; the engine stays up
                reply = {"engine_error": traceback.format_exc()}
            engine.release()
            channel.send_object(reply)
        elif op == "dump":
            send_adapter(channel, adapter)
        elif op == "describe":
            from slimrl.models.quantization import is_quantized_model

            channel.send_object({"quantized": is_quantized_model(model), "state_bytes": state_bytes(model)})
        elif op == "stop":
            return
        else:
            raise RuntimeError(f"unknown message {op!r}")
