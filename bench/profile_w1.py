"""Where W1's training phase spends its GPU time: slimrl's step (compute_loss + backward, as bench/grpo_memory.py
times it) under torch.profiler at each length, kernels grouped into families (GEMMs, attention, element-wise, norms,
copies and offload, the loss's log-softmax), the top kernels by time, and the step's wall time beside the kernels'
sum (the gap is launch and host time). TRL's step is profiled the same way with --trainers trl,slimrl.
Where the GPU waits: the step's idle time on the GPU timeline and its largest gaps (the kernels either side), the CUDA
runtime calls (launches, synchronisations, copies, allocations: count and host ms), and, with --stacks, the Python lines
that make the host wait for the GPU (one more step under torch's CUDA sync debug mode); with --python a cProfile of one
more step; with --gaps why the GPU idles (the host still busy, and where, or a launch waiting on another stream);
with --graph-forward the model's gradient-free forward timed eagerly and as a CUDA graph replay.

    python bench/profile_w1.py $OUT/profile_w1.json 1024 4096 32768 [--trainers slimrl] [--top 25] [--stacks] [--python]
        [--graph-forward] [--gaps]
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
from grpo_memory import B, P, build_model, build_trainer, make_inputs, step_attention  # noqa: E402

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


def idle_gaps(intervals: list[tuple[float, float, str]], top: int = 10) -> dict:
    """GPU activities as (start_us, end_us, name): the span, the time no activity runs (overlaps merged), and the `top`
    largest gaps with the activities either side."""
    if not intervals:
        return {"span_ms": 0.0, "idle_ms": 0.0, "gaps": []}
    ordered = sorted(intervals)
    gaps, idle = [], 0.0
    reach, last = ordered[0][1], ordered[0][2]
    for start, end, name in ordered[1:]:
        if start > reach:
            idle += start - reach
            gaps.append((start - reach, last, name))
        if end >= reach:
            reach, last = end, name
    gaps.sort(key=lambda gap: -gap[0])
    shown = [{"ms": round(g / 1e3, 3), "after": a[:80], "before": b[:80]} for g, a, b in gaps[:top]]
    return {"span_ms": round((reach - ordered[0][0]) / 1e3, 2), "idle_ms": round(idle / 1e3, 2), "gaps": shown}


def runtime_calls(calls: list[tuple[str, float]]) -> dict:
    """(name, host microseconds) of CUDA runtime/driver calls -> {name: {"calls", "ms"}}, most time first."""
    table: dict[str, list[float]] = {}
    for name, us in calls:
        entry = table.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += us
    ranked = sorted(table.items(), key=lambda item: -item[1][1])
    return {name: {"calls": n, "ms": round(us / 1e3, 2)} for name, (n, us) in ranked}


OURS = re.compile(r"^(?:.*/)?(slimrl|trl|transformers|peft|bench)/")  # a frame's file in one of these, and its prefix


def call_site(stack: list[str]) -> str:
    """The innermost frames (up to 3, innermost last) of a Python stack that are in slimrl, trl, transformers, peft or
    the bench."""
    ours = [OURS.sub(r"\1/", frame) for frame in stack if OURS.match(frame)]
    return " <- ".join(reversed(ours[-3:])) if ours else (stack[-1] if stack else "?")


def sync_sites(step) -> dict:
    """{call site: count} of the operations that make the host wait for the GPU in one `step()`, from torch's CUDA
    sync debug mode (each such operation warns; the Python stack at the warning names the line)."""
    import traceback
    import warnings

    sites: dict[str, int] = {}

    def hook(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = [f"{f.filename}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]]
            site = call_site(frames)
            sites[site] = sites.get(site, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return dict(sorted(sites.items(), key=lambda item: -item[1]))


def python_profile(step, top: int = 40) -> dict:
    """cProfile of one `step()`: the `top` functions by own time and by time including callees (host time only; the
    GPU runs behind)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    step()
    torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    def label(key) -> str:
        return f"{Path(key[0]).name}:{key[1]} {key[2]}"

    rows = []
    for key, (_, calls, own, total, callers) in stats.items():
        named = sorted(callers.items(), key=lambda item: -item[1][1])[:4]
        rows.append({"function": label(key), "calls": calls, "own_ms": round(own * 1e3, 2),
                     "total_ms": round(total * 1e3, 2), "callers": {label(c): v[1] for c, v in named}})  # fmt: skip
    return {"by_own": sorted(rows, key=lambda row: -row["own_ms"])[:top],
            "by_total": sorted(rows, key=lambda row: -row["total_ms"])[:top]}  # fmt: skip


