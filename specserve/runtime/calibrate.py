"""Measures this machine's costs for the `cost` stop policy: a target forward over n tree nodes on top
of a prompt's KV, and one draft step. `specserve calibrate` saves them; the engine loads or measures
them once at start-up (core/cost.py says how they are used).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specserve.core.cost import CostModel, DraftCost
from specserve.core.protocols import DraftTree
from specserve.core.tree import tree_depths
from specserve.core.tree_mask import tree_attention_mask
from specserve.errors import NotFound
from specserve.runtime.runner import ModelRunner
from specserve.runtime.segment import Segment

logger = logging.getLogger(__name__)

# Every size up to 16, then coarser: a CPU's curve is jagged at small sizes (MKL picks its GEMM kernel
# by row count: 8 nodes verify faster than 7 here), and interpolating between powers of two hid that.
VERIFY_SIZES = (*range(1, 17), 24, 32, 48, 64)
PROMPT_TOKENS = 128  # a typical chat prompt; attention over it is part of every verify
# Continuous batching puts many sessions' trees in one forward: totals measured as batches of 8-node
# trees, one per session (the batch-aware cost policy, core/cost.py, reads the curve up there).
BATCH_TOTALS = (96, 128, 192, 256)
PROGRESS_LOG_SECONDS = 10.0  # a measurement's progress in a log, at most this often
BATCH_TREE_NODES = 8
SETTLE_CALLS = 1  # untimed calls of a size before each timed one (`time_by_size`)


def best_of(fn: Callable[[], object], repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls after one warm-up: the least disturbed by other load."""
    return interleaved_best([fn], repeats)[0]


def interleaved_best(
    fns: Sequence[Callable[[], object]],
    passes: int,
    clock: Callable[[], float] = time.perf_counter,
    on_call: Callable[[], object] = lambda: None,
    settle: int = 0,
) -> list[float]:
    """Seconds of each of `fns`: the fastest of `passes` calls, after one warm-up pass; with `settle`,
    each timed call follows that many untimed calls of the same fn in its pass.

    The calls go round-robin (every fn once per pass), not fn by fn: a forward streaming gigabytes of
    weights is paced by memory bandwidth, which drifts over tens of seconds on a shared host (and while
    the kernel settles a freshly loaded model's pages). Measured fn by fn, a slow stretch lands on a run
    of neighbouring sizes and bends the curve the cost policy reads (two such calibrations of a 1.5B
    model minutes apart read its 8-node forward as 2.77 and 1.06 one-token steps); interleaved, every
    size sees the same stretches."""
    for fn in fns:
        fn()
        on_call()
    best = [float("inf")] * len(fns)
    for _ in range(passes):
        for i, fn in enumerate(fns):
            for _ in range(settle):
                fn()
                on_call()
            start = clock()
            fn()
            best[i] = min(best[i], clock() - start)
            on_call()
    return best


def binary_tree_parents(num_nodes: int) -> list[int]:
    """A bushy tree shape (node i's parent is (i - 1) // 2), like a CaPE or multi-candidate tree."""
    return [-1] + [(i - 1) // 2 for i in range(1, num_nodes)]


def tree_verify_calls(
    runner: ModelRunner, sizes: Sequence[int], prompt_tokens: int = PROMPT_TOKENS
) -> list[Callable[[], None]]:
    """One call per size: a target forward over an n-node bushy tree after a prompt_tokens-long prefix,
    undone after (the cache holds the prefix between calls)."""
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, runner.vocab_size, (prompt_tokens,), generator=generator).tolist()
    cache = runner.new_cache(prompt_tokens + max(sizes) + 1)
    runner.forward(cache, prompt, last_only=True)
    calls: list[Callable[[], None]] = []
    for n in sizes:
        tokens = torch.randint(0, runner.vocab_size, (n,), generator=generator).tolist()
        parents = binary_tree_parents(n)

        def verify(tokens: list[int] = tokens, parents: list[int] = parents) -> None:
            runner.forward(cache, tokens, parents)
            cache.truncate(prompt_tokens)

        calls.append(verify)
    return calls


