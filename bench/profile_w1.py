"""Where W1's training phase spends its GPU time: slimrl's step (compute_loss + backward, as bench/grpo_memory.py
times it) under torch.profiler at each length, kernels grouped into families (GEMMs, attention, element-wise, norms,
copies and offload, the loss's log-softmax), the top kernels by time, and the step's wall time beside the kernels'
sum (the gap is launch and host time). TRL's step is profiled the same way with --trainers trl,slimrl.

    python bench/profile_w1.py $OUT/profile_w1.json 1024 4096 32768 [--trainers slimrl] [--top 25]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import torch  # noqa: E402
from grpo_memory import build_model, build_trainer, make_inputs, step_attention  # noqa: E402

# First match wins: a kernel's family from its name (cuBLAS/CUTLASS GEMMs, flash/efficient/cuDNN attention, ...)
FAMILIES = (
    ("attention", r"flash|fmha|attention|sdpa|cudnn_generated"),
    ("gemm", r"gemm|cutlass|sm90_xmma|sm80_xmma|cublas|ampere_|hopper_|nvjet|matmul"),
    ("norm", r"norm|rsqrt"),
    ("copy/offload", r"memcpy|memset|copy|cat|DtoH|HtoD|fill"),
    ("log-softmax/loss", r"softmax|logsumexp|log_softmax|cross_entropy|gather"),
    ("reduction", r"reduce|sum_|mean|max_"),
    ("elementwise", r"elementwise|vectorized|unrolled|triton|silu|mul|add"),
)


def family(name: str) -> str:
    for label, pattern in FAMILIES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def profile_step(trainer, length: int, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    model = trainer.model
    inputs = make_inputs(length)

    def step():
        model.zero_grad(set_to_none=True)
        with step_attention(trainer, "as-trainer"):
            loss = trainer.compute_loss(model, dict(inputs))
            loss.backward()

    step()  # warm-up: compiles, autotunes, allocator
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.device_time / 1e3)  # us -> ms
    by_family: dict[str, float] = {}
    for name, times in kernels.items():
        by_family[family(name)] = by_family.get(family(name), 0.0) + sum(times)
    ranked = sorted(kernels.items(), key=lambda item: -sum(item[1]))[:top]
    kernel_ms = sum(by_family.values())
    return {
        "step_ms": round(start.elapsed_time(end), 2),
        "kernel_ms": round(kernel_ms, 2),
        "families_ms": {k: round(v, 2) for k, v in sorted(by_family.items(), key=lambda item: -item[1])},
        "top": [{"name": name[:160], "family": family(name), "ms": round(sum(times), 2), "calls": len(times)}
                for name, times in ranked],  # fmt: skip
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the JSON report")
    parser.add_argument("lengths", nargs="+", type=int)
    parser.add_argument("--trainers", default="slimrl")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    report = {"workload": "W1 training phase, profiled", "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "results": {}}  # fmt: skip
    model = build_model()
    for kind in args.trainers.split(","):
        trainer = build_trainer(kind, model, max(args.lengths), 0.0)
        for length in args.lengths:
            result = profile_step(trainer, length, args.top)
            report["results"][f"{kind}_L{length}"] = result
            print(json.dumps({f"{kind}_L{length}": {k: result[k] for k in ("step_ms", "kernel_ms", "families_ms")}}),
                  flush=True)  # fmt: skip
            Path(args.out).write_text(json.dumps(report, indent=2))
        del trainer
        torch.cuda.empty_cache()
    return report


if __name__ == "__main__":
    main()
