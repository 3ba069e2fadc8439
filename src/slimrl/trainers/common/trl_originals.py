"""TRL's own classes while `slimrl.PatchFastRL` has rebound their names in trl to slimrl's subclasses.

patching.py records here what each rebound name held before (`ORIGINALS`); `trl_original` hands back TRL's class
whether or not it is patched now. A slimrl class built on another algorithm's TRL class (BCO on KTO's) takes it from
here, so it subclasses TRL's class whenever its module is first imported, also after slimrl's KTO was patched in.
"""

from __future__ import annotations

import importlib

ORIGINALS: dict[tuple[str, str], object] = {}  # (trl module, name) -> TRL's object, while patched
ABSENT = object()  # in ORIGINALS: trl had no such name (PPO), so unpatching deletes it


def trl_original(module_name: str, name: str):
    """TRL's own `module_name.name`, also while it is rebound to slimrl's subclass."""
    found = ORIGINALS.get((module_name, name), ABSENT)
    return getattr(importlib.import_module(module_name), name) if found is ABSENT else found
