"""`specserve train-draft` step 1: training rows from the frozen target, generated and sharded by Ray Data.

Stages (each writes Parquet shards under `out_dir` and a completion marker, so a rerun skips what is
done and an interrupted run restarts only the unfinished stage):
1. answers/: the target's greedy answers to the written prompts (batched `generate` in an actor);
2. features/: every source's documents, tokenised and packed into `seq_len` rows; for each row the
   target's K/V of the chosen layer ([Hkv, S, D], fp16) and its argmax next token at every position;
3. token_counts.safetensors: how often each token is the target's label (ranks the reduced head).

Ray runs locally on this machine's CPUs unless RAY_ADDRESS names a cluster; the actors that hold the
target are the expensive part and scale out by raising their concurrency there.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specserve.training.corpus import Source, dummy_conversations, read_documents
from specserve.training.prompts import written_prompts
from specserve.training.settings import DataSettings

DONE = "_DONE"
ANSWERS, FEATURES, COUNTS, MANIFEST = "answers", "features", "token_counts.safetensors", "manifest.json"
Log = Callable[[str], None]
RAY_START_ATTEMPTS = 3
# Ray waits 30 s for its GCS server to bind a port; on 2 busy cores a start has taken longer, and one
# has never come up at all (no log written in 120 s). So each attempt waits a bounded time and a start
# that does not come up is torn down and made again, like a supervisor restarting a stuck child.
RAY_GCS_WAIT_S = 60


class RayStartError(RuntimeError):
    """A local Ray did not come up in any of its fresh starts."""


def init_ray(num_cpus: int | None = None, attempts: int = RAY_START_ATTEMPTS) -> None:
    """A local Ray on this machine, or the cluster named by RAY_ADDRESS (then num_cpus is the cluster's)."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        return
    # Ray's own operator override; an operator's value wins.
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", str(RAY_GCS_WAIT_S))
    failures: list[str] = []
    for _ in range(attempts):
        try:
            ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=True)
            return
        except Exception as e:
            # Both of Ray's start-up waits (the GCS port file, the raylet's registration) say "timed out"
            if "timed out" not in str(e).lower():
                raise
            session = _latest_session()
            failures.append(f"{e}{_gcs_log_tail(session)}")
            ray.shutdown()
            _stop_session_processes(session)
    raise RayStartError(f"a local Ray did not start in {attempts} attempts: " + " | ".join(failures))


def _latest_session() -> Path | None:
    """The session directory of the newest local start (Ray points `session_latest` at it)."""
    try:
        from ray._common.utils import get_default_ray_temp_dir  # where a local start puts its sessions

        temp_dir = Path(get_default_ray_temp_dir())
    except (ImportError, AttributeError):
        temp_dir = Path(tempfile.gettempdir()) / "ray"
    latest = temp_dir / "session_latest"
    return latest.resolve() if latest.exists() else None


def _gcs_log_tail(session: Path | None, lines: int = 5) -> str:
    """The last lines the GCS server logged, or that it logged nothing (it never reached its main)."""
    if session is None:
        return ""
    logs = [session / "logs" / name for name in ("gcs_server.err", "gcs_server.out")]
    text = "\n".join(p.read_text(errors="replace") for p in logs if p.is_file()).strip()
    if not text:
        return " (the GCS server wrote no log)"
    return " (GCS log: " + " / ".join(text.splitlines()[-lines:]) + ")"


def _stop_session_processes(session: Path | None, settle_s: float = 10.0) -> None:
    """Kills what a failed start left running: Ray's processes carry their session directory in their
    arguments, and a start that failed half way has no node object left to stop them. A child forked
    just before the timeout may show its session only once it has exec'd, and a killed process keeps its
    arguments until it has exited, so the scan repeats until two in a row find nothing (bounded)."""
    if session is None or not Path("/proc").is_dir():
        return
    markers = (f"--session-dir={session}".encode(), f"--session_dir={session}".encode())
    deadline = time.monotonic() + settle_s
    quiet_scans = 0
    while quiet_scans < 2 and time.monotonic() < deadline:
        found = _pids_with_any(markers)
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        quiet_scans = 0 if found else quiet_scans + 1
        time.sleep(0.2)