def measure_verify_s(
    runner: ModelRunner,
    sizes: Sequence[int] = VERIFY_SIZES,
    prompt_tokens: int = PROMPT_TOKENS,
    repeats: int = 3,
) -> tuple[tuple[int, float], ...]:
    """(n, seconds of one target forward over an n-node tree after a prompt_tokens-long prefix) per n."""
    # About 30 s for the default sizes on 2 CPU cores.
    return time_by_size(
        sizes, tree_verify_calls(runner, sizes, prompt_tokens), repeats, "calibrating verify cost"
    )


def measure_draft_costs(
    propose: Callable[[int], DraftTree],  # depth -> a proposal of a chain of that many tokens
    short: int = 1,
    long: int = 9,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, float]:
    """(one draft step's seconds, a proposal's fixed seconds): the slope of a proposal's time between two
    chain lengths, and what is left of the short one's time beyond its steps (re-encoding the root, the
    tree and policy bookkeeping). `propose` should keep its draft cache between calls, as a session's
    drafter does, so the fixed part is a round's and not a first call's prefill. Both lengths are timed
    as the verify curve's sizes are (`time_by_size`: round-robin, the long first, each after one untimed
    call of its own): a short proposal timed right after larger forwards reads slow on some hosts, and
    what it reads too much lands whole on the fixed cost."""
    (_, t_short), (_, t_long) = time_by_size(
        (short, long), (lambda: propose(short), lambda: propose(long)), repeats, "timing draft steps", clock
    )
    step = max(0.0, (t_long - t_short) / (long - short))
    return step, max(0.0, t_short - short * step)


class SyntheticTargetState:
    """Stands in for a session's committed target state when a draft's step is timed where the target is
    not (a draft replica holds no target layer): random K/V of the target's shape for any layer read,
    random features of any width asked. A forward's time depends on shapes, not on values."""

    def __init__(
        self, config: Any, num_positions: int, device: str | torch.device, dtype: torch.dtype
    ) -> None:
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        generator = torch.Generator().manual_seed(0)
        kv = torch.randn(2, 1, kv_heads, num_positions, head_dim, generator=generator)  # [2, 1, Hkv, L, D]
        self._kv = kv.to(device=device, dtype=dtype)
        self._features = torch.randn(1, num_positions, config.hidden_size, generator=generator).to(
            device, dtype
        )
        self._width = config.hidden_size

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kv[0], self._kv[1]  # every layer alike

    def keep_features(self, layers: Sequence[int] = ()) -> None:
        self._width = self._features.shape[2] * max(1, len(layers))

    def hidden_states(self) -> torch.Tensor:
        """[1, L, F]: the final hidden states, or k layers' outputs side by side."""
        copies = self._width // self._features.shape[2]
        return self._features.repeat(1, 1, copies)


def measure_draft_cost(
    make_drafter: Callable[[SyntheticTargetState, int], Any],  # (target state, chain depth) -> a drafter
    target_config: Any,
    device: str | torch.device,
    dtype: torch.dtype,
    repeats: int = 3,
) -> DraftCost:
    """One kind of draft's step and fixed costs on this host, over a prompt of PROMPT_TOKENS committed
    positions of synthetic target state: no target forward is needed, so a draft replica measures its
    own costs. The drafters are released after."""
    state = SyntheticTargetState(target_config, PROMPT_TOKENS, device, dtype)
    prompt = [i % target_config.vocab_size for i in range(10, 11 + PROMPT_TOKENS)]  # the root last
    drafters: dict[int, Any] = {}  # one per depth, kept: its cache holds the prompt

    def propose(depth: int) -> DraftTree:
        if depth not in drafters:
            drafters[depth] = make_drafter(state, depth)
        return drafters[depth].propose(prompt, round_seed=0, batch_sessions=1)

    try:
        step, overhead = measure_draft_costs(propose, repeats=repeats)
    finally:
        for drafter in drafters.values():
            drafter.release()
    return DraftCost(step, overhead)


