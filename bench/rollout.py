"""W2 (shared/bench/WORKLOAD.md): rollout throughput on W1's model with a live LoRA adapter, beside TRL's paths.

Model: Qwen2, vocab 151936, hidden 1536, intermediate 8960, 28 layers, 12 heads, 2 kv heads, tied embeddings, bf16,
random init, peft LoRA r=64 alpha=64 on all linear layers (peft's default fp32 adapter weights, as TRL gets them; B
set to small random values so the adapter matters). Prompts: 256 random tokens; 256 new tokens at temperature 1.0,
no EOS; batch 8, 64, 256. Reported, in tokens/second (generated tokens / wall time including prefill):
  engine   slimrl's RolloutEngine, adapter live (second of two identical rollouts: the first compiles and captures)
  hf       TRL's default path: `generate` through the PEFT model (new tokens capped by --baseline-tokens)
  cb       transformers continuous batching `generate_batch` through the PEFT model (TRL's
           use_transformers_continuous_batching), as shared/bench/anchors/gen_anchor.py (capped likewise)
  roofline batch / ((weight bytes + KV bytes read per step) / measured copy bandwidth), the KV term at the mean
           context of the rollout (prompt + half the completion)
Also: a self-check of the engine's Triton kernels against their references (a failing one is turned off before
timing), greedy output of the engine vs `generate` greedy on the first 64 tokens (bf16, and fp32 with --fp32-check),
and the kernels of one captured decode step at batch 64 and 256 (profile of graph replays; with programmatic dependent
launch a kernel's time includes its wait for the one before, so the sum exceeds the step). --variants times the
engine again with other settings (default: pdl=0, ordinary launches), each in a fresh engine.

    python bench/rollout.py [$OUT/rollout.json] [--batches 8 64 256] [--baseline-tokens 64] [--skip hf cb]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

V, PROMPT, NEW = 151936, 256, 256


def build_model(dtype=torch.bfloat16):
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=V, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                         tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 1
    lora = LoraConfig(r=64, lora_alpha=64, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.01)
    return model.eval()


def prompts_for(batch: int, seed: int = 0, vary: bool = False) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [PROMPT - (i * 7) % 57 if vary else PROMPT for i in range(batch)]
    return [torch.randint(10, V, (n,), generator=g).tolist() for n in lengths]


def sync_time() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy (best of 10)."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(10):
        start = sync_time()
        dst.copy_(src)
        best = min(best, sync_time() - start)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (2 << 30) / best


def weight_bytes(model) -> int:
    """Bytes of every parameter (tied embedding counted once: the LM head reads it whole every step)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def engine_run(engine, batch, params, new_tokens, runs: int = 3):
    """Tokens/s of a rollout (prefill and decode) after a first call that compiles and captures: the median of
    `runs` timed rollouts (all of them listed)."""
    prompts = prompts_for(batch)
    engine.generate(prompts, params, max_new_tokens=new_tokens)
    timed = []
    for _ in range(runs):
        start = sync_time()
        out = engine.generate(prompts, params, max_new_tokens=new_tokens)
        timed.append((sync_time() - start, out))
    seconds, out = sorted(timed, key=lambda t: t[0])[runs // 2]
    tokens = sum(len(c) for c in out.completion_ids)
    stats = {k: round(v, 4) if isinstance(v, float) else v for k, v in out.stats.items()}
    step_ms = 1000 * out.stats["decode_s"] / max(1, out.stats["decode_steps"])
    return {"tok_s": round(tokens / seconds), "s": round(seconds, 3), "runs_s": [round(t, 3) for t, _ in timed],
            "tokens": tokens,
            "decode_step_ms": round(step_ms, 3), "stats": stats,
            "kv_cache_GiB": round(engine._session.cache.nbytes / 2**30, 3)}  # fmt: skip


def hf_generate_run(model, batch, new_tokens):
    ids = torch.tensor(prompts_for(batch), device="cuda")
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=1, eos_token_id=None)
    with torch.no_grad():
        model.generate(input_ids=ids[:, :32], attention_mask=torch.ones_like(ids[:, :32]), max_new_tokens=4, **kwargs)
        start = sync_time()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, **kwargs)  # fmt: skip
        seconds = sync_time() - start
    tokens = (out.shape[1] - ids.shape[1]) * batch
    return {"tok_s": round(tokens / seconds), "s": round(seconds, 3), "tokens": tokens, "new_tokens": new_tokens}


