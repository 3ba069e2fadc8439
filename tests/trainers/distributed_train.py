"""Run by test_grpo_distributed.py on 2 CPU ranks (launch.py; or torchrun --nproc_per_node 2): trains TRL's and slimrl's
GRPO trainers with DistributedDataParallel (gloo) from the same seed and writes rank 0's logs as JSON: transformers
generation, and slimrl's engine on every rank with each prompt's group split across the two ranks."""

import sys
import warnings

warnings.simplefilter("ignore")

from tests.distributed.worker_exit import write_logs_and_exit  # noqa: E402
from tests.trainers.grpo_harness import build_trainer  # noqa: E402
from tests.trainers.test_grpo_engine import length_reward  # noqa: E402
from tests.trainers.test_grpo_train_parity import train_log  # noqa: E402


def split_group_log(kind: str, **config) -> list[dict]:
    """Each prompt's 4 completions on two ranks (2 each), no logit bias (the engine takes no sequence_bias; at
    temperature 0.9 some completions end early anyway)."""
    return split_group_trainer(kind, **config).state.log_history


def split_group_trainer(kind: str, **config):
    """The trainer of `split_group_log`, after training."""
    config = {"beta": 0.04, **config}
    trainer = build_trainer(kind, reward_funcs=length_reward, max_steps=3, logging_steps=1, max_completion_length=8,
                            temperature=0.9, seed=5, learning_rate=5e-3, per_device_train_batch_size=2,
                            num_generations=4, loss_type="dapo", **config)  # fmt: skip
    trainer.train()
    return trainer


if __name__ == "__main__":
    out_path = sys.argv[1]
    config = dict(per_device_train_batch_size=4, num_generations=4, loss_type="dapo", beta=0.04, num_iterations=2)
    logs = {"trl": train_log("trl", **config), "slimrl": train_log("slimrl", num_chunks=2, **config)}
    # an engine per rank over its replica of the live weights, and a group split across the ranks (2 completions of
    # a prompt on each): its mean and std must still be the whole group's
    logs["trl_split_group"] = split_group_log("trl")
    logs["slimrl_engine_split_group"] = split_group_log("slimrl", num_chunks=2, generation_backend="engine")
    write_logs_and_exit(logs, out_path)
