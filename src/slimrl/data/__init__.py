"""Built-in datasets for the demo and tests."""

from slimrl.data.arithmetic import INSTRUCTION, arithmetic_dataset, arithmetic_rows

__all__ = ["INSTRUCTION", "arithmetic_dataset", "arithmetic_rows"]
