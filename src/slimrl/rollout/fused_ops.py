"""The decode step's fused projections (`kernels.projections`, `kernels.norm`) bound to one layer's live modules, and
the launch settings they use, which are data: `tuned/<GPU name>.json`, written by `bench/tune_decode.py`.

`FusedDecode` gives `Decoder.forward` four operations; each returns None when the projections at hand do
not fit the kernels (several active adapters, mixed LoRA and plain layers, a head dim the kernels cannot tile, ...)
and the forward then takes its unfused path for that group, which is the reference:

- `qkv(layer, h, specs, q_norm, k_norm, cos, sin)`: q [N, heads*D] with RoPE, k and v written into the cache;
- `linear(x, spec)`: one projection with its LoRA update (o, down);
- `gate_up(h, gate, up)`: SiLU(gate) * up with both LoRA updates;
- `add_rms_norm(hidden, delta, norm)`: the residual add and the norm after it.

LoRA's first product (`x · Aᵀ`, for all projections that share the input) comes from `kernels.lora.shrink_` in one
launch; the kernels here add `B · scale` in their epilogue. Base weights are multiplied by the kernels themselves
(`gemm` per group) or by the modules / cuBLAS before the epilogue kernel (bitsandbytes layers, and groups where
cuBLAS is faster). The cache is addressed through `table` (see `kernels.projections`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from slimrl.rollout.kernels import lora as lora_kernels
from slimrl.rollout.kernels import norm as norm_kernel
from slimrl.rollout.kernels import projections, runs_here
from slimrl.rollout.kv_cache import StepContext
from slimrl.rollout.model.views import LinearSpec

logger = logging.getLogger(__name__)

GROUPS = ("qkv", "o", "gate_up", "down")


@dataclass
class KernelChoice:
    """Launch settings of one projection group: whether the Triton kernel does the base GEMM (else cuBLAS or the
    module does, and the kernel runs the epilogue), its output-column tile (for q/k/v: columns of each RoPE half
    per program), K step, warps and pipeline stages; rows per program (0: up to 64 by the row count) and, for the
    projections, programs per SM to spread the columns over (0: whole tiles; see `kernels.common.tile_columns`);
    and programs sharing each tile's K (split-K, with the kernel's own GEMM during a decode step; see
    `kernels.gemm.split_gemm`); and, where the launch computes its LoRA shrink itself (`kernels.gemm.
    produce_shrink`, during a decode step: the same bits in either engine mode), the K columns each of its producer
    programs takes (0: a `lora.shrink_` launch before it computes the shrink)."""

    gemm: bool = True
    block_n: int = 32
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    block_m: int = 0
    per_sm: int = 0
    split_k: int = 1
    shrink_k: int = 512


# settings are chosen per row count: decode batches of up to 16, 64 and 256 rows, and prefill blocks beyond
PREFILL = 1 << 30
ROW_BUCKETS = (16, 64, 256, PREFILL)
TUNED = Path(__file__).resolve().parent / "tuned"
FALLBACK_GPU = "NVIDIA H100 80GB HBM3"  # the settings used on a GPU with no file of its own (and in the interpreter)


def tuned_path(gpu_name: str) -> Path:
    """Where the tuned settings of a GPU live: its name with every character outside [A-Za-z0-9._-] made '_'."""
    return TUNED / ("".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in gpu_name) + ".json")


def load_choices(path: Path) -> dict[str, dict[int, KernelChoice]]:
    """{group: {row bucket: KernelChoice}} from a tuned file (bucket keys "16", "64", "256", "prefill")."""
    data = json.loads(Path(path).read_text())["choices"]
    def bucket(key: str) -> int:
        return PREFILL if key == "prefill" else int(key)

    return {group: {bucket(key): KernelChoice(**fields) for key, fields in buckets.items()}
            for group, buckets in data.items()}  # fmt: skip


def save_choices(path: Path, choices: dict, gpu_name: str, **notes) -> None:
    """Write settings in `load_choices`'s format (bench/tune_decode.py does, after checking each candidate)."""
    data = {"gpu": gpu_name, **notes, "choices": {
        group: {"prefill" if b == PREFILL else str(b): dataclasses.asdict(c) for b, c in buckets.items()}
        for group, buckets in choices.items()}}  # fmt: skip
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def choices_for(device: torch.device) -> tuple[dict[str, dict[int, KernelChoice]], Path]:
    """The tuned settings for this device's GPU, or the fallback GPU's (said once in the log), and their file."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else FALLBACK_GPU
    path = tuned_path(name)
    if not path.is_file():
        logger.info("slimrl: no tuned decode kernel settings for %s (%s); using those of %s.", name, path.name,
                    FALLBACK_GPU)  # fmt: skip
        path = tuned_path(FALLBACK_GPU)
    return load_choices(path), path


@dataclass
class FusedDecode:
    heads: int
    kv_heads: int
    head_dim: int
    lora: lora_kernels.GroupedLoRA
    tf32: bool = True
    # deterministic: the LoRA shrinks run `kernels.lora.shrink_(ordered=True)` (two K splits at most by fp32 atomics,
    # per-split slots added in split order, or fixed-point sums), so no sum depends on the order in which the programs
    # finish; down's shrink is then a launch of its own, not fp32 shares from every column tile of the gate/up kernel
    ordered: bool = False
    choices: dict = dataclasses.field(default_factory=lambda: choices_for(torch.device("cpu"))[0])
    context: StepContext | None = None
    # lora_A(act) of the down projection, accumulated by the gate/up kernel: (act, A, workspace [1, M, R_PAD])
    _shrunk: tuple | None = None

    def choice(self, group: str, rows: int) -> KernelChoice:
        buckets = self.choices[group]
        return buckets[min(b for b in buckets if b >= rows)]

    def bind(self, context: StepContext | None) -> FusedDecode:
        self.context = context
        return self

    @staticmethod
    def new_scratch() -> projections.SplitScratch:
        """Scratch for the split-K launches of the decode steps bound to it (`StepContext.scratch`)."""
        return projections.SplitScratch()

    def _scratch(self):
        return None if self.context is None else self.context.scratch

    # -- the pieces ----------------------------------------------------------------------------------------------

    def _lora(self, x: torch.Tensor, specs, shrink_k: int):
        """((workspace, Bs, scales), fuse) for specs that each have exactly one adapter of one rank and dtype, (None,
        None) when none has an adapter, (False, None) when the kernels cannot take them. fuse: None when the
        workspace holds lora_A(x) already (a `shrink_` launch here, or the gate/up kernel's), else the kernel's
        `fuse` argument (it computes the workspace itself, shrink_k input features per producer) when shrink_k > 0
        and a decode step's scratch is there."""
        counts = {len(s.loras) for s in specs}
        if counts == {0}:
            return None, None
        if counts != {1}:
            return False, None
        lora_as = [s.loras[0][0] for s in specs]
        lora_bs = [s.loras[0][1] for s in specs]
        rank, dtype = lora_as[0].shape[0], lora_as[0].dtype
        if rank > 128 or dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False, None
        for spec, a, b in zip(specs, lora_as, lora_bs, strict=True):
            out_features = spec.weight.shape[0] if spec.weight is not None else None
            if a.dtype != dtype or b.dtype != dtype or a.shape != (rank, x.shape[1]) or b.shape[1] != rank:
                return False, None
            if out_features is not None and b.shape[0] != out_features:
                return False, None
            if not (a.is_contiguous() and b.is_contiguous()):
                return False, None
        scales = [s.loras[0][2] for s in specs]
        shrunk, self._shrunk = self._shrunk, None
        if shrunk is not None and len(specs) == 1 and shrunk[0] is x and shrunk[1] is lora_as[0]:
            return (shrunk[2], lora_bs, scales), None  # the gate/up kernel has computed lora_A(x) already
        scratch = self._scratch()
        state = scratch.state(x.device) if shrink_k > 0 and scratch is not None else None
        if state is not None:
            r_pad = lora_kernels.padded_rank(rank)
            workspace = self.lora.take(len(specs) * x.shape[0] * r_pad, rank)
            if workspace is None:
                workspace = torch.empty(len(specs) * x.shape[0] * r_pad, dtype=torch.float32, device=x.device)
            return ((workspace.view(len(specs), x.shape[0], r_pad), lora_bs, scales),
                    (lora_as, state, self.tf32, shrink_k))  # fmt: skip
        workspace = self.lora.take(lora_kernels.workspace_elements(len(specs), x.shape[0], rank, self.ordered), rank)
        shrunk = lora_kernels.shrink_(x, lora_as, workspace, self.tf32, self.ordered, self.lora.slots)
        return (shrunk, lora_bs, scales), None

    def _base(self, x: torch.Tensor, specs, gemm: bool):
        """(weights, biases, outputs) for the kernel: weights for the kernel's own GEMM, else base outputs computed
        here (module calls for bitsandbytes layers; cuBLAS for plain ones). None when the specs do not fit."""
        modules = [s.module is not None for s in specs]
        if all(modules):
            return None, None, [s.module(x).contiguous() for s in specs]
        if any(modules):
            return None
        if any(s.weight.dtype != x.dtype for s in specs):
            return None
        if not gemm:
            return None, None, [F.linear(x, s.weight, s.bias) for s in specs]
        if not all(s.weight.is_contiguous() for s in specs):
            return None
        biases = [s.bias for s in specs]
        if any(b is None for b in biases):
            if any(b is not None for b in biases):
                return None, None, [F.linear(x, s.weight, s.bias) for s in specs]
            biases = None
        return [s.weight for s in specs], biases, None

    def _ready(self, x: torch.Tensor) -> bool:
        return runs_here(x) and x.dim() == 2 and x.stride(-1) == 1

    def fuses_shrink(self, group: str, rows: int) -> bool:
        """Whether the group's launch over `rows` rows computes its own LoRA shrink: during a decode step (a bound
        context) at up to 256 rows, where its settings say so."""
        return self._scratch() is not None and rows <= 256 and self.choice(group, rows).shrink_k > 0

    def _prepare(self, x: torch.Tensor, specs, group: str):
        """(choice, (weights, biases, outputs), lora, fuse) for the group's kernel, or None when it cannot take
        them."""
        if not self._ready(x):
            return None
        choice = self.choice(group, x.shape[0])
        base = self._base(x, specs, choice.gemm)
        if base is None:
            return None
        lora, fuse = self._lora(x, specs, choice.shrink_k if self.fuses_shrink(group, x.shape[0]) else 0)
        return None if lora is False else (choice, base, lora, fuse)

    # -- the operations ------------------------------------------------------------------------------------------

    def add_rms_norm(self, hidden, delta, norm) -> tuple | None:
        """(hidden + delta, its RMSNorm) in one launch during a decode step (so it takes part in the step's
        programmatic dependent launches, see `pdl`); delta may be None (the first layer: the norm alone)."""
        if self.context is None or not self._ready(hidden) or not hidden.is_contiguous():
            return None
        if delta is not None and (delta.shape != hidden.shape or delta.dtype != hidden.dtype or
                                  not delta.is_contiguous()):  # fmt: skip
            return None
        return norm_kernel.add_rms_norm(hidden, delta, norm.weight, norm.eps)

    def qkv(self, layer: int, h, specs, q_norm, k_norm, cos, sin) -> torch.Tensor | None:
        context = self.context
        if context is None or not projections.can_run_qkv(self.head_dim, h.dtype):
            return None
        if (q_norm is None) != (k_norm is None):
            return None
        prepared = self._prepare(h, specs, "qkv")
        if prepared is None:
            return None
        choice, (weights, biases, outputs), lora, fuse = prepared
        norms = None if q_norm is None else ((q_norm.weight, q_norm.eps), (k_norm.weight, k_norm.eps))
        query = torch.empty(h.shape[0], self.heads * self.head_dim, dtype=h.dtype, device=h.device)
        projections.qkv_rope_cache(
            h, weights, biases, outputs, lora, norms, cos, sin, query, context.table, context.anchor, layer,
            context.column, context.cache_len, self.heads, self.kv_heads, self.head_dim, block_k=choice.block_k,
            tf32=self.tf32, num_warps=choice.num_warps, num_stages=choice.num_stages, slice_cols=choice.block_n,
            block_m=choice.block_m, split_k=choice.split_k, scratch=self._scratch(), fuse=fuse,
        )  # fmt: skip
        return query

    def _project(self, x, specs, group: str, pair: bool, next_shrink=None) -> torch.Tensor | None:
        prepared = self._prepare(x, specs, group)
        if prepared is None:
            return None
        choice, (weights, biases, outputs), lora, fuse = prepared
        width = weights[0].shape[0] if weights is not None else outputs[0].shape[1]
        out = torch.empty(x.shape[0], width, dtype=x.dtype, device=x.device)
        return projections.project(
            x, weights, biases, outputs, lora, out, pair, block_n=choice.block_n, block_k=choice.block_k,
            tf32=self.tf32, num_warps=choice.num_warps, num_stages=choice.num_stages,
            next_shrink=None if next_shrink is None else (next_shrink[0], next_shrink[1][0]),
            block_m=choice.block_m, per_sm=choice.per_sm, split_k=choice.split_k, scratch=self._scratch(),
            fuse=fuse,
        )  # fmt: skip

    def linear(self, x, spec: LinearSpec, group: str = "o") -> torch.Tensor | None:
        return self._project(x, (spec,), group, pair=False)

    def gate_up(self, h, gate: LinearSpec, up: LinearSpec, down: LinearSpec | None = None) -> torch.Tensor | None:
        """SiLU(gate) * up; with `down` (the projection that reads it next), its LoRA shrink is accumulated in the
        same launch by fp32 atomics and picked up by the next `linear(act, down)` (not when `ordered`, nor where
        down's launch computes its shrink itself)."""
        if gate.module is None and up.module is None and gate.weight.shape != up.weight.shape:
            return None
        next_shrink = None
        fused_down = self.fuses_shrink("down", h.shape[0])
        if down is not None and not (self.ordered or fused_down) and down.module is None and len(down.loras) == 1 \
                and self._ready(h):  # fmt: skip
            lora_a = down.loras[0][0]
            rank = lora_a.shape[0]
            dtypes = (torch.float32, torch.bfloat16, torch.float16)
            if lora_a.is_contiguous() and rank <= 128 and lora_a.dtype in dtypes:
                padded = lora_kernels.padded_rank(rank)
                workspace = self.lora.take(h.shape[0] * padded, rank)
                if workspace is not None:
                    next_shrink = (lora_a, workspace.view(1, h.shape[0], padded))
        act = self._project(h, (gate, up), "gate_up", pair=True, next_shrink=next_shrink)
        if act is not None and next_shrink is not None:
            self._shrunk = (act, next_shrink[0], next_shrink[1])
        return act
