"""What the offloaded checkpoints reuse instead of redoing it on every layer call: the walk over a decoder layer's
submodules (`recompute._walk`: the trainable weights and the dropout check must still follow every change a user or
peft can make to the layer), and within one layer pass the adapters' casts to the compute dtype and the fused
projections' lookup (`lora_linear.one_layer_pass`: the same bits as casting for every tile)."""

from __future__ import annotations

import contextlib
import functools

import torch
from peft import LoraConfig, get_peft_model

from slimrl.models import recompute
from slimrl.models.checkpointing import enable_offloaded_checkpointing
from slimrl.models.fast_lora import enable_fast_lora
from slimrl.testing import tiny_model
from tests.ops.test_fast_lora import lora_model, loss_and_grads


def lora_layer():
    model = get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
    return model, model.base_model.model.model.layers[0]


def walked(layer) -> list[torch.Tensor]:
    return recompute.trainable_weights(layer)


def plain(layer) -> list[torch.Tensor]:
    return [p for p in layer.parameters() if p.requires_grad]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def splittable(layer) -> bool:
    return recompute.splittable_layer(functools.partial(type(layer).forward, layer), ()) is not None


def test_the_walk_is_reused_and_follows_every_change_to_the_layer():
    model, layer = lora_layer()
    first = walked(layer)
    assert same(first, plain(layer)) and len(first) == 14  # lora_A and lora_B of 7 projections
    assert recompute._walk(layer) is recompute._walk(layer)  # nothing changed: the walk is reused
    _ = model.base_model.model.model.layers[:2]  # a new ModuleList (transformers' forward makes one per call)
    assert recompute._walk(layer) is recompute._walk(layer)
    q_a = layer.self_attn.q_proj.lora_A["default"].weight
    q_a.requires_grad_(False)  # read live
    assert same(walked(layer), plain(layer)) and not any(p is q_a for p in walked(layer))
    q_a.requires_grad_(True)
    model.add_adapter("second", LoraConfig(r=2, target_modules="all-linear"))  # new modules and parameters
    for name, p in layer.named_parameters():
        p.requires_grad_("lora_" in name)
    assert same(walked(layer), plain(layer)) and len(walked(layer)) == 28
    proj = layer.mlp.down_proj.lora_B["default"]
    swapped = torch.nn.Parameter(proj.weight.detach().clone())
    proj._parameters["weight"] = swapped  # replaced without a registration (as stateless reparametrisation does)
    assert same(walked(layer), plain(layer)) and any(p is swapped for p in walked(layer))


def test_the_dropout_check_follows_p_the_training_flag_and_new_dropouts():
    _, layer = lora_layer()
    layer.train()
    assert splittable(layer)
    dropout = layer.self_attn.q_proj.lora_dropout["default"]
    assert isinstance(dropout, torch.nn.Identity)
    layer.self_attn.q_proj.lora_dropout["default"] = torch.nn.Dropout(0.1)  # registered: a new walk
    assert not splittable(layer)
    layer.self_attn.q_proj.lora_dropout["default"].p = 0.0  # p read live
    assert splittable(layer)
    layer.self_attn.q_proj.lora_dropout["default"].p = 0.5
    layer.eval()  # a gradient-free pass splits whatever the dropout
    assert splittable(layer)


