"""The target's own answers at scale: sharded, resumable, batched generation of self-distillation text.

Only the text is kept (uint16 token ids, compressed): labels, top-k probabilities and K/V features come
later from a teacher-forced float32 forward over prompt + answer (`distill/feature_extraction.py`), so
generation may run in bfloat16 with a large left-padded batch and a static KV cache, which is where a
CPU's throughput is.

Layout of a stage directory (`instruct/`: the self-instruct requests; `answers/`: every other prompt):
    prompts.json.gz       the stage's prompt set, frozen at its first run (a resume never rebuilds it)
    shard-00000.npz       finished shards, written atomically (temp file + rename)
    shard-00001.part/     a shard in progress: one batch-NNN.npz per finished batch
Every batch's decoding is a pure function of (seed, shard, batch): greedy or sampled at a temperature
from `TEMPERATURES`, with a torch seed derived from its global index. So a killed run resumes at the
next unfinished batch, and the rows it writes are the ones an uninterrupted run writes.

Shards are independent: `--workers N` hands them to N Ray actors (each a copy of the target, on a GPU
of its own with `--device cuda`); the default runs them in this process, on `--device` (cpu by default).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from specserve.errors import InvalidArgument
from specserve.training.device import parse_device, usable_device
from specserve.training.prompt_set import Prompt

# Decoding of batch g: TEMPERATURES[g % len]; 0 = greedy. Half greedy, half sampled at T in 0.7..1.0.
TEMPERATURES = (0.0, 0.7, 0.0, 0.85, 0.0, 1.0)
INSTRUCT, ANSWERS, PROMPTS_FILE = "instruct", "answers", "prompts.json.gz"


@dataclass(frozen=True)
class GenerationSettings:
    shard_size: int = 192  # prompts per shard file
    batch_size: int = 48  # prompts per batched generate call
    max_new_tokens: int = 256
    max_prompt_tokens: int = 640  # longer prompts are skipped (padding would dominate their batch)
    dtype: str = "auto"  # only the text is kept; auto: see generation_dtype
    static_cache: bool = True
    seed: int = 0
    # "cpu", "cuda" or "cuda:N". A batch's rows are a function of (seed, shard, batch) on one device; a
    # GPU samples from its own generator and rounds differently, so it writes other (equally valid) text.
    device: str = "cpu"

    def __post_init__(self) -> None:
        parse_device(self.device)  # the name only: whether this machine has the GPU is checked at load


@dataclass(frozen=True)
class Rows:
    """Generated rows: prompt and answer token ids, flat, with per-row lengths."""

    prompt_index: np.ndarray  # [N] int32, index into the stage's prompt set
    temperature: np.ndarray  # [N] float32, 0 = greedy
    prompt_ids: np.ndarray  # [sum P] uint16
    prompt_lengths: np.ndarray  # [N] int32
    answer_ids: np.ndarray  # [sum A] uint16
    answer_lengths: np.ndarray  # [N] int32
    truncated: np.ndarray  # [N] bool: hit max_new_tokens before the eos

    def save(self, path: Path) -> None:
        """Atomic: a reader never sees half a file."""
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(tmp, **asdict(self))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> Rows:
        with np.load(path, allow_pickle=False) as f:
            return cls(**{k: f[k] for k in cls.__dataclass_fields__})

    @classmethod
    def concat(cls, parts: Sequence[Rows]) -> Rows:
        return cls(**{k: np.concatenate([getattr(p, k) for p in parts]) for k in cls.__dataclass_fields__})

    def __len__(self) -> int:
        return len(self.prompt_index)

    def sequences(self) -> list[tuple[list[int], list[int]]]:
        """[(prompt ids, answer ids)] per row."""
        p_ends, a_ends = np.cumsum(self.prompt_lengths), np.cumsum(self.answer_lengths)
        out = []
        for i in range(len(self)):
            p0, a0 = p_ends[i] - self.prompt_lengths[i], a_ends[i] - self.answer_lengths[i]
            out.append(
                (
                    self.prompt_ids[p0 : p_ends[i]].astype(np.int64).tolist(),
                    self.answer_ids[a0 : a_ends[i]].astype(np.int64).tolist(),
                )
            )
        return out


def _rows(
    indices: Sequence[int],
    temperature: float,
    prompts: Sequence[list[int]],
    answers: Sequence[list[int]],
    truncated: Sequence[bool],
) -> Rows:
    for ids in [*prompts, *answers]:
        if ids and max(ids) > np.iinfo(np.uint16).max:
            raise ValueError("token ids above 65535 do not fit uint16")
    return Rows(
        prompt_index=np.asarray(indices, dtype=np.int32),
        temperature=np.full(len(indices), temperature, dtype=np.float32),
        prompt_ids=np.asarray([t for p in prompts for t in p], dtype=np.uint16),
        prompt_lengths=np.asarray([len(p) for p in prompts], dtype=np.int32),
        answer_ids=np.asarray([t for a in answers for t in a], dtype=np.uint16),
        answer_lengths=np.asarray([len(a) for a in answers], dtype=np.int32),
        truncated=np.asarray(truncated, dtype=bool),
    )


# --- the prompt set of a stage, frozen on disk ---------------------------------------------------------


def save_prompts(path: Path, prompts: Sequence[Prompt]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        json.dump([{"source": p.source, "messages": [list(m) for m in p.messages]} for p in prompts], f)
    os.replace(tmp, path)


def load_prompts(path: Path) -> list[Prompt]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [Prompt(r["source"], tuple((role, c) for role, c in r["messages"])) for r in json.load(f)]


# --- generating one batch and one shard ------------------------------------------------------------------


def batch_seed(seed: int, global_batch: int) -> int:
    return (seed * 1_000_003 + global_batch * 7919) % (2**31)


@torch.inference_mode()
def generate_batch(
    model: Any,
    prompts: Sequence[list[int]],
    eos_id: int,
    pad_id: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    static_cache: bool = False,
) -> tuple[list[list[int]], list[bool]]:
    """-> (answer ids per prompt, ending with the eos when there is one; truncated flags). Runs on the
    model's device."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, W], left-padded
    attention_mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(prompts):
        input_ids[i, width - len(ids) :] = torch.tensor(ids)
        attention_mask[i, width - len(ids) :] = 1
    device = next(model.parameters()).device
    kwargs: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        kwargs = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    if static_cache:
        kwargs["cache_implementation"] = "static"
    torch.manual_seed(seed)  # every device's generator, a GPU's included
    out = model.generate(
        input_ids=input_ids.to(device, non_blocking=True),
        attention_mask=attention_mask.to(device, non_blocking=True),
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        **kwargs,
    )  # [B, W + new]
    answers, truncated = [], []
    for row in out[:, width:].tolist():
        if eos_id in row:
            answers.append(row[: row.index(eos_id) + 1])
            truncated.append(False)
        else:
            answers.append(row)
            truncated.append(True)
    return answers, truncated


