"""Two-rank CPU runs (gloo) whose ranks start in a fraction of a second instead of importing the stack twice.

The multi-process tests used to run `python -m torch.distributed.run --nproc_per_node 2 -m <worker> ...`: a launcher
that imports torch, then two fresh interpreters that each import torch, transformers, trl, peft, accelerate, datasets
and slimrl (about 14 CPU-seconds apiece on the 2-core CI machine) before the worker's first line of real work.
`run_two_processes` runs the same worker module with the same arguments in two processes forked from the fork server
of preloaded_engines.py, which has imported those modules once per test process (FORK_SERVER_MODULES: the engine
processes' modules and the ranks'). Each rank then does what torchrun's worker would have seen done for it:

- its environment is the one the test passes (by default the test process's with OMP_NUM_THREADS=1, as the tests gave
  torchrun) plus the variables torchrun sets for a worker (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
  TORCHELASTIC_RUN_ID, ...), replacing the server's; rank 0 hosts the rendezvous store (there is no agent to host it, so
  TORCHELASTIC_USE_AGENT_STORE is False), which torch's env:// init and accelerate read when the worker starts;
- torch's thread count is set from OMP_NUM_THREADS (the server imported torch before it was set); torch's and numpy's
  generators are reseeded from the OS as a fresh interpreter seeds them, by the fork hook that engine_server.py (one
  of the preloaded modules) registers in the server for every process forked from it; Python's random reseeds
  itself after a fork;
- it runs in a session of its own (as torchrun starts its workers) with stdout and stderr in a log file per rank, in
  the test's working directory, with sys.argv as `python -m` sets it, and runs the module as __main__ (runpy).

What a forked rank cannot redo: whatever a preloaded module read from the environment at import was read in the server,
with the test process's environment of that moment. The variables read then that change what the stack does
(IMPORT_TIME_VARIABLES: Triton's interpreter, Hugging Face's offline switches and caches) must have the same value in
the test's environment as in the server's, or the rank refuses to run, naming them. Everything else a worker reads when
it runs (accelerate's and torch.distributed's variables, CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS, TOKENIZERS_PARALLELISM,
WANDB_DISABLED) is read in the rank, after its environment is set; what the server's imports wrote into theirs (torch's
compile cache directory) is in it too, as a worker's own imports would have written it. The two ranks also share the
server's str hash seed (torchrun's workers each draw their own). A rank exits 0 when the worker returns or leaves
through worker_exit.py's os._exit(0), 1 on an exception, the code of a SystemExit. The parent waits for both within the
timeout; when one fails or the time is up, it ends the other (its whole session) and fails the test with both ranks' log
tails.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from tests.distributed.preloaded_engines import ENGINE_MODULES

ROOT = Path(__file__).resolve().parents[2]

# in the fork server this module is the first one imported: the environment that the preloaded modules' imports read
ENVIRONMENT_AT_IMPORT = dict(os.environ)

# the modules the worker modules import (the workers themselves run as __main__, from a fresh copy). DeepSpeed, which
# every trainer rank imports as it starts (about 0.6 s more), stays out: its import asks torch for CUDA devices, which
# on a GPU host would start the CUDA driver in the server that the engine processes are forked from
RANK_MODULES = [
    "tests.distributed.worker_exit",
    "tests.trainers.dpo_harness",
    "tests.trainers.grpo_harness",
    "tests.trainers.distributed_train",
    "tests.trainers.test_grpo_engine",
    "tests.trainers.test_grpo_train_parity",
    "slimrl.distributed.sharded",
    "slimrl.models.checkpointing",
    "slimrl.trainers.rollouts.engine_rollouts",
    "slimrl.trainers.grpo.trainer",
    "slimrl.trainers.dpo.trainer",
    "trl.trainer.grpo_trainer",
    "trl.trainer.dpo_trainer",
    "transformers.trainer",
    "torch.distributed.algorithms.ddp_comm_hooks",
    "accelerate",
    "datasets",
]
FORK_SERVER_MODULES = ["tests.distributed.launch", *ENGINE_MODULES, *RANK_MODULES]

# Of the variables that importing FORK_SERVER_MODULES reads (recorded by wrapping os.environ), those that change what
# the ranks do: a rank refuses a test environment that gives them other values than the server started with. (The
# rest are torch's compile and logging switches, which these tests leave alone, and ones read only for their
# defaults. A list by prefix was too wide: the test process's environment gains variables at run time, such as
# PYTORCH_NVML_BASED_CUDA_CHECK, which accelerate sets while it asks for CUDA.)
IMPORT_TIME_VARIABLES = ("TRITON_INTERPRET", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HOME",
                         "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE", "ACCELERATE_USE_MEGATRON_LM",
                         "ACCELERATE_LOG_LEVEL", "ACCELERATE_ENABLE_RICH")  # fmt: skip


def start_fork_server():
    """The fork server's context, the server started (it imports FORK_SERVER_MODULES in the background) if it is not
    running yet. One server per test process serves the engine processes and the ranks alike: multiprocessing keeps
    a single fork server, whose preload list is the one set when it starts."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(FORK_SERVER_MODULES)
    multiprocessing.forkserver.ensure_running()
    return context


def torchrun_environment(rank: int, port: int, omp_threads: str) -> dict[str, str]:
    """What torchrun's local agent adds to a worker's environment, for one node of two workers."""
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_NAME": "default",
        "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "OMP_NUM_THREADS": omp_threads,
    }  # fmt: skip