def top_kernels(run, top: int = 6) -> list[list]:
    """[name, ms, calls] of the `top` kernels of one `run()` by device time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    ranked = sorted(kernel_times(prof.events()).items(), key=lambda item: -sum(item[1]))[:top]
    return [[name[:100], round(sum(times), 2), len(times)] for name, times in ranked]


def kernel_times(events) -> dict[str, list[float]]:
    """{kernel name: the ms of each of its launches} of a profile's events."""
    kernels: dict[str, list[float]] = {}
    for event in events:
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.device_time / 1e3)  # us -> ms
    return kernels


def graph_probe(model, length: int, iterations: int = 5) -> dict:
    """The model's gradient-free forward (decoder only, W1's batch, no mask, eval mode) timed eagerly and as a CUDA
    graph replay (how much of the forward's wall time is the host's), with the top kernels of each. The probe is not
    a training step."""
    from slimrl.models.unwrap import unwrap_model

    decoder = unwrap_model(model).model
    ids = torch.randint(10, model.config.vocab_size, (B, P + length), device="cuda")
    was_training = model.training
    model.eval()

    def forward():
        return decoder(input_ids=ids, use_cache=False).last_hidden_state

    def timed(run) -> float:
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iterations):
            run()
        end.record()
        torch.cuda.synchronize()
        return round(start.elapsed_time(end) / iterations, 2)

    result = {}
    try:
        with torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    forward()
            torch.cuda.current_stream().wait_stream(side)
            result["eager_ms"] = timed(forward)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                forward()
            result["graph_ms"] = timed(graph.replay)
            result["eager_top"], result["graph_top"] = top_kernels(forward), top_kernels(graph.replay)
            del graph
    except RuntimeError as error:  # a capture the forward does not allow: reported, not hidden
        result["error"] = str(error).splitlines()[0][:300]
    finally:
        model.train(was_training)
        torch.cuda.empty_cache()
    return result


GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# what a host thread is seen doing: Python calls (traced with stacks), torch ops and CUDA runtime/driver calls
HOST_CATEGORIES = ("python_function", "cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")
RUNTIME_CALL = re.compile(r"cu[A-Z]|cuda")
GAP_SIZES = ((5.0, "<5us"), (50.0, "5-50us"), (500.0, "50-500us"), (5000.0, "0.5-5ms"), (float("inf"), ">5ms"))


class HostStacks:
    """What a host thread was in at a time (Python functions when traced `with_stack=True`, torch ops, CUDA runtime
    calls), from a trace's host events: one sweep turns each thread's nested calls into segments, each with its
    stack."""

    def __init__(self, events: list[dict]):
        import bisect

        self._bisect = bisect.bisect_right
        per_thread: dict = {}
        for event in events:
            if event.get("cat") in HOST_CATEGORIES:
                per_thread.setdefault(event.get("tid"), []).append(
                    (float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0)), event["name"]))
        self.segments: dict = {}
        for tid, calls in per_thread.items():
            calls.sort(key=lambda call: (call[0], -call[1]))
            starts, stacks, open_calls = [], [], []
            for start, end, name in calls:
                while open_calls and open_calls[-1][0] <= start:  # calls that ended before this one began
                    ended = open_calls.pop()[0]
                    starts.append(ended)
                    stacks.append(tuple(frame for _, frame in open_calls))
                open_calls.append((end, name))
                starts.append(start)
                stacks.append(tuple(frame for _, frame in open_calls))
            while open_calls:
                ended = open_calls.pop()[0]
                starts.append(ended)
                stacks.append(tuple(frame for _, frame in open_calls))
            self.segments[tid] = (starts, stacks)

    def at(self, tid, time: float) -> tuple:
        """The stack (outermost first) of thread `tid` at `time`."""
        starts, stacks = self.segments.get(tid, ((), ()))
        index = self._bisect(starts, time) - 1
        return stacks[index] if index >= 0 else ()


def trace_frame(name: str) -> str:
    """A python_function event's name (`/path/file.py(123): function`) as call_site's frames read it."""
    match = re.match(r"(.*)\((\d+)\): (.*)", name)
    return f"{match[1]}:{match[2]} {match[3]}" if match else name


