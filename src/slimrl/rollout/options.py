"""Every feature flag and kernel choice of a rollout engine, in one place, resolved for its device (`resolve`).

Each flag left at None is decided by the device: on CUDA with Triton installed every fast path is on; on CPU the
engine runs the same forward with the plain-PyTorch pieces of `model/reference.py` (the Triton flags may still be
turned on under TRITON_INTERPRET=1, which is how the tests run the kernels on a CPU). `describe()` reports the
resolved settings, for logs and benchmarks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from slimrl.rollout import kernels


@dataclass
class EngineOptions:
    """How the engine runs (each None: decided by the device; see `resolve`).

    cuda_graphs / compile: capture the decode step as a CUDA graph; torch.compile the forward's plain pieces (norms,
        RoPE, SwiGLU) for the prefill. Default on CUDA, off on CPU (the eager path is the same math).
    tf32_adapters: on CUDA, when the model computes in bf16/fp16 but its LoRA weights are fp32 (peft's default), let
        those adapter matmuls use TF32 during rollouts (8x faster prefill; TF32's 10-bit mantissa is still finer
        than the bf16 base weights). Off: exact fp32 adapter math, as peft. An fp32 model is never affected.
    triton_lora: LoRA updates of the projections sharing an input as two Triton launches per group
        (`kernels.lora`) instead of peft's per-projection math. Default: on CUDA when Triton is installed.
    triton_attention: decode attention with `kernels.attention` (reads each row's live cache columns once) instead
        of SDPA with a mask. Default: on CUDA when Triton is installed.
    fused_decode: run each layer's projections of a decode step through `fused_ops` (base GEMM, LoRA, RoPE, cache
        writes and SwiGLU fused; about 14 launches per layer instead of 24). With it and triton_attention, the
        captured decode graph reads the KV cache through an address table, so `release()` frees the cache and the
        next rollout of the same shape replays the same graph. Needs triton_lora. Default: on CUDA with Triton.
    fused_sampling: for settings without top-k/top-p/min-p/repetition penalty (TRL's defaults), sample and take
        log-probs with `kernels.sampler` (one pass over the logits, noise drawn in registers) instead of the plain
        functions of `sampling.py` (same distribution, other random draws). Default: on CUDA with Triton.
    deterministic: the output depends only on the inputs and the seed: the LoRA shrinks' K splits
        (`kernels.lora.shrink_(ordered=True)`; down's too, which the gate/up kernel otherwise accumulates) meet in a
        way whose result does not depend on which GPU program finishes first: at most two shares added into zero by
        fp32 atomics (a + b = b + a), or, where that leaves too few programs, each share stored in a slot of its own
        and the slots added in split order (decode steps of 65 to 256 rows) or as fixed-point integers
        (`kernels.common.fixed_add`: each share truncated to a multiple of 2**-32, then int64 atomics), instead of
        fp32 atomics over many shares, whose order varies from run to run and with it the last bits of the logits,
        and so, now and then, a sampled token. The base GEMMs' K splits are always added in split order, and so are
        the shrinks the decode launches compute themselves (`KernelChoice.shrink_k`; up to 64 rows on the H100), in
        either mode. slimrl's trainers turn it on (GRPOConfig.deterministic_rollouts); its cost is in
        docs/benchmarks.md.
    share_prompt_prefill: prompts held by several rows of a wave (GRPO's G completions of one prompt, which TRL
        repeats G times) are prefilled once each: the prefill's forward runs over the distinct prompts only and
        each prompt's K/V are then copied into the cache rows of all its copies (see share_prompt_cache for one
        copy). No random draw depends on it, so the completions are those without it; only the last bits of the
        prompt's K/V may differ, as a GEMM over fewer rows can round differently (as a prompt's output already varies
        in those bits with the prompts sharing its wave). Default on.
    share_prompt_cache: with share_prompt_prefill, the cache holds each distinct prompt's K/V once (a shared prefix,
        `kv_cache`) and each row only its completion's, when that is fewer columns than a copy per row (the prompt
        columns are rounded up to 128): cache memory for long prompts falls by the copies per prompt. The
        attention reads the prompt's columns from the one copy; same math, so the same completions (up to the
        attention's summation order: the copies shift the prompt's columns, and each layout's attention_splits
        follow its own column count, so bf16 sums may round apart). Default (None):
        on where the Triton decode attention reads the copy in place (`Runner.reads_prefix_in_place`: CUDA, a
        power-of-two head dim, no soft-capped scores); elsewhere the plain attention would gather the rows into a
        new tensor at every step and layer, so a copy per row is kept unless this is True.
    attention_splits: how many programs share each row's live columns in the Triton decode attention (their sums
        merged in a fixed order, so either engine mode keeps its guarantees); None: `kernels.attention.
        context_splits` picks by the batch, the kv heads and the cache's columns (8 for 8 rows of a 2-kv-head model
        and 1,024 or more columns, none where the rows and kv heads alone fill the SMs); 1: a program per row and
        kv head.
    kernel_choices: the fused kernels' launch settings, {group: {row bucket: fused_ops.KernelChoice}}; None loads
        `rollout/tuned/<GPU name>.json` (written by bench/tune_decode.py).
    """

    cuda_graphs: bool | None = None
    compile: bool | None = None
    tf32_adapters: bool = True
    triton_lora: bool | None = None
    triton_attention: bool | None = None
    fused_decode: bool | None = None
    fused_sampling: bool | None = None
    deterministic: bool = False
    share_prompt_prefill: bool = True
    share_prompt_cache: bool | None = None
    attention_splits: int | None = None
    kernel_choices: dict | None = None
    choices_file: str | None = dataclasses.field(default=None, repr=False)  # where kernel_choices came from

    def resolve(self, device: torch.device, dtype: torch.dtype) -> EngineOptions:
        """A copy with every None decided for `device`, or a ValueError naming a flag the device cannot honour."""
        on_cuda = device.type == "cuda"
        if (self.cuda_graphs or self.compile) and not on_cuda:
            raise ValueError("cuda_graphs and compile need the model on a CUDA device; leave them at None on CPU.")
        fast = on_cuda and kernels.available()  # the Triton paths' default
        resolved = dataclasses.replace(
            self,
            cuda_graphs=on_cuda if self.cuda_graphs is None else self.cuda_graphs,
            compile=on_cuda if self.compile is None else self.compile,
            tf32_adapters=self.tf32_adapters and on_cuda and dtype in (torch.bfloat16, torch.float16),
            triton_lora=fast if self.triton_lora is None else self.triton_lora,
            triton_attention=fast if self.triton_attention is None else self.triton_attention,
            fused_sampling=fast if self.fused_sampling is None else self.fused_sampling,
        )
        if resolved.fused_decode is None:
            resolved.fused_decode = fast and resolved.triton_lora
        triton_here = kernels.available() and (on_cuda or kernels.interpreting())
        for name in ("triton_lora", "triton_attention", "fused_decode", "fused_sampling"):
            if getattr(resolved, name) and not triton_here:
                raise ValueError(f"{name} needs Triton and the model on a CUDA device (or TRITON_INTERPRET=1).")
        if resolved.attention_splits is not None and not 1 <= resolved.attention_splits <= 256:
            raise ValueError(f"attention_splits={resolved.attention_splits}: give 1 ... 256, or None to let the "
                             "engine choose.")  # fmt: skip
        if resolved.fused_decode and not resolved.triton_lora:
            raise ValueError("fused_decode=True needs triton_lora=True (its LoRA shrinks are Triton launches).")
        if resolved.fused_decode and resolved.kernel_choices is None:
            from slimrl.rollout.fused_ops import choices_for

            choices, path = choices_for(device)
            resolved.kernel_choices, resolved.choices_file = choices, path.name
        return resolved

    def describe(self) -> dict:
        """The settings as plain values (kernel choices by group and row bucket)."""
        described = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "kernel_choices"}
        if self.kernel_choices is not None:
            described["kernel_choices"] = {f"{group}@{rows}": dataclasses.asdict(choice)
                                           for group, buckets in self.kernel_choices.items()
                                           for rows, choice in buckets.items()}  # fmt: skip
        return described