def test_one_cast_per_adapter_weight_and_pass_with_the_bits_of_a_cast_per_tile(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the casts are what is tested: the kernels' references run
    model = lora_model("qwen2", dtype=torch.bfloat16)  # peft's default: fp32 adapters on a bf16 base
    enable_offloaded_checkpointing(model, mlp_tile_tokens=5)  # 16 tokens: 4 tiles
    enable_fast_lora(model)
    casts, adapters = [], {id(p) for n, p in model.named_parameters() if "lora_" in n}
    original = torch.Tensor.to

    def counting_to(self, *args, **kwargs):
        if id(self) in adapters and args and args[0] == torch.bfloat16:
            casts.append(self.shape)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reused = loss_and_grads(model)
        reused_casts, casts[:] = len(casts), []
        monkeypatch.setattr(recompute, "one_layer_pass", contextlib.nullcontext)
        per_tile = loss_and_grads(model)
    # per layer: 8 casts for q/k/v/o and 6 for the MLP, in the forward and again in the recompute; per tile: 6 x 4
    assert (reused_casts, len(casts)) == (2 * 2 * (8 + 6), 2 * 2 * (8 + 6 * 4))
    assert torch.equal(reused[0], per_tile[0]) and torch.equal(reused[1], per_tile[1])
    assert reused[2].keys() == per_tile[2].keys() and all(g.dtype == torch.float32 for g in reused[2].values())
    for name, grad in per_tile[2].items():
        assert torch.equal(reused[2][name], grad), name


def test_a_fused_projection_is_reused_across_calls_and_follows_every_change_to_its_layer(monkeypatch):
    from slimrl.models import fast_lora

    looked_up = []
    original = fast_lora._projection
    monkeypatch.setattr(fast_lora, "_projection", lambda module: looked_up.append(module) or original(module))
    model, layer = lora_layer()
    q = layer.self_attn.q_proj

    def current():
        looked_up.clear()
        found = fast_lora._kept_projection(q)
        return found, len(looked_up)

    first, lookups = current()
    assert lookups == 1 and first.lora_a is q.lora_A["default"].weight and first.scale == q.scaling["default"]
    assert current() == (first, 0)  # nothing changed: reused without the checks
    _ = model.base_model.model.model.layers[:2]  # transformers' per-forward ModuleList: not a change of the layer
    assert current() == (first, 0)

    q.scaling["default"] = 0.25  # peft's set_scale writes the dict
    found, lookups = current()
    assert lookups == 1 and found.scale == 0.25
    q.get_base_layer().weight.requires_grad_(True)
    assert "trainable" in current()[0]
    q.get_base_layer().weight.requires_grad_(False)
    assert isinstance(current()[0], fast_lora.LoRAProjection)

    with model.disable_adapter():  # the reference pass
        assert "disabled" in current()[0]
    new_a = torch.nn.Parameter(q.lora_A["default"].weight.detach().clone())
    q.lora_A["default"].weight = new_a  # registered
    found, lookups = current()
    assert lookups == 1 and found.lora_a is new_a
    new_b = torch.nn.Parameter(q.lora_B["default"].weight.detach().clone())
    q.lora_B["default"]._parameters["weight"] = new_b  # swapped without a registration
    assert current()[0].lora_b is new_b
    base = torch.nn.Parameter(q.get_base_layer().weight.detach().clone(), requires_grad=False)
    q.get_base_layer()._parameters["weight"] = base
    assert current()[0].weight is base

    q.lora_dropout["default"].p = 0.0  # an Identity has no p: made a Dropout, then its p changed
    q.lora_dropout["default"] = torch.nn.Dropout(0.0)
    assert isinstance(current()[0], fast_lora.LoRAProjection)
    q.lora_dropout["default"].p = 0.1
    assert "dropout" in current()[0]
    q.lora_dropout["default"].p = 0.0
    q.merge()
    assert "merged" in current()[0]
    q.unmerge()
    model.add_adapter("second", LoraConfig(r=2, target_modules="all-linear"))
    model.base_model.set_adapter("second")
    found = current()[0]
    assert isinstance(found, fast_lora.LoRAProjection) and found.lora_a is q.lora_A["second"].weight


def test_fast_lora_after_a_change_between_steps_computes_what_peft_computes():
    # a scale changed and an adapter weight replaced after a fused step: the kept projections are not served stale
    from slimrl.models.fast_lora import disable_fast_lora
    from tests.ops.test_fast_lora import assert_same

    model = lora_model("llama")
    enable_fast_lora(model)
    loss_and_grads(model)
    generator = torch.Generator().manual_seed(5)
    for module in model.modules():
        if isinstance(getattr(module, "scaling", None), dict) and "default" in module.scaling:
            module.scaling["default"] = 0.5
            weight = module.lora_B["default"].weight
            module.lora_B["default"].weight = torch.nn.Parameter(torch.randn(weight.shape, generator=generator))
    fast = loss_and_grads(model)
    disable_fast_lora(model)
    assert_same(loss_and_grads(model), fast, "changed between steps")


def test_watched_modules_are_held_weakly_and_only_live_ones_count():
    """A freed watched module leaves the watch (a set of ids kept it, and CPython hands its id to the next object of
    its size: a ModuleList sliced by transformers' decoder loop then counted as a change, failing the test above once
    in CI); registrations under a live watched module still count."""
    import gc

    watched = torch.nn.Linear(2, 2)
    recompute.watch_registrations([watched])
    held = len(recompute._WALKED)
    del watched
    gc.collect()
    assert len(recompute._WALKED) == held - 1
    live = torch.nn.Module()
    recompute.watch_registrations([live])
    before = recompute.registrations()
    live.add_module("child", torch.nn.Identity())
    torch.nn.Module().add_module("child", torch.nn.Identity())  # not watched
    assert recompute.registrations() == before + 1
