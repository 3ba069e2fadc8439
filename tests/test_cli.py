"""`slimrl demo` end to end on a tiny model: trains, evaluates, and writes the adapter, metrics and plot."""

import json

import pytest

from slimrl.cli import build_parser, main


def test_demo_on_a_tiny_model_writes_adapter_metrics_and_plot(tmp_path, capsys):
    out = tmp_path / "demo"
    code = main(["demo", "--model", "tiny", "--steps", "2", "--eval-size", "4", "--num-generations", "4",
                 "--max-completion-length", "8", "--output-dir", str(out), "--device", "cpu"])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "held-out accuracy before" in printed and "held-out accuracy after" in printed
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    metrics = json.loads((out / "metrics.json").read_text())
    assert [entry["step"] for entry in metrics["history"]] == [1, 2]
    assert all("reward" in entry and "rewards/format_reward/mean" in entry for entry in metrics["history"])
    assert 0.0 <= metrics["accuracy_after"]["accuracy"] <= 1.0


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and "slimrl 0.1.0" in capsys.readouterr().out
    assert "demo" in build_parser().format_help()


def test_invalid_demo_settings_exit_with_a_message(capsys):
    assert main(["demo", "--model", "tiny", "--num-generations", "1"]) == 2
    assert "--num-generations >= 2" in capsys.readouterr().err
