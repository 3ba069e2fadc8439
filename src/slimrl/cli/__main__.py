"""`python -m slimrl.cli ...`: the `slimrl` command (accelerate and torchrun launch it this way)."""

from slimrl.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
