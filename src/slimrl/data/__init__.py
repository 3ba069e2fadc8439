"""Built-in datasets for the demo and tests."""

from slimrl.data.arithmetic import DIFFICULTIES, INSTRUCTION, arithmetic_dataset, arithmetic_rows, split_size

__all__ = ["DIFFICULTIES", "INSTRUCTION", "arithmetic_dataset", "arithmetic_rows", "split_size"]
