"""bench/profile_w1.py sorts CUDA kernels into families by name, and bench/grpo_memory.py parses its variants and runs
each side in a process of its own under --isolate; the GPU runs themselves are benchmarks (no CPU test)."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("datasets")  # grpo_memory (imported by the script) builds TRL trainers


def load():
    path = Path(__file__).resolve().parents[2] / "bench" / "profile_w1.py"
    spec = importlib.util.spec_from_file_location("profile_w1", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNN", "gemm"),
        ("pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention"),
        ("Memcpy DtoH (Device -> Pinned)", "copy/offload"),
        ("triton_red_fused__to_copy_mean_mul_pow_rsqrt_0", "norm"),
        ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "log-softmax/loss"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel>", "elementwise"),
        ("some_unknown_kernel", "other"),
    ],
)
def test_kernels_fall_into_their_family(name, expected):
    assert load().family(name) == expected


def test_grpo_memory_variants_parse_fast_lora_and_its_attention_switch():
    """bench/grpo_memory.py's --variants: the fourth field 0 / 1 / noattn (fast LoRA with eager RoPE), the fifth
    keep_attention_tokens; --trainers "" runs the variants alone."""
    path = Path(__file__).resolve().parents[2] / "bench" / "grpo_memory.py"
    spec = importlib.util.spec_from_file_location("grpo_memory_variants", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.parse_args(["1024", "--trainers", "slimrl", "--variants", "auto/8192/1/noattn;8/0/0/0;auto/8192/1"])
    runs = module.planned_runs(args)
    assert [name for name, _ in runs] == ["slimrl", "slimrl[auto/8192/1/noattn]", "slimrl[8/0/0/0]",
                                          "slimrl[auto/8192/1]"]  # fmt: skip
    assert runs[1][1] == {"num_chunks": "auto", "mlp_tile_tokens": 8192, "offload_checkpoints": True,
                          "fast_lora": True, "attention": False}  # fmt: skip
    assert runs[2][1]["fast_lora"] is False and "fast_lora" not in runs[3][1]
    args = module.parse_args(["32768", "--trainers", "", "--variants", "auto/8192/1/1/0;auto/8192/1/1/32768"])
    runs = module.planned_runs(args)
    assert [name for name, _ in runs] == ["slimrl[auto/8192/1/1/0]", "slimrl[auto/8192/1/1/32768]"]
    assert [settings["keep_attention_tokens"] for _, settings in runs] == [0, 32768]
    args = module.parse_args(["1024", "--trainers", "", "--variants", "auto/8192/1/1/0;auto/8192/1/1/4096;"
                              "auto/8192/1/1/0;auto/8192/1/1/4096;auto/8192/1/1/0"])  # fmt: skip
    names = [name for name, _ in module.planned_runs(args)]  # alternating A/B: every run keeps its own result
    assert names == ["slimrl[auto/8192/1/1/0]", "slimrl[auto/8192/1/1/4096]", "slimrl[auto/8192/1/1/0]#2",
                     "slimrl[auto/8192/1/1/4096]#2", "slimrl[auto/8192/1/1/0]#3"]  # fmt: skip


def test_timed_iterations_runs_one_untimed_then_the_repeats_and_takes_the_median():
    import gc
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from common import timed_iterations

    calls, gc_ms = [], []

    def iteration():
        calls.append(1)
        cycles = [[] for _ in range(20000)]  # garbage for the collector, whatever an earlier test froze
        for item in cycles:
            item.append(item)
        del cycles, item
        gc.collect()  # one full collection per iteration: each timed one records its pause
        return len(calls)

    seconds, every, last = timed_iterations(iteration, repeats=3, gc_ms=gc_ms)
    assert len(calls) == 4 and last == 4 and len(every) == 3 and seconds == sorted(every)[1]
    assert len(gc_ms) == 3 and all(ms > 0 for ms in gc_ms)


def test_idle_gaps_merge_overlaps_and_rank_the_gaps():
    module = load()
    view = module.idle_gaps([(0, 10, "a"), (5, 12, "b"), (20, 30, "c"), (30, 31, "d"), (131, 140, "e")], top=2)
    assert view["span_ms"] == 0.14 and view["idle_ms"] == round((8 + 100) / 1e3, 2)
    assert view["gaps"] == [{"ms": 0.1, "after": "d", "before": "e"}, {"ms": 0.008, "after": "b", "before": "c"}]
    assert module.idle_gaps([]) == {"span_ms": 0.0, "idle_ms": 0.0, "gaps": []}


def test_runtime_calls_count_and_rank_by_host_time():
    calls = [("cudaLaunchKernel", 5.0), ("cudaStreamSynchronize", 900.0), ("cudaLaunchKernel", 7.0)]
    table = load().runtime_calls(calls)
    assert list(table) == ["cudaStreamSynchronize", "cudaLaunchKernel"]
    assert table["cudaLaunchKernel"] == {"calls": 2, "ms": 0.01}


def test_call_site_keeps_the_innermost_frames_of_ours():
    stack = ["runpy.py:1 main", "/b/bench/grpo_memory.py:9 iteration", "/x/slimrl/trainers/grpo/step.py:42 loss",
             "/x/slimrl/ops/loss.py:7 nll", "/t/torch/_tensor.py:10 item"]  # fmt: skip
    module = load()
    assert module.call_site(stack) == ("slimrl/ops/loss.py:7 nll <- slimrl/trainers/grpo/step.py:42 loss"
                                       " <- bench/grpo_memory.py:9 iteration")  # fmt: skip
    assert module.call_site(["a.py:1 f"]) == "a.py:1 f" and module.call_site([]) == "?"


def test_gap_causes_split_each_gap_into_host_time_and_waiting_and_name_them():
    def py(ts, dur, name, tid=1):
        return {"cat": "python_function", "ts": 10 * ts, "dur": 10 * dur, "name": name, "tid": tid}

    def gpu(ts, dur, name, correlation, stream=7, cat="kernel"):
        return {"cat": cat, "ts": 10 * ts, "dur": 10 * dur, "name": name,
                "args": {"stream": stream, "correlation": correlation}}  # fmt: skip

    def launch(ts, correlation, tid=1):
        return {"cat": "cuda_runtime", "ts": 10 * ts, "dur": 20, "name": "cudaLaunchKernel", "tid": tid,
                "args": {"correlation": correlation}}  # fmt: skip

    trace = {"traceEvents": [
        py(0, 400, "/x/slimrl/models/checkpointing.py(10): forward"),
        py(20, 60, "/x/slimrl/models/checkpointing.py(20): _park"),
        py(30, 40, "<built-in method empty of type object>"),
        launch(1, 1), gpu(5, 5, "k1", 1),  # k1 runs 5-10
        launch(98, 2), gpu(100, 10, "k2", 2),  # 10-100: k2's launch returns at 100, so the host's
        launch(105, 3), gpu(150, 20, "copy", 3, stream=9, cat="gpu_memcpy"),  # 110-150: launched in time: waiting
        launch(112, 4), gpu(170, 5, "k3", 4),  # right after the copy: no gap
        launch(116, 5), gpu(300, 5, "k4", 5),  # 175-300: launched in time, waiting; the copy ended last elsewhere
    ]}  # fmt: skip
    causes = load().gap_causes(trace, samples=10)
    assert causes["host_ms"] == 0.9 and causes["waiting_ms"] == 1.65
    # 10-100 in slices of 9 (middles 14.5 ... 95.5): in forward alone 3, in _park 2, in torch.empty inside it 5
    assert causes["host_sites_ms"] == {
        "slimrl/models/checkpointing.py:20 _park <- slimrl/models/checkpointing.py:10 forward"
        " | <built-in method empty of type object> <- slimrl/models/checkpointing.py:20 _park": 0.45,
        "slimrl/models/checkpointing.py:10 forward": 0.27,
        "slimrl/models/checkpointing.py:20 _park <- slimrl/models/checkpointing.py:10 forward": 0.18,
    }
    assert causes["waiting_on_ms"] == {"copy -> k4": 1.25, "k2 -> copy": 0.4}
    assert causes["gaps_by_size"]["0.5-5ms"] == {"count": 2, "ms": 2.15}
    assert causes["gaps_by_size"]["50-500us"] == {"count": 1, "ms": 0.4}
    # every launch counted where the host made it (k2 was launched at 98-100, inside forward alone)
    assert causes["launch_sites"]["launch: slimrl/models/checkpointing.py:10 forward"]["count"] == 5


def test_grpo_memory_isolate_runs_each_side_in_its_own_process_and_keeps_every_name(tmp_path):
    """--isolate: one process of the script per side with that side alone and the run's settings; the results come
    back under the sides' own names (a spec given again as #2, as in one process)."""
    path = Path(__file__).resolve().parents[2] / "bench" / "grpo_memory.py"
    spec = importlib.util.spec_from_file_location("grpo_memory_isolate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.parse_args(["1024", "4096", "--isolate", "--repeats", "3", "--variants", "auto/8192/1;auto/8192/1"])
    commands = module.side_commands(args, tmp_path)
    assert [name for name, _ in commands] == ["trl", "slimrl", "slimrl[auto/8192/1]", "slimrl[auto/8192/1]#2"]
    for name, command in commands:
        assert command[1] == str(path) and "--isolate" not in command
        assert command[-2:] == ["1024", "4096"] and "--repeats=3" in command and "--beta=0.0" in command
        which = command[command.index("--trainers") + 1 : command.index("--beta=0.0")]
        assert which == ([name] if "[" not in name else ["", "--variants", "auto/8192/1"])
    assert len({command[command.index("--out") + 1] for _, command in commands}) == 4  # a folder each

    # a side's process reports its spec under the first name; the parent files it under the side's own
    report, out = {"results": {}}, tmp_path / "report.json"
    for name, command in commands[2:]:
        side = Path(command[command.index("--out") + 1])
        side.mkdir()
        (side / "grpo_memory.json").write_text(json.dumps({"results": {"slimrl[auto/8192/1]_L1024": {"s": name}},
                                                           "weights_GiB": 3.15}))  # fmt: skip
        module.run_side(name, ["true", *command[2:]], report, out)
    assert report["results"] == {"slimrl[auto/8192/1]_L1024": {"s": "slimrl[auto/8192/1]"},
                                 "slimrl[auto/8192/1]#2_L1024": {"s": "slimrl[auto/8192/1]#2"}}  # fmt: skip
    assert report["weights_GiB"] == 3.15  # from the sides' reports (the parent builds no model of its own)
    module.run_side("trl", ["false", *commands[0][1][2:]], report, out)  # no report written: the failure is kept
    assert report["results"]["trl"].startswith("failed (exit 1")
    assert json.loads(out.read_text()) == report