def trace_activities(events: list[dict]) -> tuple[dict, list]:
    """({correlation: (when the launching call returned, its thread)}, GPU activities as (start, end, name, stream,
    correlation) in start order) of a Chrome trace's events."""
    launches, device = {}, []
    for event in events:
        category = event.get("cat")
        if category in ("cuda_runtime", "cuda_driver"):
            correlation = event.get("args", {}).get("correlation")
            if correlation is not None:
                launches[correlation] = (float(event["ts"]) + float(event.get("dur", 0)), event.get("tid"))
        elif category in GPU_CATEGORIES:
            start = float(event["ts"])
            device.append((start, start + float(event.get("dur", 0)), event["name"],
                           event.get("args", {}).get("stream"), event.get("args", {}).get("correlation")))
    device.sort(key=lambda activity: activity[0])
    return launches, device


def launch_sites(launches: dict, device: list, stacks: HostStacks, top: int) -> dict:
    """Where the GPU's activities were launched (memsets apart): count and GPU ms per call site, most first."""
    table: dict[str, list] = {}
    for start, end, name, _, correlation in device:
        if correlation in launches:
            launched, tid = launches[correlation]
            frames = [trace_frame(frame) for frame in stacks.at(tid, launched - 0.5)]
            site = call_site([frame for frame in frames if not RUNTIME_CALL.match(frame)])
            entry = table.setdefault(f"{'memset' if name.startswith('Memset') else 'launch'}: {site}", [0, 0.0])
            entry[0] += 1
            entry[1] += end - start
    by_count = sorted(table.items(), key=lambda item: -item[1][0])[:top]
    return {site: {"count": n, "gpu_ms": round(us / 1e3, 2)} for site, (n, us) in by_count}


def host_site(frames: list[str]) -> str:
    """A host sample's site: the innermost frames of ours, and the calls the host was in when those are not ours."""
    site = call_site(frames) if any(OURS.match(frame) for frame in frames) else ""
    if frames and not OURS.match(frames[-1]):
        site += " | " + " <- ".join(OURS.sub(r"\1/", frame)[:60] for frame in reversed(frames[-2:]))
    return site


def gap_causes(trace: dict, top: int = 15, samples: int = 8, min_us: float = 5.0) -> dict:
    """Why the GPU idles, from a Chrome trace of one step (torch.profiler's export, `with_stack=True`). Each gap of at
    least `min_us` between GPU activities (all streams merged) is split at the moment the host's call launching the
    activity after it returned: the part before is **host** time (the GPU had run dry and the host was still busy: the
    gap's host time is charged, in `samples` equal slices, to the innermost slimrl/TRL/transformers/peft frames the
    launching thread was in at each slice), the part after is **waiting** (launched in time, the activity waited for
    another stream's work: charged to the activity on another stream that ended last before it started, or to the
    activity after the gap if none)."""
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    launches, device = trace_activities(events)
    stacks = HostStacks(events)
    host_sites: dict[str, float] = {}
    wait_sites: dict[str, float] = {}
    totals = {"host": 0.0, "wait": 0.0}
    reach = device[0][1] if device else 0.0
    ends_by_stream = {device[0][3]: (device[0][1], device[0][2])} if device else {}
    sizes = {label: [0, 0.0] for _, label in GAP_SIZES}
    for start, end, name, stream, correlation in device[1:]:
        gap = start - reach
        if gap > 0:
            bucket = sizes[next(label for bound, label in GAP_SIZES if gap < bound)]
            bucket[0], bucket[1] = bucket[0] + 1, bucket[1] + gap
        if gap >= min_us:
            launched, tid = launches.get(correlation, (start, None))
            host = max(0.0, min(launched, start) - reach)
            totals["host"], totals["wait"] = totals["host"] + host, totals["wait"] + gap - host
            for k in range(samples if host > 0 else 0):
                site = host_site([trace_frame(frame) for frame in stacks.at(tid, reach + (k + 0.5) * host / samples)])
                host_sites[site] = host_sites.get(site, 0.0) + host / samples
            if gap - host > 0:
                others = [(t_end, other) for other_stream, (t_end, other) in ends_by_stream.items()
                          if other_stream != stream and t_end <= start]  # fmt: skip
                key = f"{(max(others)[1] if others else f'(no other stream) {name}')[:70]} -> {name[:50]}"
                wait_sites[key] = wait_sites.get(key, 0.0) + gap - host
        ends_by_stream[stream] = max(ends_by_stream.get(stream, (0.0, "")), (end, name))
        reach = max(reach, end)

    def ranked(table):
        return {k: round(v / 1e3, 2) for k, v in sorted(table.items(), key=lambda item: -item[1])[:top]}

    return {"host_ms": round(totals["host"] / 1e3, 2), "waiting_ms": round(totals["wait"] / 1e3, 2),
            "host_sites_ms": ranked(host_sites), "waiting_on_ms": ranked(wait_sites),
            "gaps_by_size": {label: {"count": n, "ms": round(us / 1e3, 2)} for label, (n, us) in sizes.items()},
            "launch_sites": launch_sites(launches, device, stacks, 2 * top)}  # fmt: skip