def measure_batch_verify_s(
    runner: ModelRunner,
    totals: Sequence[int] = BATCH_TOTALS,
    prompt_tokens: int = PROMPT_TOKENS,
    repeats: int = 3,
) -> tuple[tuple[int, float], ...]:
    """(total, seconds of one forward over total / BATCH_TREE_NODES sessions' 8-node trees) per total."""
    generator = torch.Generator().manual_seed(1)
    sessions = max(totals) // BATCH_TREE_NODES
    caches = [runner.new_cache(prompt_tokens + BATCH_TREE_NODES + 1) for _ in range(sessions)]
    for cache in caches:
        prompt = torch.randint(0, runner.vocab_size, (prompt_tokens,), generator=generator).tolist()
        runner.forward(cache, prompt, last_only=True)
    parents = binary_tree_parents(BATCH_TREE_NODES)
    depths = torch.tensor(tree_depths(parents))
    tree = tree_attention_mask(parents, runner.device)  # [8, 8]
    attend = torch.cat([torch.ones(BATCH_TREE_NODES, prompt_tokens, dtype=torch.bool), tree], dim=1)
    steps = []
    for total in totals:
        used = caches[: total // BATCH_TREE_NODES]
        segments = [
            Segment(
                c,
                torch.randint(0, runner.vocab_size, (BATCH_TREE_NODES,)).tolist(),
                prompt_tokens + depths,
                attend,
            )
            for c in used
        ]

        def verify(segments=segments, used=used) -> None:
            runner.forward_batch(segments)
            for cache in used:
                cache.truncate(prompt_tokens)

        steps.append(verify)
    return time_by_size(totals, steps, repeats, "calibrating batched verify")


def time_by_size(
    sizes: Sequence[int],
    calls: Sequence[Callable[[], object]],
    repeats: int,
    desc: str,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[tuple[int, float], ...]:
    """(size, seconds) per call, timed round-robin, with progress in forwards: a bar on a terminal, a log
    line every PROGRESS_LOG_SECONDS elsewhere (a service's first start measures for minutes on a large
    model, and whoever waits for it, a person or a stack's start-up, reads its log).

    Each pass goes from the largest size down, and each size is timed after SETTLE_CALLS untimed calls
    of its own: on some hosts a forward costs more right after a larger one, for many forwards (the
    weights' cache lines or the cores' clocks recovering: an Intel Xeon's one-token step took 7.3-7.8 ms
    right after a 64-token forward, 5.7-6.2 fifteen steps later, 3.9 in a run of steps), so a pass that
    went up from one token timed every small size just after the largest and read the curve flat:
    verify(8) 1.5-1.7 steps against 2.0-2.3 timed this way (docs/benchmarks.md, "An Intel Xeon host").
    A round's forward follows rounds of about its own size, which is what this times."""
    total = len(calls) * (repeats * (SETTLE_CALLS + 1) + 1)
    logged = ProgressLog(desc, total)
    with tqdm(total=total, desc=desc, unit="forward", file=sys.stderr, disable=None) as shown:

        def on_call() -> None:
            shown.update()
            logged.update()

        largest_first = sorted(range(len(calls)), key=lambda i: -sizes[i])
        seconds = interleaved_best(
            [calls[i] for i in largest_first], repeats, clock=clock, on_call=on_call, settle=SETTLE_CALLS
        )
    by_size = dict(zip(largest_first, seconds, strict=True))
    return tuple((size, by_size[i]) for i, size in enumerate(sizes))


class ProgressLog:
    """Logs `desc: done / total forwards` at most once every `every` seconds, and when done."""

    def __init__(
        self,
        desc: str,
        total: int,
        every: float = PROGRESS_LOG_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.desc, self.total, self.every, self.clock = desc, total, every, clock
        self.done = 0
        self.last = clock()

    def update(self) -> None:
        self.done += 1
        now = self.clock()
        if now - self.last >= self.every or self.done == self.total:
            self.last = now
            logger.info("%s: %d / %d forwards", self.desc, self.done, self.total)


def load_calibration(path: Path) -> CostModel:
    return CostModel.from_json(load_record(path))


def load_record(path: Path) -> dict:
    """A calibration record as saved: a whole cost model (`specserve calibrate`), a target's verify curve
    or a draft host's draft costs."""
    if not path.is_file():
        raise NotFound(f"no cost calibration at {path}; write one with `specserve calibrate`")
    return json.loads(path.read_text())


def save_calibration(cost: CostModel, path: Path, about: dict) -> Path:
    return save_record(cost.to_json(), path, about)


def save_record(costs: dict, path: Path, about: dict) -> Path:
    """Writes atomically: the target and draft services of one host may start together."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {**costs, **about, "threads": torch.get_num_threads(), "created": time.time()}
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(record, indent=2) + "\n")
    partial.replace(path)
    return path