def cb_run(model, batch, new_tokens):
    from transformers import GenerationConfig

    prompts = prompts_for(batch)
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              eos_token_id=None, pad_token_id=1)  # fmt: skip
    with torch.no_grad():
        model.generate_batch(inputs=prompts[:4], generation_config=config, max_new_tokens=8)
        start = sync_time()
        out = model.generate_batch(inputs=prompts, generation_config=config)
        seconds = sync_time() - start
    tokens = sum(len(o.generated_tokens) for o in out.values())
    return {"tok_s": round(tokens / seconds), "s": round(seconds, 3), "tokens": tokens, "new_tokens": new_tokens}


def greedy_match(model, engine, batch=8, new_tokens=64):
    """Engine greedy vs generate greedy on left-padded prompts of different lengths: matching prefix per row."""
    from slimrl.rollout.sampling import SamplingParams

    prompts = prompts_for(batch, seed=1, vary=True)
    out = engine.generate(prompts, SamplingParams(temperature=0.0), max_new_tokens=new_tokens).completion_ids
    length = max(map(len, prompts))
    ids = torch.tensor([[1] * (length - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=1, eos_token_id=None)[:, length:].tolist()  # fmt: skip
    prefixes = []
    for a, b in zip(out, ref, strict=True):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefixes.append(n)
    same = sum(x == y for a, b in zip(out, ref, strict=True) for x, y in zip(a, b, strict=False))
    return {"identical_rows": sum(p == new_tokens for p in prefixes), "rows": batch, "matching_prefix": prefixes,
            "token_match_fraction": round(same / (batch * new_tokens), 4), "new_tokens": new_tokens}  # fmt: skip


def graph_profile(engine, reps: int = 20):
    """The captured decode step of the engine's current session: time per replay, and its kernels per step (from a
    profile of three replays)."""
    from torch.profiler import ProfilerActivity, profile

    graph = engine._session.graph
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    step_ms = (sync_time() - start) * 1000 / reps
    report = {"batch": engine._session.batch, "replay_ms": round(step_ms, 3)}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    rows, total_us, count = [], 0.0, 0
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0) or 0
        if t <= 0:
            continue
        total_us += t
        count += e.count
        rows.append((t / 3, e.count / 3, e.key[:90]))
    rows.sort(reverse=True)
    report["profiled_kernels_per_step"] = round(count / 3)
    report["profiled_gpu_us_per_step"] = round(total_us / 3)
    report["top"] = [{"us": round(t, 1), "n": n, "kernel": k} for t, n, k in rows[:30]]
    return report


def kernel_self_check() -> dict:
    """The engine's Triton kernels against their references at W1's shapes; a failing one is turned off, so the
    figures below are always of a correct path."""
    import torch.nn.functional as F

    from slimrl.rollout import llama

    report = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    try:
        from slimrl.rollout.attention_kernel import decode_attention

        q = torch.randn(64, 12, 128, generator=g, device="cuda").bfloat16()
        keys = torch.randn(64, 2, 512, 128, generator=g, device="cuda").bfloat16()
        values = torch.randn(64, 2, 512, 128, generator=g, device="cuda").bfloat16()
        starts = torch.randint(0, 60, (64,), generator=g, device="cuda")
        columns = torch.arange(512, device="cuda")
        live = (columns[None] >= starts[:, None]) & (columns[None] <= 400)
        mask = torch.zeros(live.shape, device="cuda").masked_fill_(~live, float("-inf")).bfloat16()[:, None, None]
        want = F.scaled_dot_product_attention(q[:, :, None], keys.repeat_interleave(6, 1),
                                              values.repeat_interleave(6, 1), attn_mask=mask)[:, :, 0]  # fmt: skip
        got = decode_attention(q, keys, values, starts, torch.tensor([400], device="cuda"), 128**-0.5)
        report["attention_max_abs_err"] = float((got.float() - want.float()).abs().max())
    except Exception as err:  # noqa: BLE001
        report["attention_error"] = f"{type(err).__name__}: {str(err)[:300]}"
    try:
        from slimrl.rollout.lora_kernels import lora_group_

        x = torch.randn(64, 1536, generator=g, device="cuda").bfloat16()
        items = []
        for width in (1536, 256, 256):
            y = torch.randn(64, width, generator=g, device="cuda").bfloat16()
            a = torch.randn(64, 1536, generator=g, device="cuda") * 1536**-0.5
            b = torch.randn(width, 64, generator=g, device="cuda") * 0.1
            items.append((y, (a, b, 1.0)))
        expected = [(y.clone(), lora) for y, lora in items]
        llama.add_lora_(x, expected)
        lora_group_(x, items, tf32=True)
        report["lora_max_abs_err"] = max(float((y.float() - e.float()).abs().max()) for (y, _), (e, _) in
                                         zip(items, expected, strict=True))  # fmt: skip
    except Exception as err:  # noqa: BLE001
        report["lora_error"] = f"{type(err).__name__}: {str(err)[:300]}"
    report["attention_ok"] = report.get("attention_max_abs_err", 1.0) < 0.05
    report["lora_ok"] = report.get("lora_max_abs_err", 1.0) < 0.1
    return report


# (gemm, block_n, block_k, warps, stages[, block_m, per_sm, split_k]); for qkv block_n = columns per RoPE half.
# block_m 0 = up to 64 rows by the row count; per_sm > 0 spreads the columns over that many programs per SM.
TUNE_CANDIDATES = {
    "qkv": [(True, 16, 128, 4, 3), (True, 32, 128, 4, 3), (True, 16, 128, 4, 3, 0, 0, 2),
            (True, 16, 128, 4, 3, 0, 0, 3), (True, 16, 128, 4, 3, 0, 0, 4), (True, 32, 128, 4, 3, 0, 0, 2),
            (True, 32, 128, 4, 3, 0, 0, 4), (True, 16, 64, 4, 4, 0, 0, 4), (True, 32, 64, 4, 4, 0, 0, 3)],
    "o": [(True, 16, 128, 4, 4), (True, 64, 128, 4, 3), (True, 16, 128, 4, 4, 0, 0, 2), (True, 16, 128, 4, 4, 0, 0, 3),
          (True, 16, 128, 4, 4, 0, 0, 4), (True, 32, 128, 4, 3, 0, 0, 2), (True, 32, 128, 4, 3, 0, 0, 4),
          (True, 64, 128, 4, 3, 0, 0, 2), (True, 64, 128, 4, 3, 0, 0, 4), (True, 16, 64, 4, 4, 0, 0, 4)],
    "gate_up": [(True, 64, 64, 4, 4), (True, 64, 64, 4, 3, 0, 2), (False, 128, 64, 4, 3), (False, 64, 64, 4, 3),
                (True, 64, 64, 4, 4, 0, 0, 2), (True, 64, 64, 4, 4, 0, 0, 3), (True, 32, 64, 4, 4, 0, 0, 2),
                (True, 32, 128, 4, 3, 0, 0, 2), (True, 64, 128, 4, 3, 0, 0, 2), (True, 128, 64, 8, 3, 0, 0, 2),
                (True, 128, 64, 8, 3, 0, 0, 4), (True, 64, 64, 8, 3, 0, 0, 2)],
    "down": [(False, 64, 64, 4, 3), (False, 32, 64, 4, 3), (True, 16, 128, 4, 4, 0, 0, 4),
             (True, 16, 128, 4, 4, 0, 0, 8), (True, 32, 128, 4, 3, 0, 0, 4), (True, 32, 128, 4, 3, 0, 0, 8),
             (True, 64, 128, 4, 3, 0, 0, 8), (True, 32, 64, 4, 4, 0, 0, 8), (True, 64, 64, 4, 4, 0, 0, 4),
             (True, 64, 128, 4, 3, 0, 0, 4)],
}  # fmt: skip
ATTENTION_CANDIDATES = [(64, 4), (128, 4), (128, 8), (32, 4)]  # (block_s, num_warps)


def layer_inputs(model, rows: int):
    """Layer 0's live specs of W1's model and random inputs of `rows` decode rows."""
    from slimrl.rollout import llama

    decoder = llama.Decoder(model)
    (norm, q, k, v), (q_norm, k_norm), (o, _), (gate, up, down) = decoder.layer_args(decoder.layers[0])
    g = torch.Generator(device="cuda").manual_seed(rows)
    h = torch.randn(rows, 1536, generator=g, device="cuda").bfloat16()
    act = (torch.randn(rows, 8960, generator=g, device="cuda") * 0.3).bfloat16()
    angles = torch.rand(rows, 64, generator=g, device="cuda") * 6
    cos, sin = (torch.cat([f(angles)] * 2, -1).bfloat16() for f in (torch.cos, torch.sin))
    return decoder, h, act, cos, sin, (q, k, v), o, (gate, up), down


def fused_calls(model, rows: int, choices, cache_len: int = 512):
    """One callable per group running the fused op (with its LoRA shrink), and the unfused reference outputs."""
    from slimrl.rollout import llama
    from slimrl.rollout.fused_decode import FusedDecode
    from slimrl.rollout.kv_cache import StaticKVCache, StepContext, table_entries
    from slimrl.rollout.lora_kernels import GroupedLoRA

    decoder, h, act, cos, sin, qkv, o, gate_up, down = layer_inputs(model, rows)
    lora = GroupedLoRA(tf32=True)
    ops = FusedDecode(12, 2, 128, lora, tf32=True, choices=choices)
    cache = StaticKVCache(1, rows, 2, cache_len, 128, torch.bfloat16, "cuda")
    anchor = torch.zeros(1, dtype=torch.bfloat16, device="cuda")
    table = torch.tensor(table_entries(cache, anchor), device="cuda")
    column = torch.tensor([300], device="cuda")
    ops.bind(StepContext(table, anchor, column, cache_len, ops.new_scratch()))

    def run(fn):
        def call():
            lora.begin(rows, 4, 64, h.device)
            return fn()

        return call

    calls = {
        "qkv": run(lambda: ops.qkv(0, h, qkv, None, None, cos, sin)),
        "o": run(lambda: ops.linear(h, o, "o")),
        "gate_up": run(lambda: ops.gate_up(h, *gate_up, down)),  # as the engine calls it: with down's shrink
        "down": run(lambda: ops.linear(act, down, "down")),
    }
    ref_cache = StaticKVCache(1, rows, 2, cache_len, 128, torch.bfloat16, "cuda")
    with torch.no_grad():
        query, key, value = llama.project(h, qkv, llama.add_lora_)
        query, key = llama.qk_norm_rope(query.view(rows, 12, 128), key.view(rows, 2, 128), None, None, cos, sin)
        ref_cache.write_column(0, column, key, value.view(rows, 2, 128))
        reference = {
            "qkv": (query.reshape(rows, -1), ref_cache.keys[0], ref_cache.values[0]),
            "o": llama.project(h, (o,), llama.add_lora_)[0],
            "gate_up": llama.silu_mul(*llama.project(h, gate_up, llama.add_lora_)),
            "down": llama.project(act, (down,), llama.add_lora_)[0],
        }
    return calls, reference, cache


def fused_error(group: str, call, reference, cache) -> float:
    """Largest error of one fused op's output(s) over the largest reference magnitude."""
    with torch.no_grad():
        got = call()
    if group == "qkv":
        got, want = (got, cache.keys[0], cache.values[0]), reference[group]
    else:
        got, want = (got,), (reference[group],)
    return max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))
               for a, b in zip(got, want, strict=True))  # fmt: skip


