"""bench/tune_decode.py on a small layer (in Triton's interpreter on the CPU): every candidate is checked against the
unfused reference before it is timed, a wrong one is never chosen, and the chosen set is checked again and written
in the format the engine loads."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "tune_decode.py"


@pytest.fixture(scope="module")
def tuner():
    spec = importlib.util.spec_from_file_location("bench_tune_decode", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def shipped_choices() -> dict:
    from slimrl.rollout.fused_ops import choices_for

    return choices_for(torch.device("cuda" if torch.cuda.is_available() else "cpu"))[0]


def test_the_check_measures_the_fused_ops_against_the_reference(tuner):
    device, choices = "cuda" if torch.cuda.is_available() else "cpu", shipped_choices()
    case = tuner.layer_case(tuner.TINY_LAYER, 5, device)
    want = tuner.reference(tuner.TINY_LAYER, case)
    for group in tuner.GROUPS:
        got = tuner.fused_call(tuner.TINY_LAYER, case, group, choices)()
        assert tuner.relative_error(got, want[group]) < tuner.TOLERANCE, group
        assert tuner.relative_error([t * 1.1 for t in got], want[group]) > 0.05, "a 10% error must show"
    error, _ = tuner.attention_error(tuner.TINY_LAYER, 5, device, block_s=32, num_warps=4)
    assert error < tuner.TOLERANCE


def test_a_wrong_candidate_is_never_chosen_and_the_chosen_set_is_written(tuner, tmp_path, monkeypatch):
    from slimrl.rollout.fused_ops import load_choices

    monkeypatch.setitem(tuner.TUNE_CANDIDATES, "o", [(True, 16, 128, 4, 4), (True, 64, 128, 4, 3)])
    monkeypatch.setitem(tuner.TUNE_CANDIDATES, "down", [(False, 64, 64, 4, 3), (True, 32, 128, 4, 3, 0, 0, 4)])
    monkeypatch.setattr(tuner, "ATTENTION_CANDIDATES", [(32, 4, 1), (16, 4, 3)])
    real = tuner.fused_call

    def wrong_for_wide_tiles(layer, case, group, choices, ordered=False):
        call = real(layer, case, group, choices, ordered)
        if group == "o" and choices["o"][16].block_n == 64:  # this candidate's "kernel" is off by 10%
            return lambda: tuple(t * 1.1 for t in call())
        return call

    monkeypatch.setattr(tuner, "fused_call", wrong_for_wide_tiles)
    out, written = tmp_path / "tune.json", tmp_path / "tuned.json"
    report = tuner.main([str(out), "--tiny", "--groups", "o", "down", "attention", "--rows", "5", "--choices",
                         str(written)])  # fmt: skip
    saved = json.loads(out.read_text())
    assert saved["problems"] == [] and report.exit_status() == 0, saved.get("errors")
    assert saved["timed_over_layers"] == 2, "each candidate timed over layers with weights of their own"
    assert saved["wrong_candidates"] == ["o_B5_gemm_n64_k128_w4_s3_m0_p0_x1"]
    assert saved["timings_us"]["o_B5_gemm_n64_k128_w4_s3_m0_p0_x1"].startswith("WRONG relative error 0.1")
    chosen = load_choices(written)
    assert chosen["o"][16].block_n == 16, "the only correct candidate for o"
    assert (chosen["down"][16].gemm, chosen["down"][16].block_n) in ((False, 64), (True, 32))
    assert chosen["qkv"] == shipped_choices()["qkv"], "groups not tuned keep their settings"
    assert set(saved["attention_fastest"]["B5_c24"]) == {"us", "block_s", "num_warps", "splits", "engine"}
    assert isinstance(saved["timings_us"]["attention_B5_c24_s16_w4_x3"], float), "a split candidate, checked"
    assert all(e < tuner.TOLERANCE for errors in saved["chosen_check"].values() for e in errors.values())
    # each tuned group's shrink setting, tried on its fastest tiles on the deterministic path, the fastest chosen
    for group in ("o", "down"):
        tiles = chosen[group][16]
        key = tuner.candidate_key(group, 5, tiles)
        shrinks = {k: saved["timings_us"][f"{key}_shrink{k}_ordered"] for k in tuner.SHRINK_CANDIDATES}
        assert all(isinstance(t, float) for t in shrinks.values()), shrinks
        assert tiles.shrink_k == min(shrinks, key=shrinks.get), f"{group}: not the fastest shrink setting"
    assert {"B5", "B5_ordered"} == set(saved["chosen_check"])


def test_a_chain_times_every_layer_and_reports_the_time_per_layer(tuner, monkeypatch):
    device, choices = "cuda" if torch.cuda.is_available() else "cpu", shipped_choices()
    error, chain = tuner.checked_call(tuner.TINY_LAYER, 5, "o", choices, device, copies=3)
    assert error < tuner.TOLERANCE and isinstance(chain, tuner.Chain) and chain.copies == 3
    first, *others = (tuner.layer_case(tuner.TINY_LAYER, 5, device, replica) for replica in range(3))
    assert all(not torch.equal(first["o"].weight, other["o"].weight) for other in others), "weights of their own"
    outputs = chain()
    assert len(outputs) == 3 and not torch.equal(outputs[0][0], outputs[1][0])
    if not torch.cuda.is_available():  # one wall-clock call of the chain, divided among its layers
        clock = iter([0.0, 0.3])
        monkeypatch.setattr(tuner.time, "perf_counter", lambda: next(clock))
        assert tuner.time_us(chain) == 100000.0


def test_confirm_in_step_times_real_engines_and_writes_only_what_the_step_kept(tuner, tmp_path, monkeypatch):
    """--confirm-in-step 1 on the tiny model: a fresh deterministic engine with the current settings and one with the
    bucket's new entries each run a rollout, and the file holds the new entries only if the step kept them."""
    from slimrl.rollout.fused_ops import load_choices

    monkeypatch.setitem(tuner.TUNE_CANDIDATES, "o", [(True, 16, 128, 4, 4)])  # o@16 differs from the shipped tiles
    monkeypatch.setattr(tuner, "SHRINK_CANDIDATES", (128,))
    out, written = tmp_path / "tune.json", tmp_path / "tuned.json"
    report = tuner.main([str(out), "--tiny", "--groups", "o", "--rows", "5", "--choices", str(written),
                         "--confirm-in-step", "1"])  # fmt: skip
    saved = json.loads(out.read_text())
    assert saved["problems"] == [] and report.exit_status() == 0, saved.get("errors")
    entry = saved["in_step"]["B5"]
    assert entry["bucket"] == 16 and entry["changed"] == ["o"]
    assert all(len(runs) == 1 and runs[0] > 0 for runs in entry["step_ms"].values()), entry
    assert entry["kept"] == (entry["step_ms"]["tuned"][0] < entry["step_ms"]["current"][0])
    got, shipped = load_choices(written)["o"][16], shipped_choices()["o"][16]
    assert (got.block_n, got.num_stages, got.shrink_k) == ((16, 4, 128) if entry["kept"] else
                                                           (shipped.block_n, shipped.num_stages, shipped.shrink_k))
    assert "decode-step runs" in json.loads(written.read_text())["written_by"]