def rank_environment(wanted: dict[str, str]) -> dict[str, str]:
    """The environment a worker started with `wanted` would have once it imported the preloaded modules: `wanted`,
    with what those imports set or removed in the server (torch's compile cache directory, for one). Refuses to run
    when a variable of IMPORT_TIME_VARIABLES has another value than the server's imports read."""
    differences = [name for name in IMPORT_TIME_VARIABLES if wanted.get(name) != ENVIRONMENT_AT_IMPORT.get(name)]
    if differences:
        raise RuntimeError(f"the fork server imported its modules with other values of {differences}: run this test "
                           "where the server starts with them, or under torch.distributed.run")  # fmt: skip
    server, start = dict(os.environ), ENVIRONMENT_AT_IMPORT  # the server's now (inherited), and at its start
    changed = {name for name in {*server, *start} if server.get(name) != start.get(name)}
    environment = {**wanted, **{name: server[name] for name in changed if name in server}}
    return {name: value for name, value in environment.items() if name in server or name not in changed}


def run_rank(rank: int, module: str, args: list[str], port: int, env: dict[str, str], cwd: str, log: str) -> None:
    """A rank's process, forked from the server: torchrun's worker setup, then `module` as __main__."""
    import runpy
    import warnings

    import torch

    os.setsid()
    descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.close(descriptor)
    env = rank_environment({**env, **torchrun_environment(rank, port, env.get("OMP_NUM_THREADS", "1"))})
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    os.chdir(cwd)
    wanted_paths = [cwd, *(path for path in env.get("PYTHONPATH", "").split(os.pathsep) if path)]
    sys.path[:0] = [path for path in wanted_paths if path not in sys.path]
    sys.argv = [module, *args]  # runpy sets argv[0] to the module's file, as `python -m` does
    if module.endswith(".py"):  # a script, as `python path/to/script.py` runs it (its folder first on the path)
        sys.path.insert(0, str(Path(module).resolve().parent))
        runpy.run_path(module, run_name="__main__")
        return
    # the worker may itself be one of the preloaded modules: __main__ is a fresh copy of it, as under `python -m`
    warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package", category=RuntimeWarning)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def stop(process) -> None:
    """Ends a rank that is still running, with everything it started (its session), and reaps it."""
    if process.pid is None:  # never started
        return
    if process.exitcode is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:  # not yet its own session's leader
            process.kill()
    process.join()


def read_log(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else "(no log: the rank ended before opening it)"


def run_two_processes(module: str, args: list[str], port: int, env: dict[str, str] | None = None,
                      timeout: float = 600.0, cwd: Path = ROOT) -> list[str]:  # fmt: skip
    """Runs `python -m module *args` (`python module *args` for a path ending in .py) as ranks 0 and 1 of a 2-process
    group (env:// on 127.0.0.1:port), forked from the preloaded fork server, and returns their logs; fails
    (AssertionError, both ranks' log tails) when a rank exits with a non-zero code or the two do not finish within
    `timeout` seconds, ending the other rank first. `env` is the ranks' environment before torchrun's variables; by
    default the test process's, with one OpenMP thread per rank (the two ranks share the machine's cores)."""
    context = start_fork_server()
    env = dict(os.environ, OMP_NUM_THREADS="1") if env is None else dict(env)
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs_dir:
        logs = [Path(logs_dir) / f"rank{rank}.log" for rank in range(2)]
        ranks = [context.Process(target=run_rank, name=f"rank{rank}", args=(rank, module, list(args), port, env,
                                 str(cwd), str(logs[rank]))) for rank in range(2)]  # fmt: skip
        try:
            for process in ranks:
                process.start()
            failure = wait_for(ranks, time.monotonic() + timeout)
        finally:
            for process in ranks:
                stop(process)
        texts = [read_log(path) for path in logs]
        if failure is not None:
            report = "\n".join(f"--- rank {rank} (exit code {p.exitcode}), the end of its log ---\n{text[-4000:]}"
                               for rank, (p, text) in enumerate(zip(ranks, texts, strict=True)))  # fmt: skip
            raise AssertionError(f"python -m {module} on 2 ranks: {failure}\n{report}")
        return texts


def wait_for(ranks, deadline: float, grace: float = 5.0) -> str | None:
    """Waits until both ranks exited 0 (None), one exited otherwise, or the deadline passed (what went wrong). A
    failure names every rank found exited non-zero: a rank that dies takes down the rank waiting on it in a
    collective, and the one taken down may exit first (its peer's socket closes while the peer's interpreter is still
    shutting down), so after the first failure the others get `grace` seconds to exit before the report is made."""
    running, failed, stop_at = list(ranks), [], deadline
    while running:
        left = stop_at - time.monotonic()
        if left <= 0:
            if failed:  # the grace is over: the ranks still running are ended by the caller
                break
            return f"still running after the timeout: {[p.name for p in running]}"
        for sentinel in multiprocessing.connection.wait([p.sentinel for p in running], timeout=left):
            process = next(p for p in running if p.sentinel == sentinel)
            process.join()
            running.remove(process)
            if process.exitcode != 0:
                if not failed:
                    stop_at = min(deadline, time.monotonic() + grace)
                failed.append(f"{process.name} exited with code {process.exitcode}")
    return "; ".join(sorted(failed)) if failed else None