def fused_self_check(model, choices=None) -> dict:
    """Each fused op against the unfused path at W1's shapes, 8 / 64 / 256 rows: largest error over the largest
    reference magnitude (bf16 with TF32 adapters: expect under 2e-2). choices: default_choices() when None."""
    from slimrl.rollout.fused_decode import default_choices

    report, worst = {}, 0.0
    for rows in (8, 64, 256):
        calls, reference, cache = fused_calls(model, rows, choices or default_choices())
        for group, call in calls.items():
            err = fused_error(group, call, reference, cache)
            report[f"{group}_B{rows}"] = round(err, 5)
            worst = max(worst, err)
    report["worst_relative_error"] = round(worst, 5)
    report["ok"] = worst < 2e-2
    return report


def sampling_self_check() -> dict:
    """The fused sampler against its plain statement at W1's vocabulary, 64 rows, same uniforms."""
    from slimrl.rollout import sampling_kernel
    from slimrl.rollout.sampling import SamplingParams

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(64, V, generator=g, device="cuda") * 4).bfloat16()
    seed, step = torch.tensor([99], device="cuda"), torch.tensor([3], device="cuda")
    report = {}
    for name, params in (("t1", SamplingParams(temperature=1.0)), ("greedy", SamplingParams(temperature=0.0))):
        tokens, logprobs = sampling_kernel.choose(logits, params, seed, step)
        want, want_lp = sampling_kernel.reference_choice(logits, params, sampling_kernel.uniforms(seed, step, 64, V))
        report[f"{name}_same_tokens"] = float((tokens == want).float().mean())
        report[f"{name}_logprob_err"] = float((logprobs - want_lp).abs().max())
    report["ok"] = all(report[f"{n}_same_tokens"] >= 0.98 and report[f"{n}_logprob_err"] < 1e-3
                       for n in ("t1", "greedy"))  # fmt: skip
    return report