def _pids_with_any(markers: tuple[bytes, ...]) -> list[int]:
    """Live processes whose command line holds any of these byte strings (zombies have none)."""
    pids = []
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            cmdline = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if any(marker in cmdline for marker in markers):
            pids.append(int(pid_dir.name))
    return pids


def build_training_data(settings: DataSettings, log: Log = print) -> Path:
    """Runs the missing stages; returns `settings.out_dir`."""
    import ray.data

    init_ray()
    ray.data.DataContext.get_current().execution_options.preserve_order = True  # reproducible shards
    out = Path(settings.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    if Source.SELF in settings.sources:
        _stage(out / ANSWERS, lambda path: _write_answers(settings, path), "self-distillation answers", log)
    built = _stage(out / FEATURES, lambda path: _write_features(settings, path), "target features", log)
    if not (out / COUNTS).is_file():
        _write_counts(out / FEATURES, out / COUNTS)
    # Each stage's own time, read back from its marker: a rerun that skips stages keeps the real cost.
    stage_seconds = {
        stage: float((out / stage / DONE).read_text().split()[0])
        for stage in (ANSWERS, FEATURES)
        if (out / stage / DONE).is_file()
    }
    # The settings that built the rows: a rerun that skips every stage (`train-draft` over data built
    # earlier, with its own defaults) must not put its settings in their place.
    earlier = out / MANIFEST
    built_by = (
        jsonable(asdict(settings))
        if built or not earlier.is_file()
        else json.loads(earlier.read_text())["settings"]
    )
    manifest = {
        "settings": built_by,
        "stage_seconds": stage_seconds,
        "seconds_this_run": round(time.monotonic() - started, 1),
    }
    manifest["rows"] = ray.data.read_parquet(str(out / FEATURES)).select_columns(["source"]).count()
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"training data ready in {out} ({manifest['rows']} rows of {settings.seq_len} tokens)")
    return out


def _stage(path: Path, run: Callable[[Path], None], what: str, log: Log) -> bool:
    """Runs the stage unless it finished before; returns whether it ran."""
    if (path / DONE).is_file():
        log(f"{what}: already in {path}, skipped")
        return False
    shutil.rmtree(path, ignore_errors=True)  # a half-written stage is redone from scratch
    log(f"{what}: generating into {path}")
    started = time.monotonic()
    run(path)
    (path / DONE).write_text(f"{time.monotonic() - started:.1f} s\n")
    log(f"{what}: done in {time.monotonic() - started:.0f} s")
    return True


# --- stage 1: the target's answers -------------------------------------------------------------


class AnswerWriter:
    """Ray Data actor: holds the target once, answers a batch of prompts per call."""

    def __init__(self, model_dir: str, max_new_tokens: int, num_threads: int) -> None:
        from specserve.models import load_causal_lm, load_tokenizer

        torch.set_num_threads(num_threads)
        self.model = load_causal_lm(Path(model_dir), linear_kernel="auto")  # the served runtime's kernel
        self.tokenizer = load_tokenizer(Path(model_dir))
        self.max_new_tokens = max_new_tokens

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        from specserve.training.answers import generate_answers

        answers = generate_answers(self.model, self.tokenizer, list(batch["prompt"]), self.max_new_tokens)
        return {"token_ids": ragged_int32(answers)}


def ragged_int32(rows: list[list[int]]) -> np.ndarray:
    """A 1-D object array of int32 arrays: one Arrow type for every batch, whatever the row lengths
    (np.array on equal-length rows would make a 2-D int64 array, which Arrow cannot unify)."""
    out = np.empty(len(rows), dtype=object)
    for i, row in enumerate(rows):
        out[i] = np.asarray(row, dtype=np.int32)
    return out


def _write_answers(settings: DataSettings, path: Path) -> None:
    import ray.data

    prompts = written_prompts(settings.self_prompts, settings.seed)
    ds = ray.data.from_items([{"prompt": p} for p in prompts])
    kwargs = {"model_dir": str(settings.model_dir), "max_new_tokens": settings.answer_tokens}
    _with_target(ds, AnswerWriter, kwargs, settings.answer_batch).write_parquet(str(path))