def traced_gaps(step, top: int) -> dict:
    """Two more `step()`s under torch.profiler, exported and read back by `gap_causes`: one plain (the split of the
    idle time into host and waiting as the step runs) and one with Python stacks (where the host time goes; the
    Python tracer slows the host, so its host time is larger than the plain step's)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    result = {}
    for label, with_stack in (("plain", False), ("with_stacks", True)):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=with_stack) as prof:
            step()
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "trace.json"
            prof.export_chrome_trace(str(path))
            trace = json.loads(path.read_text())
        result[label] = gap_causes(trace, top)
        del trace, prof
    return result


def host_view(events) -> dict:
    """The GPU's idle gaps and the CUDA runtime calls of a profiled step."""
    device = [(e.time_range.start, e.time_range.end, e.name) for e in events
              if e.device_type == torch.autograd.DeviceType.CUDA]  # fmt: skip
    calls = [(e.name, e.time_range.end - e.time_range.start) for e in events
             if e.device_type == torch.autograd.DeviceType.CPU and RUNTIME_CALL.match(e.name)]  # fmt: skip
    return {"gpu": idle_gaps(device), "runtime": runtime_calls(calls)}


def profile_step(trainer, length: int, top: int, stacks: bool = False, python: bool = False,
                 gaps: bool = False) -> dict:
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
    kernels = kernel_times(prof.events())
    by_family: dict[str, float] = {}
    for name, times in kernels.items():
        by_family[family(name)] = by_family.get(family(name), 0.0) + sum(times)
    ranked = sorted(kernels.items(), key=lambda item: -sum(item[1]))[:top]
    kernel_ms = sum(by_family.values())
    result = {
        "step_ms": round(start.elapsed_time(end), 2),
        "kernel_ms": round(kernel_ms, 2),
        "families_ms": {k: round(v, 2) for k, v in sorted(by_family.items(), key=lambda item: -item[1])},
        "top": [{"name": name[:160], "family": family(name), "ms": round(sum(times), 2), "calls": len(times)}
                for name, times in ranked],  # fmt: skip
        "host": host_view(prof.events()),
    }
    if stacks:
        result["sync_sites"] = sync_sites(step)
    if python:
        result["python"] = python_profile(step, top)
    if gaps:
        result["gap_causes"] = traced_gaps(step, top)
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the JSON report")
    parser.add_argument("lengths", nargs="+", type=int)
    parser.add_argument("--trainers", default="slimrl")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--stacks", action="store_true", help="one more step in CUDA sync debug mode: who waits")
    parser.add_argument("--python", action="store_true", help="one more step under cProfile: where the host time goes")
    parser.add_argument("--graph-forward", action="store_true",
                        help="also time the gradient-free forward eagerly and as a CUDA graph replay")  # fmt: skip
    parser.add_argument("--gaps", action="store_true",
                        help="one more step traced with Python stacks: the GPU's idle split into host and waiting")
    args = parser.parse_args(argv)
    report = {"workload": "W1 training phase, profiled", "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "results": {}}  # fmt: skip
    model = build_model()
    for kind in args.trainers.split(","):
        trainer = build_trainer(kind, model, max(args.lengths), 0.0)
        for length in args.lengths:
            result = profile_step(trainer, length, args.top, args.stacks, args.python, args.gaps)
            if args.graph_forward:
                result["graph_forward"] = graph_probe(trainer.model, length)
            report["results"][f"{kind}_L{length}"] = result
            shown = {k: result[k] for k in ("step_ms", "kernel_ms", "families_ms", "sync_sites", "gap_causes")
                     if k in result}
            shown["idle_ms"] = result["host"]["gpu"]["idle_ms"]
            shown["graph_forward"] = result.get("graph_forward")
            print(json.dumps({f"{kind}_L{length}": shown}), flush=True)
            Path(args.out).write_text(json.dumps(report, indent=2))
        del trainer
        torch.cuda.empty_cache()
    return report


if __name__ == "__main__":
    main()