def tune(model, groups=("attention", *TUNE_CANDIDATES), row_counts=(8, 64, 256)) -> dict:
    """Time each group's fused op for every candidate setting at these row counts (CUDA-graph replays)."""
    from triton.testing import do_bench_cudagraph

    from slimrl.rollout.attention_kernel import decode_attention
    from slimrl.rollout.fused_decode import ROW_BUCKETS, KernelChoice, default_choices
    from slimrl.rollout.kv_cache import StaticKVCache, table_entries

    report = {}
    for rows in (64, 256) if "attention" in groups else ():  # at W2's mean context (384 live columns of 512)
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(rows, 12, 128, generator=g, device="cuda").bfloat16()
        cache = StaticKVCache(1, rows, 2, 512, 128, torch.bfloat16, "cuda")
        keys = cache.keys[0].normal_(generator=g)
        cache.values[0].normal_(generator=g)
        anchor = torch.zeros(1, dtype=torch.bfloat16, device="cuda")
        table = torch.tensor(table_entries(cache, anchor), device="cuda")
        starts, end = torch.zeros(rows, dtype=torch.long, device="cuda"), torch.tensor([383], device="cuda")
        for block_s, warps in ATTENTION_CANDIDATES:
            key = f"attention_B{rows}_s{block_s}_w{warps}"
            try:
                args = (q, keys, keys, starts, end, 0.1, 0, table, anchor, block_s, warps)
                report[key] = round(1000 * do_bench_cudagraph(lambda a=args: decode_attention(*a), rep=30), 2)
            except Exception as err:  # noqa: BLE001
                report[key] = f"ERR {type(err).__name__}: {str(err)[:120]}"
            print(key, report[key], flush=True)
    best = {}
    for rows in row_counts:
        for group, candidates in ((g, c) for g, c in TUNE_CANDIDATES.items() if g in groups):
            for candidate in candidates:
                gemm, block_n, block_k, warps, stages, block_m, per_sm, split_k = (*candidate, 0, 0, 1)[:8]
                choices = default_choices()
                choice = KernelChoice(gemm, block_n or 32, block_k, warps, stages, block_m, per_sm, split_k)
                choices[group] = {bucket: choice for bucket in ROW_BUCKETS}
                calls, reference, cache = fused_calls(model, rows, choices)
                key = (f"{group}_B{rows}_{'gemm' if gemm else 'cublas'}_n{block_n}_k{block_k}_w{warps}_s{stages}"
                       f"_m{block_m}_p{per_sm}_x{split_k}")  # fmt: skip
                try:
                    error = fused_error(group, calls[group], reference, cache)
                    with torch.no_grad():
                        report[key] = round(1000 * do_bench_cudagraph(calls[group], rep=30), 2)  # microseconds
                    if error >= 2e-2:  # a wrong kernel is no candidate, however fast
                        report[key] = f"WRONG relative error {error:.3g} ({report[key]} us)"
                except Exception as err:  # noqa: BLE001 - a setting that does not compile is reported
                    report[key] = f"ERR {type(err).__name__}: {str(err)[:120]}"
                print(key, report[key], flush=True)
                bucket = min(b for b in ROW_BUCKETS if b >= rows)
                if isinstance(report[key], float) and report[key] < best.get((group, bucket), (float("inf"),))[0]:
                    best[group, bucket] = (report[key], choice)
    return report, best