def _with_target(ds: Any, actor: type, kwargs: dict[str, Any], batch_size: int) -> Any:
    """Maps batches through one actor that loads the target once; it may use all of this node's cores.

    On a cluster, raise the pool size to run several copies of the target side by side.
    """
    import ray.data

    return ds.map_batches(
        actor,
        fn_constructor_kwargs={**kwargs, "num_threads": os.cpu_count() or 1},
        batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(size=1),
        num_cpus=1,
    )


# --- stage 2: documents -> packed rows -> target features --------------------------------------


def _documents(settings: DataSettings, tokenizer: Any) -> dict[Source, list[list[int]]]:
    """Token ids of every document, per source (the self answers are read from stage 1)."""
    import ray.data

    from specserve.models import encode_messages

    docs: dict[Source, list[list[int]]] = {}
    for source in settings.sources:
        if source is Source.SELF:
            table = ray.data.read_parquet(str(Path(settings.out_dir) / ANSWERS)).take_all()
            docs[source] = [list(map(int, row["token_ids"])) for row in table]
        elif source is Source.DUMMY:
            conversations = dummy_conversations()[: settings.dummy_conversations]
            docs[source] = [encode_messages(tokenizer, c, add_generation_prompt=False) for c in conversations]
        else:
            limit = settings.pydoc_chars if source is Source.PYDOC else settings.stdlib_chars
            texts = read_documents(source, limit, settings.seed)
            docs[source] = [[*tokenizer.encode(t), tokenizer.eos_token_id] for t in texts]
    return docs


class FeatureWriter:
    """Ray Data actor: holds the frozen target, turns packed rows into (K/V, labels)."""

    def __init__(self, model_dir: str, layer: int, seq_len: int, num_threads: int) -> None:
        from specserve.models import load_causal_lm

        torch.set_num_threads(num_threads)
        self.model = load_causal_lm(Path(model_dir), linear_kernel="auto")
        self.layer, self.seq_len = layer, seq_len

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        from specserve.training.features import pad_rows, target_features

        rows = [list(map(int, r)) for r in batch["input_ids"]]
        input_ids = pad_rows(rows, self.seq_len, pad_id=0)  # [B, S]
        features = target_features(self.model, input_ids, [len(r) for r in rows], self.layer)
        return {
            "source": batch["source"],
            "input_ids": input_ids.to(torch.int32).numpy(),
            **{name: value.numpy() for name, value in features.items()},
        }


def _write_features(settings: DataSettings, path: Path) -> None:
    import random

    import ray.data

    from specserve.models import load_tokenizer
    from specserve.training.features import pack_tokens

    tokenizer = load_tokenizer(Path(settings.model_dir))
    rows: list[dict[str, Any]] = []
    for source, documents in _documents(settings, tokenizer).items():
        packed = pack_tokens(documents, settings.seq_len)
        rows += [{"source": str(source), "input_ids": r} for r in packed]
    random.Random(settings.seed).shuffle(rows)  # mixed sources in every shard and every batch
    kwargs = {
        "model_dir": str(settings.model_dir),
        "layer": settings.target_layer,
        "seq_len": settings.seq_len,
    }
    ds = _with_target(ray.data.from_items(rows), FeatureWriter, kwargs, settings.feature_batch)
    ds.write_parquet(str(path))


def _write_counts(features: Path, path: Path) -> None:
    import ray.data
    from safetensors.torch import save_file

    counts: np.ndarray | None = None
    for batch in (
        ray.data.read_parquet(str(features)).select_columns(["labels"]).iter_batches(batch_format="numpy")
    ):
        labels = np.asarray(batch["labels"]).ravel()
        found = np.bincount(labels[labels >= 0])
        counts = found if counts is None else _add(counts, found)
    assert counts is not None, "no training rows"
    save_file({"counts": torch.from_numpy(counts.astype(np.int64))}, str(path))


def _add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    size = max(len(a), len(b))
    return np.pad(a, (0, size - len(a))) + np.pad(b, (0, size - len(b)))


def jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return str(value) if isinstance(value, Path) else value
