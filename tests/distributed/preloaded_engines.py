"""Rollout-device engine processes that start in a fraction of a second, for tests that start many.

RemoteRolloutEngine starts its engine process with torch.multiprocessing's "spawn": a fresh interpreter that imports
torch, transformers and peft (about 10 s on a 2-core machine) and tears them down at its exit (about 3 s more).
`use_preloaded_engine_processes(monkeypatch)` hands it the "forkserver" context instead: a fork server, itself a
fresh interpreter, imports the engine's modules once per test process (with those of launch.py's two-rank runs,
which it serves too), and each engine process is forked from it.
Such a process inherits nothing of the trainer's process (no model, no tensors, no torch state beyond the imports);
it is started, as spawn's, from the pickled Process (`serve` by reference, the store's host and port), receives the
model over the channel and serves exactly as a spawned one. Its random generators are reseeded from the OS at the
fork (engine_server.py), as a spawned interpreter's are seeded. What it does share with the other forked engines: the
server's environment (as it was when the server started) and its str hash seed. test_rollout_device.py's engine-death
test starts its engine with spawn, as the trainer does.
"""

from __future__ import annotations

ENGINE_MODULES = [
    "tests.distributed.engine_server",
    "slimrl.distributed.rollout_server",
    "slimrl.rollout.engine",
    "slimrl.models.quantization",
    "peft",
    "peft.utils.transformers_weight_conversion",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
]


def start_engine_server():
    """The fork server's context, the server started (it imports ENGINE_MODULES in the background, with the modules
    of launch.py's two-rank runs: multiprocessing keeps one fork server per process) if it is not running yet. The
    environment it starts with is its engine processes' environment."""
    from tests.distributed.launch import start_fork_server

    return start_fork_server()


def use_preloaded_engine_processes(monkeypatch) -> None:
    """Until `monkeypatch` is undone, RemoteRolloutEngine's spawn context is the fork server's."""
    import torch.multiprocessing as mp

    context, get_context = start_engine_server(), mp.get_context
    monkeypatch.setattr(mp, "get_context", lambda method=None: context if method == "spawn" else get_context(method))