def shard_count(num_prompts: int, shard_size: int) -> int:
    return -(-num_prompts // shard_size)


def shard_batches(encoded: Sequence[list[int]], shard: int, settings: GenerationSettings) -> list[list[int]]:
    """Prompt indices of each batch of `shard`: the shard's prompts sorted by length (less padding)."""
    start = shard * settings.shard_size
    members = [i for i in range(start, min(start + settings.shard_size, len(encoded))) if encoded[i]]
    members.sort(key=lambda i: (len(encoded[i]), i))
    return [members[b : b + settings.batch_size] for b in range(0, len(members), settings.batch_size)]


def batches_per_shard(settings: GenerationSettings) -> int:
    return -(-settings.shard_size // settings.batch_size)


Progress = Callable[[int, int], None]  # (batches just finished, answer tokens in them)


def generate_shard(
    model: Any,
    encoded: Sequence[list[int]],  # prompt ids per prompt of the stage; [] = skipped
    shard: int,
    stage_dir: Path,
    settings: GenerationSettings,
    eos_id: int,
    pad_id: int,
    progress: Progress | None = None,
    stop_after_batches: int | None = None,  # tests: simulate a run killed mid-shard
) -> Path | None:
    """Generates (or finishes) one shard; returns its file, or None when stopped early."""
    final = stage_dir / f"shard-{shard:05d}.npz"
    if final.is_file():
        return final
    part_dir = stage_dir / f"shard-{shard:05d}.part"
    part_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    done_now = 0
    for b, indices in enumerate(shard_batches(encoded, shard, settings)):
        part = part_dir / f"batch-{b:03d}.npz"
        if part.is_file():
            parts.append(Rows.load(part))
            continue
        if stop_after_batches is not None and done_now >= stop_after_batches:
            return None
        g = shard * batches_per_shard(settings) + b
        temperature = TEMPERATURES[g % len(TEMPERATURES)]
        prompts = [list(encoded[i]) for i in indices]
        answers, truncated = generate_batch(
            model,
            prompts,
            eos_id,
            pad_id,
            settings.max_new_tokens,
            temperature,
            batch_seed(settings.seed, g),
            settings.static_cache,
        )
        rows = _rows(indices, temperature, prompts, answers, truncated)
        rows.save(part)
        parts.append(rows)
        done_now += 1
        if progress is not None:
            progress(1, int(rows.answer_lengths.sum()))
    merged = Rows.concat(parts) if parts else _rows([], 0.0, [], [], [])
    order = np.argsort(merged.prompt_index, kind="stable")
    merged = _reorder(merged, order)
    merged.save(final)
    shutil.rmtree(part_dir, ignore_errors=True)
    return final


def _reorder(rows: Rows, order: np.ndarray) -> Rows:
    seqs = rows.sequences()
    prompts = [seqs[i][0] for i in order]
    answers = [seqs[i][1] for i in order]
    out = _rows(rows.prompt_index[order].tolist(), 0.0, prompts, answers, rows.truncated[order].tolist())
    return Rows(**{**asdict(out), "temperature": rows.temperature[order]})


def read_stage(stage_dir: Path) -> Rows:
    """Every finished shard of a stage, in shard order."""
    files = sorted(Path(stage_dir).glob("shard-*[0-9].npz"))
    parts = [Rows.load(f) for f in files]
    return Rows.concat(parts) if parts else _rows([], 0.0, [], [], [])


# --- a whole stage ---------------------------------------------------------------------------------


def encode_prompts(tokenizer: Any, prompts: Sequence[Prompt], max_tokens: int) -> list[list[int]]:
    from specserve.models import encode_messages

    out = []
    for p in prompts:
        ids = encode_messages(tokenizer, p.as_chat(), add_generation_prompt=True)
        out.append(ids if len(ids) <= max_tokens else [])
    return out


def run_stage(
    model: Any,
    tokenizer: Any,
    stage_dir: Path,
    make_prompts: Callable[[], list[Prompt]],
    settings: GenerationSettings,
    max_shards: int | None = None,
    log: Callable[[str], None] = print,
    stop_after_batches: int | None = None,
    worker: tuple[int, int] = (0, 1),  # (index, count): this worker takes shards s with s % count == index
) -> None:
    """Generates every shard of a stage (or the first `max_shards`), resuming what is on disk."""
    from tqdm import tqdm

    stage_dir.mkdir(parents=True, exist_ok=True)
    prompts_path = stage_dir / PROMPTS_FILE
    if not prompts_path.is_file():
        save_prompts(prompts_path, make_prompts())
    prompts = load_prompts(prompts_path)
    encoded = encode_prompts(tokenizer, prompts, settings.max_prompt_tokens)
    shards = shard_count(len(prompts), settings.shard_size)
    if max_shards is not None:
        shards = min(shards, max_shards)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    mine = [s for s in range(shards) if s % worker[1] == worker[0]]
    todo = [s for s in mine if not (stage_dir / f"shard-{s:05d}.npz").is_file()]
    total_batches = sum(len(shard_batches(encoded, s, settings)) for s in mine)
    done = total_batches - sum(len(shard_batches(encoded, s, settings)) for s in todo)
    done += sum(len(list((stage_dir / f"shard-{s:05d}.part").glob("batch-*[0-9].npz"))) for s in todo)
    log(f"{stage_dir.name}: {len(prompts)} prompts, {shards} shards, {done}/{total_batches} batches done")
    bar = tqdm(
        total=total_batches,
        initial=done,
        desc=stage_dir.name,
        unit="batch",
        file=sys.stderr,
        mininterval=10,
        dynamic_ncols=False,
        ncols=100,
    )
    started, tokens = time.monotonic(), 0

    def progress(batches: int, answer_tokens: int) -> None:
        nonlocal tokens
        tokens += answer_tokens
        bar.update(batches)
        bar.set_postfix_str(f"{tokens / (time.monotonic() - started):.0f} tok/s", refresh=False)

    for s in todo:
        stopped = (
            generate_shard(model, encoded, s, stage_dir, settings, eos, pad, progress, stop_after_batches)
            is None
        )
        if stopped:
            break
        log(
            f"{stage_dir.name}: shard {s} done ({tokens} answer tokens this run, "
            f"{tokens / max(time.monotonic() - started, 1e-9):.0f} tok/s)"
        )
    bar.close()


def generation_dtype(requested: str, device: str) -> str:
    """The dtype the target generates in. Only the text is kept, so `auto` takes the fastest: bfloat16,
    except on a CPU without a bf16 kernel (runtime/kernels.py, `speed_dtype`), where it is float32."""
    if requested != "auto":
        return requested
    from specserve.runtime.kernels import speed_dtype

    return speed_dtype("bfloat16", parse_device(device))


class GenerationWorker:
    """One copy of the target generating its share of a stage's shards (a Ray actor with --workers)."""

    def __init__(self, model_dir: str, settings: GenerationSettings, threads: int) -> None:
        from specserve.models import load_causal_lm, load_tokenizer

        usable_device(settings.device)
        torch.set_num_threads(threads)
        self.settings = settings
        # auto: oneDNN-packed weights on a CPU, cuBLAS on CUDA (runtime/kernels.py)
        self.model = load_causal_lm(
            Path(model_dir), device=settings.device, dtype=settings.dtype, linear_kernel="auto"
        )
        self.tokenizer = load_tokenizer(Path(model_dir))

    def run(self, stage_dir: str, worker: tuple[int, int], max_shards: int | None = None) -> None:
        def frozen() -> list[Prompt]:
            raise RuntimeError("the driver freezes a stage's prompts before workers start")

        run_stage(
            self.model, self.tokenizer, Path(stage_dir), frozen, self.settings, max_shards, worker=worker
        )


def run_generation(args: argparse.Namespace) -> None:
    from specserve.models import load_tokenizer, resolve_model_dir
    from specserve.settings import EngineSettings
    from specserve.training.prompt_set import (
        Prompt,
        base_prompts,
        finalise,
        parse_requests,
        self_instruct_requests,
        user,
    )

    settings = GenerationSettings(
        shard_size=args.shard_size,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        dtype=generation_dtype(args.dtype, args.device),
        static_cache=not args.dynamic_cache,
        seed=args.seed,
        device=args.device,
    )
    if not args.workers:
        usable_device(settings.device)  # before a model is looked for, loaded or written
    elif parse_device(settings.device).index is not None:
        # Ray shows each worker only the GPU it gave that worker, as cuda:0
        raise InvalidArgument("with --workers, Ray gives each worker its own GPU: use --device cuda")
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    engine = EngineSettings.from_env(model_dir=args.model_dir)
    model_dir = resolve_model_dir(engine.model_dir, engine.cache_dir, engine.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "settings.json").write_text(
        json.dumps({**asdict(settings), "model": model_dir.name}, indent=2) + "\n"
    )
    tokenizer = load_tokenizer(model_dir)

    def stage1() -> list[Prompt]:
        return finalise(self_instruct_requests(args.subjects_per_kind, args.seed), args.seed)

    def stage2() -> list[Prompt]:
        rows = read_stage(out / INSTRUCT)
        written = []
        for _, answer in rows.sequences():
            # One sequence decodes to one str (transformers types a batch's list[str] alike).
            text = cast(str, tokenizer.decode(answer, skip_special_tokens=True))
            written += [Prompt("self-instruct", user(q)) for q in parse_requests(text)]
        return finalise([*base_prompts(args.seed, args.docstrings), *written], args.seed)

    stages = [(out / INSTRUCT, stage1, None), (out / ANSWERS, stage2, args.max_shards)]
    if not args.workers:  # here, in this process
        local = GenerationWorker(str(model_dir), settings, threads)
        for stage_dir, make_prompts, max_shards in stages:
            run_stage(local.model, tokenizer, stage_dir, make_prompts, settings, max_shards)
        return
    import ray

    from specserve.training.data import init_ray

    init_ray()
    gpus = 1 if parse_device(settings.device).type == "cuda" else 0
    actor = ray.remote(num_cpus=1, num_gpus=gpus)(GenerationWorker)
    # Any: ray types an actor method's `.remote` only under @ray.method, and ray is imported lazily.
    workers: list[Any] = [actor.remote(str(model_dir), settings, threads) for _ in range(args.workers)]
    for stage_dir, make_prompts, max_shards in stages:
        stage_dir.mkdir(parents=True, exist_ok=True)
        if not (stage_dir / PROMPTS_FILE).is_file():  # frozen once, by the driver
            save_prompts(stage_dir / PROMPTS_FILE, make_prompts())
        ray.get([w.run.remote(str(stage_dir), (i, len(workers)), max_shards) for i, w in enumerate(workers)])


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m specserve.training.generation",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model-dir", type=Path)
    p.add_argument("--shard-size", type=int, default=192)
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-shards", type=int, help="stage 2: stop after this many shards")
    p.add_argument("--subjects-per-kind", type=int, default=46)
    p.add_argument("--docstrings", type=int, default=1500)
    p.add_argument(
        "--dtype", default="auto", help="auto: bfloat16 where it is fast (a GPU, AVX-512), else float32"
    )
    p.add_argument("--dynamic-cache", action="store_true")
    p.add_argument("--threads", type=int, help="torch threads per copy of the target")
    p.add_argument("--workers", type=int, default=0, help="Ray actors (0 = generate in this process)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--device",
        default=GenerationSettings.device,
        help="cpu, cuda or cuda:N: where the target generates (with --workers, each worker gets a GPU)",
    )
    run_generation(p.parse_args(argv))


if __name__ == "__main__":
    main()