def tuned_choices(best) -> dict:
    """The default choices with each timed (group, row bucket) replaced by its fastest candidate."""
    from slimrl.rollout.fused_decode import default_choices

    choices = default_choices()
    for (group, bucket), (_, choice) in best.items():
        choices[group][bucket] = choice
    return choices


@contextlib.contextmanager
def engine_variant(variant: str, tuned):
    """Settings of one `--variants` entry for the engines built inside; yields (kernel choices, engine flags). Keys:
    pdl (`pdl.MODE`), deterministic (the engine option), GROUP.FIELD or GROUP@ROWS.FIELD (a `KernelChoice` field,
    in every decode row bucket or one)."""
    from slimrl.rollout import pdl
    from slimrl.rollout.fused_decode import default_choices

    saved = pdl.MODE
    choices = copy.deepcopy(tuned) if tuned is not None else default_choices()
    flags = {}
    try:
        for item in filter(None, variant.split(",")):
            key, value = item.split("=")
            if key == "pdl":
                pdl.MODE = int(value)
                continue
            if key == "deterministic":
                flags["deterministic"] = bool(int(value))
                continue
            target, field = key.split(".")
            group, _, rows = target.partition("@")
            buckets = [int(rows)] if rows else [b for b in choices[group] if b <= 256]
            for bucket in buckets:
                setattr(choices[group][bucket], field, int(value))
        yield choices, flags
    finally:
        pdl.MODE = saved