@pytest.mark.parametrize("tuned_faster", [True, False])
def test_a_bucket_keeps_its_settings_unless_every_tuned_run_beats_every_current_one(tuner, monkeypatch, tuned_faster):
    """Row counts of one bucket are confirmed once; the new entries are kept only when the slowest tuned run is faster
    than the fastest current one, and buckets whose entries did not change run nothing."""
    import argparse
    import dataclasses

    current = shipped_choices()
    chosen = {g: dict(buckets) for g, buckets in current.items()}
    chosen["o"][16] = dataclasses.replace(current["o"][16], block_n=64)
    calls = []

    def step(model, rows, choices, prompt_tokens, new_tokens):
        tuned = choices["o"][16].block_n == 64
        calls.append((rows, tuned))
        return (1.0 if tuned_faster else 1.3) if tuned else 1.2

    monkeypatch.setattr(tuner, "decode_step_ms", step)
    args = argparse.Namespace(rows=[5, 9, 40], tiny=True, confirm_in_step=2)
    report = {}
    confirmed = tuner.confirm_in_step(report, args, current, chosen, torch.device("cpu"))
    assert calls == [(5, False), (5, True), (5, False), (5, True)], "one bucket, confirmed once, alternating"
    assert report["in_step"]["B5"]["kept"] is tuned_faster
    assert report["in_step"]["B5"]["step_ms"]["current"] == [1.2, 1.2]
    assert "step_ms" not in report["in_step"]["B9"], "the bucket of 5 rows is not confirmed twice"
    assert report["in_step"]["B40"] == {"bucket": 64, "changed": []}
    assert confirmed["o"][16] == (chosen if tuned_faster else current)["o"][16]
    assert all(confirmed[g][b] == current[g][b] for g in current for b in current[g] if (g, b) != ("o", 16))


@pytest.mark.parametrize("alone_ms", [{"o": 1.0, "gate_up": 1.1}, {"o": 1.25, "gate_up": 1.3}])
def test_a_bucket_the_step_rejects_whole_keeps_its_fastest_group_that_passes_alone(tuner, monkeypatch, alone_ms):
    """Two groups changed in one bucket and the step is slower with both: each is timed alone against the current
    settings, and only the group whose slowest run is fastest among those that beat every current run is written."""
    import argparse
    import dataclasses

    current = shipped_choices()
    chosen = {g: dict(buckets) for g, buckets in current.items()}
    chosen["o"][16] = dataclasses.replace(current["o"][16], block_n=64)
    chosen["gate_up"][16] = dataclasses.replace(current["gate_up"][16], num_stages=7)
    calls = []

    def step(model, rows, choices, prompt_tokens, new_tokens):
        new = tuple(g for g in ("o", "gate_up") if choices[g][16] == chosen[g][16])
        calls.append(new)
        return {(): 1.2, ("o", "gate_up"): 1.3}.get(new) or alone_ms[new[0]]

    monkeypatch.setattr(tuner, "decode_step_ms", step)
    report = {}
    args = argparse.Namespace(rows=[8], tiny=True, confirm_in_step=2)
    confirmed = tuner.confirm_in_step(report, args, current, chosen, torch.device("cpu"))
    entry = report["in_step"]["B8"]
    assert calls == [(), ("o", "gate_up")] * 2 + [(), ("o",)] * 2 + [(), ("gate_up",)] * 2
    assert entry["kept"] is False and entry["changed"] == ["o", "gate_up"]
    assert entry["alone"]["o"] == {"current": [1.2, 1.2], "tuned": [alone_ms["o"]] * 2}
    passing = alone_ms["o"] < 1.2
    assert entry["kept_groups"] == (["o"] if passing else [])
    assert confirmed["o"][16] == (chosen if passing else current)["o"][16]
    assert confirmed["gate_up"][16] == current["gate_up"][16], "a group kept alone does not bring the other along"
