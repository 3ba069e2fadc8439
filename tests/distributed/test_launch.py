"""launch.py's two ranks forked from the preloaded fork server: each one sees what a torchrun worker sees (torchrun's
variables, `python -m`'s argv, the repository as working directory, one torch thread) and draws random numbers of
its own, as two fresh interpreters would; a rank that fails ends the run at once, the other rank included, with its
traceback in the failure; a variable that the server's imports read with another value is refused, by name."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import sys
import time

import pytest

from tests.bench.test_scaling_smoke import free_port
from tests.distributed.launch import ROOT, run_two_processes, stop, wait_for


def test_each_rank_sees_a_torchrun_workers_setup_and_draws_its_own_random_numbers(tmp_path):
    run_two_processes("tests.distributed.launch_probe", ["ok", str(tmp_path)], free_port(), timeout=120)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, seen in enumerate(ranks):
        assert seen["world"] == 2
        assert seen["env"] == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_RUN_ID": "none",
                               "OMP_NUM_THREADS": "1"}  # fmt: skip
        assert seen["argv"] == [str(ROOT / "tests" / "distributed" / "launch_probe.py"), "ok", str(tmp_path)]
        assert seen["cwd"] == str(ROOT) and seen["threads"] == 1
    # torch, numpy and Python's random: each generator seeded apart in each rank, as in two fresh interpreters
    assert all(first != second for first, second in zip(ranks[0]["draws"], ranks[1]["draws"], strict=True))


def test_a_failing_rank_ends_the_run_and_the_rank_waiting_for_it(tmp_path):
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank1 exited with code 1(.|\n)*RuntimeError: rank 1 fails on purpose"):
        run_two_processes("tests.distributed.launch_probe", ["fail", str(tmp_path)], free_port(), timeout=120)
    assert time.monotonic() - started < 60  # rank 0, blocked in the barrier, was ended rather than waited for
    assert not list(tmp_path.iterdir())


def start_ranks(target, args_per_rank: list[tuple]) -> list:
    """Forked processes named rank0, rank1, ... running `target(*args)`, started."""
    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=target, args=args, name=f"rank{rank}") for rank, args in enumerate(args_per_rank)]
    for process in ranks:
        process.start()
    return ranks


def exit_after(seconds: float, code: int) -> None:
    time.sleep(seconds)
    sys.exit(code)


def test_a_failure_names_every_rank_found_exited_non_zero():
    """The race a CI run once lost: the failing rank and the rank it took down had both exited when the wait looked,
    and only rank 0's connection error was reported."""
    ranks = start_ranks(sys.exit, [(1,), (2,)])
    for process in ranks:
        process.join()
    assert wait_for(ranks, time.monotonic() + 30) == "rank0 exited with code 1; rank1 exited with code 2"


def test_a_rank_exiting_soon_after_the_first_failure_is_named_too():
    """The race a later CI run lost: rank 0, taken down by rank 1's closed socket, exited while rank 1's interpreter
    was still shutting down, and only rank 0 was named. The wait now gives the other rank a grace period."""
    ranks = start_ranks(exit_after, [(0.0, 1), (1.0, 1)])
    assert wait_for(ranks, time.monotonic() + 30, grace=10.0) == "rank0 exited with code 1; rank1 exited with code 1"


def test_a_rank_still_running_after_the_grace_is_left_to_be_ended():
    ranks = start_ranks(exit_after, [(0.0, 3), (30.0, 0)])
    started = time.monotonic()
    try:
        assert wait_for(ranks, time.monotonic() + 60, grace=0.5) == "rank0 exited with code 3"
        assert time.monotonic() - started < 10 and ranks[1].exitcode is None
    finally:
        for process in ranks:
            stop(process)


def test_a_variable_read_at_import_with_another_value_is_refused(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0" if os.environ.get("TRITON_INTERPRET") == "1" else "1")
    with pytest.raises(AssertionError) as failure:
        run_two_processes("tests.distributed.launch_probe", ["ok", str(tmp_path)], free_port(), env=env, timeout=120)
    message = str(failure.value)
    # both ranks are refused at once; each one that exits within the wait's grace is named (rank 1 alone in one CI
    # run, before the grace)
    rank = re.search(r"rank([01]) exited with code 1", message).group(1)
    own_log = message.split(f"--- rank {rank} (exit code 1), the end of its log ---")[1].split("--- rank ")[0]
    assert "other values of ['TRITON_INTERPRET']" in own_log
    assert not list(tmp_path.iterdir())