def prefill_profile(engine, batch: int) -> dict:
    """Kernels of one prefill of `batch` 256-token prompts (a rollout of one new token), by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    from slimrl.rollout.sampling import SamplingParams

    params = SamplingParams(temperature=1.0, seed=0)
    engine.generate(prompts_for(batch), params, max_new_tokens=1)
    start = sync_time()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts_for(batch), params, max_new_tokens=1)
        torch.cuda.synchronize()
    seconds = sync_time() - start
    rows = sorted(((e.self_device_time_total, e.count, e.key[:90]) for e in prof.key_averages()
                   if getattr(e, "self_device_time_total", 0)), reverse=True)  # fmt: skip
    return {"batch": batch, "wall_s_profiled": round(seconds, 3), "gpu_ms": round(sum(r[0] for r in rows) / 1000, 1),
            "top": [{"ms": round(t / 1000, 2), "n": n, "kernel": k} for t, n, k in rows[:25]]}  # fmt: skip


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default=os.path.join(os.environ.get("OUT", "."), "rollout.json"))
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--baseline-tokens", type=int, default=64)
    sections = ["hf", "cb", "greedy", "profile", "engine", "variants", "ungrouped", "unfused", "reuse", "prefill"]
    parser.add_argument("--skip", nargs="*", default=[], choices=sections)
    parser.add_argument("--fp32-check", action="store_true", help="also compare greedy output in fp32 (slow)")
    parser.add_argument(
        "--tune",
        nargs="*",
        default=None,
        metavar="GROUP",
        help="time the fused kernels' candidate settings first (all groups, or those named)",
    )
    parser.add_argument("--tune-rows", type=int, nargs="+", default=[8, 64, 256], help="row counts to tune at")
    parser.add_argument(
        "--variants",
        nargs="*",
        default=["pdl=0"],
        help="engine settings to time beside the defaults, each KEY=VALUE[,KEY=VALUE]: pdl (pdl.MODE: 0 ordinary "
        "launches), GROUP[@ROWS].FIELD (a KernelChoice field of the fused kernels, e.g. down@64.gemm=1)",
    )
    args = parser.parse_args(argv)

    import peft
    import transformers

    from slimrl.rollout import pdl
    from slimrl.rollout.engine import RolloutEngine
    from slimrl.rollout.sampling import SamplingParams

    result = {
        "workload": "W2",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "prompt_tokens": PROMPT,
        "new_tokens": NEW,
        "sampling": "temperature 1.0, top_k 0, top_p 1.0, no EOS",
        "baseline_note": f"hf and cb generate {args.baseline_tokens} new tokens per sequence (not {NEW}) to fit the "
        "device time; their per-step cost is dominated by host overhead, so tokens/s changes little with length",
    }

    def save():
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(json.dumps(result), flush=True)

    result["copy_bandwidth_GBps"] = round(copy_bandwidth() / 1e9, 1)
    model = build_model()
    result["weight_GiB"] = round(weight_bytes(model) / 2**30, 3)
    result["kernel_self_check"] = check = kernel_self_check()
    try:
        check["fused"] = fused_self_check(model)
    except Exception as err:  # noqa: BLE001 - a fused kernel that fails to run is turned off below
        check["fused"] = {"ok": False, "error": f"{type(err).__name__}: {str(err)[:300]}"}
        traceback.print_exc()
    fused_ok = check["lora_ok"] and check["attention_ok"] and check["fused"]["ok"]
    try:
        check["sampling"] = sampling_self_check()
    except Exception as err:  # noqa: BLE001 - a sampler that fails to run is turned off below
        check["sampling"] = {"ok": False, "error": f"{type(err).__name__}: {str(err)[:300]}"}
        traceback.print_exc()
    save()
    tuned = None
    if args.tune is not None:
        result["tune_us"], best = tune(model, args.tune or ("attention", *TUNE_CANDIDATES), args.tune_rows)
        if best:
            tuned = tuned_choices(best)
            result["tuned_choices"] = {f"{g}_{b}": dataclasses.asdict(c) for g, bs in tuned.items() for b, c in
                                       bs.items()}  # fmt: skip
            check["fused_tuned"] = fused_self_check(model, tuned)
            if not check["fused_tuned"]["ok"]:  # reported; the engine keeps the defaults
                tuned = None
        save()

    def new_engine(choices=None, **flags):
        """An engine with the kernels the self-checks passed (flags override), on these fused-kernel choices."""
        flags = {"grouped_decode": check["lora_ok"], "triton_attention": check["attention_ok"],
                 "fused_decode": fused_ok, "fused_sampling": check["sampling"]["ok"], **flags}  # fmt: skip
        built = RolloutEngine(model, max_batch_size=max(args.batches), **flags)
        if choices is not None:
            built._fused.choices = choices
        return built

    engine = new_engine()
    result["engine_config"] = {"grouped_decode": engine.grouped_decode, "tf32_adapters": engine.tf32,
                               "triton_attention": engine._attention_kernel is not None,
                               "fused_decode": engine._fused is not None,
                               "fused_sampling": engine._sampling_kernel is not None,
                               "cuda_graphs": engine.use_graphs, "compile": engine.use_compile,
                               "pdl_mode": pdl.options(torch.device("cuda"))["PDL"] if fused_ok else 0}  # fmt: skip
    kv_per_token = 2 * 28 * 2 * 128 * 2
    result["roofline"] = {}
    for batch in args.batches:
        mean_context = PROMPT + NEW / 2
        step_bytes = weight_bytes(model) + batch * mean_context * kv_per_token
        result["roofline"][f"B{batch}"] = round(batch / (step_bytes / (result["copy_bandwidth_GBps"] * 1e9)))
    save()

    def attempt(key, fn, *fn_args):
        try:
            result[key] = fn(*fn_args)
        except Exception as err:  # noqa: BLE001 - a failing section is reported and the others still run
            result[key] = f"ERR {type(err).__name__}: {str(err)[:300]}"
            traceback.print_exc()
        save()

    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=0)
    if tuned is not None and engine._fused is not None and "engine" not in args.skip:
        # the shipped defaults first, then the engine on the settings just tuned (a fresh engine: graphs bake them)
        result["engine_default_choices"] = {f"B{b}": engine_run(engine, b, params, NEW) for b in args.batches}
        engine.release(keep_graph=False)
        engine = new_engine(tuned)
        save()
    if "engine" not in args.skip:
        result["engine"] = {}
        for batch in args.batches:
            start = time.perf_counter()
            try:
                result["engine"][f"B{batch}"] = engine_run(engine, batch, params, NEW)
                result["engine"][f"B{batch}"]["first_call_s"] = round(time.perf_counter() - start, 1)
            except Exception as err:  # noqa: BLE001
                result["engine"][f"B{batch}"] = f"ERR {type(err).__name__}: {str(err)[:300]}"
                traceback.print_exc()
            save()
        compiled = [*engine._blocks, engine._choose, *(engine._grouped[:4] if engine._grouped else [])]
        result["engine_compile_failed"] = [getattr(f, "failed", None) for f in compiled]
    if "variants" not in args.skip and engine._fused is not None and args.variants:
        engine.release(keep_graph=False)
        result["engine_variants"] = {}
        for variant in args.variants:
            result["engine_variants"][variant] = timed = {}
            try:
                with engine_variant(variant, tuned) as (choices, flags):
                    other = new_engine(choices, **flags)
                    for batch in args.batches:
                        timed[f"B{batch}"] = engine_run(other, batch, params, NEW)
                        save()
                    other.release(keep_graph=False)
                    del other
            except Exception as err:  # noqa: BLE001 - a failing variant is reported, the others still run
                timed["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                traceback.print_exc()
            save()
    if "reuse" not in args.skip and engine._fused is not None:

        def reuse():
            """release() frees the cache; the next rollout of the same shape replays the kept graph."""
            batch = args.batches[0]
            engine.generate(prompts_for(batch), params, max_new_tokens=NEW)
            before = torch.cuda.memory_allocated()
            engine.release()
            freed = before - torch.cuda.memory_allocated()
            with torch.no_grad():  # an optimizer-like in-place edit of the adapter between rollouts
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.mul_(1.01)
            start = sync_time()
            out = engine.generate(prompts_for(batch), params, max_new_tokens=NEW)
            return {"batch": batch, "freed_GiB": round(freed / 2**30, 3), "captures": out.stats.get("captures", 0),
                    "capture_s": round(out.stats["capture_s"], 4), "s": round(sync_time() - start, 3)}  # fmt: skip

        attempt("release_then_reuse", reuse)
    if "prefill" not in args.skip:
        attempt("prefill_profile", prefill_profile, engine, max(args.batches))
    if "unfused" not in args.skip and engine._fused is not None:
        engine.release(keep_graph=False)
        unfused = new_engine(fused_decode=False, fused_sampling=False)
        result["engine_unfused"] = {}
        for batch in args.batches:
            attempt_key = f"B{batch}"
            try:
                result["engine_unfused"][attempt_key] = engine_run(unfused, batch, params, NEW)
            except Exception as err:  # noqa: BLE001
                result["engine_unfused"][attempt_key] = f"ERR {type(err).__name__}: {str(err)[:300]}"
            save()
        unfused.release(keep_graph=False)
        del unfused
    if "greedy" not in args.skip:
        attempt("greedy_bf16", greedy_match, model, engine)
    if "profile" not in args.skip:
        for batch in (64, 256):
            if batch in args.batches:
                engine.generate(prompts_for(batch), params, max_new_tokens=8)
                attempt(f"decode_graph_B{batch}", graph_profile, engine)
    if "ungrouped" not in args.skip and engine.grouped_decode and 64 in args.batches:
        engine.release()
        plain = RolloutEngine(model, max_batch_size=64, grouped_decode=False)
        attempt("engine_ungrouped_B64", engine_run, plain, 64, params, NEW)
        plain.release()
        del plain
    engine.release(keep_graph=False)
    for name, runner in (("hf", hf_generate_run), ("cb", cb_run)):
        if name in args.skip:
            continue
        result[name] = {}
        for batch in args.batches:
            try:
                result[name][f"B{batch}"] = runner(model, batch, args.baseline_tokens)
            except Exception as err:  # noqa: BLE001 - a failing baseline is reported, not fatal
                result[name][f"B{batch}"] = f"ERR {type(err).__name__}: {str(err)[:200]}"
            save()
    if args.fp32_check:
        model = model.float()
        torch.backends.cuda.matmul.allow_tf32 = False
        flags = dict(grouped_decode=check["lora_ok"], triton_attention=check["attention_ok"])
        attempt("greedy_fp32", lambda: greedy_match(model, RolloutEngine(model, max_batch_size=8, **flags)))
    return result


if __name__ == "__main__":
    main()
