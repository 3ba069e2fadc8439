"""The launcher's default process group is destroyed at the end of the demo and the scaling bench (NCCL's, left to
the interpreter's exit, makes PyTorch warn on every two-GPU run)."""

from __future__ import annotations

import torch.distributed as dist

from slimrl.distributed.process_group import end_launcher_group


def test_the_default_group_is_destroyed_once_and_without_one_nothing_happens(tmp_path):
    assert not dist.is_initialized()
    assert end_launcher_group() is False
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert end_launcher_group() is True
        assert not dist.is_initialized()
        assert end_launcher_group() is False
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_demo_command_ends_the_group_after_the_demo_and_only_then(monkeypatch):
    import slimrl.cli.demo as demo
    import slimrl.distributed.process_group as process_group
    from slimrl.cli import main

    calls = []
    monkeypatch.setattr(demo, "run_demo", lambda settings: calls.append("demo") or {"raised_nonfinite_error": True})
    monkeypatch.setattr(process_group, "end_launcher_group", lambda: calls.append("end") or True)
    assert main(["demo", "--model", "tiny", "--steps", "1"]) == 1  # a stopped demo still ends the group, then exits 1
    assert calls == ["demo", "end"]
    assert main(["demo", "--model", "tiny", "--steps", "0"]) == 2  # refused settings: no demo, no group to end
    assert calls == ["demo", "end"]
