"""`specserve bench --workload multi-turn|doc-qa|doc-chat`: requests that share a prefix, timed with
the target's prefix cache off and on (runtime/prefix_cache.py).

- multi-turn: MT-Bench's questions with both turns, as a chat client sends them: the second request
  carries the first question, the model's own first answer and the second question.
- doc-qa: four questions about each of several ~1,500-token documents, each request the whole document
  then one question, as a RAG application asks. The documents are the grounded workload's texts
  (bench/data/grounded.jsonl: real prose and code), one category each, cut to DOC_TOKENS tokens.
- doc-chat: the same documents and questions as one conversation each: the first request is the document
  and the first question, and every later one carries the earlier questions and the model's own answers,
  as a chat client over an attached document sends them (a second turn after a ~1,500-token first one).

Per request: the time to the first token (TTFT: from the call to the first token emitted, the prefill
and the first token's choice) and tokens/s (generated tokens over the whole request, prefill included:
what the user waits for). In process each setting starts from an empty cache; through the stack
(`remote:<method>`) the target's cache is what the stack runs with (SPECSERVE_TARGET_PREFIX_CACHE_BYTES,
0 = off), so on and off are two runs against two stacks.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from specserve.bench.prompts import load_prompts
from specserve.bench.remote import REMOTE_PREFIX, client_options
from specserve.bench.workloads import GROUNDED_PATH
from specserve.core.request import GenerationRequest
from specserve.errors import InvalidArgument
from specserve.models.chat import encode_messages
from specserve.results import FinishReason, GenerationResult, GenerationStats, OnTokens

SESSION_WORKLOADS = ("multi-turn", "doc-qa", "doc-chat")
DOC_TOKENS = 1500
DOC_QUESTIONS = (
    "List the Python functions and methods the text above names.",
    "Summarize the text above in three sentences.",
    "Which standard library modules does the text above mention?",
    "What is the most important caveat the text above gives?",
)
CACHE_MODES = {"both": ("off", "on"), "on": ("on",), "off": ("off",)}

# (prompt ids, request, on_tokens) -> result: an engine's generate_ids, or the router's through the SDK
Generate = Callable[[list[int], GenerationRequest, OnTokens], GenerationResult]


@dataclass(frozen=True)
class Script:
    """One conversation (document None: each turn follows the previous turns and answers), one document
    with its questions (each asked after the document, alone), or a conversation over a document
    (`conversation`: the document opens the first turn, and each turn follows the earlier ones)."""

    script_id: str
    turns: tuple[str, ...]
    document: str | None = None
    conversation: bool = False

    @property
    def carries_answers(self) -> bool:
        return self.document is None or self.conversation


@dataclass
class TurnResult:
    script_id: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    elapsed_s: float
    generated_tokens: int
    token_ids: list[int] = field(default_factory=list)


def multi_turn_scripts(prompts_path: Any, limit: int | None) -> list[Script]:
    """MT-Bench (or an MT-Bench-format file) questions with at least two turns."""
    prompts = [p for p in load_prompts(prompts_path) if len(p.turns) >= 2][:limit]
    if not prompts:
        raise InvalidArgument("the multi-turn workload needs prompts with at least two turns")
    return [Script(str(p.question_id), p.turns) for p in prompts]


def doc_qa_scripts(tokenizer: Any, limit: int | None, conversation: bool = False) -> list[Script]:
    """One document per grounded category: its prompts joined, cut to DOC_TOKENS tokens; `conversation`:
    its questions asked as one conversation (doc-chat)."""
    by_category: dict[str, list[str]] = {}
    for line in GROUNDED_PATH.read_text(encoding="utf-8").splitlines():
        if line.strip():
            item = json.loads(line)
            by_category.setdefault(item["category"], []).append(item["turns"][0])
    scripts = []
    for category, texts in list(by_category.items())[:limit]:
        ids = tokenizer.encode("\n\n".join(texts), add_special_tokens=False)[:DOC_TOKENS]
        scripts.append(Script(category, DOC_QUESTIONS, tokenizer.decode(ids), conversation))
    return scripts


def run_script(
    generate: Generate, tokenizer: Any, script: Script, request: GenerationRequest
) -> list[TurnResult]:
    messages: list[dict[str, str]] = []
    results = []
    for index, user in enumerate(script.turns):
        content = user
        if script.document is not None and (index == 0 or not script.conversation):
            content = f"{script.document}\n\n{user}"
        if script.carries_answers:
            messages = [*messages, {"role": "user", "content": content}]
        else:
            messages = [{"role": "user", "content": content}]
        ids = encode_messages(tokenizer, messages, add_generation_prompt=True)
        first: list[float] = []
        start = time.perf_counter()

        def on_tokens(tokens: list[int], first: list[float] = first) -> None:
            if not first:
                first.append(time.perf_counter())

        result = generate(ids, request, on_tokens)
        elapsed = time.perf_counter() - start
        ttft = (first[0] if first else time.perf_counter()) - start
        stats = result.stats
        results.append(
            TurnResult(
                script.script_id,
                index,
                len(ids),
                stats.num_cached_tokens,
                ttft,
                elapsed,
                stats.num_generated_tokens,
                list(result.token_ids),
            )
        )
        if script.carries_answers:
            messages.append({"role": "assistant", "content": result.text})
    return results


def remote_generate(client: Any, method: str) -> Generate:
    """The router's generation of prompt ids through the client SDK, streamed (TTFT is the first chunk's)."""

    def generate(ids: list[int], request: GenerationRequest, on_tokens: OnTokens) -> GenerationResult:
        options = client_options(request) | {"method": method.removeprefix(REMOTE_PREFIX)}
        token_ids: list[int] = []
        text = ""
        last = None
        for chunk in client.stream(ids, **options):
            if chunk.token_ids:
                on_tokens(list(chunk.token_ids))
            token_ids += chunk.token_ids
            text += chunk.text
            last = chunk
        assert last is not None and last.finish_reason is not None
        s = last.stats
        stats = GenerationStats(
            num_target_forwards=int(s.get("num_target_forwards", 0)),
            num_generated_tokens=int(s.get("num_generated_tokens", len(token_ids))),
            num_cached_tokens=int(s.get("num_cached_tokens", 0)),
        )
        return GenerationResult(token_ids, text, FinishReason(last.finish_reason), stats)

    return generate


def summarize(turns: Sequence[TurnResult], reference: Sequence[TurnResult] | None = None) -> dict[str, Any]:
    """Ratios of totals; TTFT split into first turns (nothing to reuse) and later ones."""
    later = [t for t in turns if t.turn > 0]
    elapsed = sum(t.elapsed_s for t in turns)
    prompt = sum(t.prompt_tokens for t in turns)
    out: dict[str, Any] = {
        "requests": len(turns),
        "prompt_tokens": prompt,
        "cached_tokens": sum(t.cached_tokens for t in turns),
        "cached_share": sum(t.cached_tokens for t in turns) / prompt if prompt else 0.0,
        "ttft_first_turn_s": _mean([t.ttft_s for t in turns if t.turn == 0]),
        "ttft_later_turns_s": _mean([t.ttft_s for t in later]),
        "tokens_per_s": sum(t.generated_tokens for t in turns) / elapsed if elapsed else 0.0,
    }
    if reference is not None:
        out["identical_to_off"] = sum(
            a.token_ids == b.token_ids for a, b in zip(turns, reference, strict=True)
        )
    return out


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def run_session_workload(
    engine: Any,
    scripts: Sequence[Script],
    methods: Sequence[str],
    request: GenerationRequest,
    modes: Sequence[str],
    cache_bytes: int,
    client: Any = None,
) -> dict[str, Any]:
    """Every method on every script, per cache mode (in process) or as the stack runs (remote)."""
    tokenizer = engine.tokenizer
    results: dict[str, dict[str, Any]] = {}
    for method in methods:
        method_request = _with_method(request, method)
        runs: dict[str, list[TurnResult]] = {}
        if method.startswith(REMOTE_PREFIX):
            generate = remote_generate(client, method)
            runs["stack"] = [t for s in scripts for t in run_script(generate, tokenizer, s, method_request)]
        else:
            for mode in modes:
                engine.reset_prefix_cache(0)  # the warm-up leaves nothing behind
                engine.generate_ids(tokenizer.encode("Hello."), _warm_up(method_request))
                engine.reset_prefix_cache(cache_bytes if mode == "on" else 0)
                runs[mode] = [
                    t for s in scripts for t in run_script(engine.generate_ids, tokenizer, s, method_request)
                ]
            engine.reset_prefix_cache(cache_bytes)
        summary = {
            mode: summarize(turns, runs.get("off") if mode == "on" else None) for mode, turns in runs.items()
        }
        if "on" in summary and "off" in summary:
            on, off = summary["on"], summary["off"]
            if on["ttft_later_turns_s"] and off["ttft_later_turns_s"]:
                summary["later_turn_ttft_on_over_off"] = on["ttft_later_turns_s"] / off["ttft_later_turns_s"]
            if off["tokens_per_s"]:
                summary["tokens_per_s_on_over_off"] = on["tokens_per_s"] / off["tokens_per_s"]
        results[method] = {
            "summary": summary,
            "turns": {m: [asdict(t) for t in ts] for m, ts in runs.items()},
        }
    return results


def _with_method(request: GenerationRequest, method: str) -> GenerationRequest:
    return replace(request, method=method)


def _warm_up(request: GenerationRequest) -> GenerationRequest:
    return replace(request, stopping=replace(request.stopping, max_new_tokens=4))


def format_sessions(results: dict[str, Any]) -> str:
    head = (
        f"{'method':24s} {'cache':5s} {'reqs':>4s} {'cached':>7s} {'TTFT 1st':>9s} {'TTFT later':>10s} "
        f"{'tok/s':>7s} {'same':>5s}"
    )
    lines = [head, "-" * len(head)]
    for method, entry in results.items():
        summary = entry["summary"]
        for mode, s in summary.items():
            if not isinstance(s, dict):
                continue
            lines.append(
                f"{method:24s} {mode:5s} {s['requests']:4d} {s['cached_share']:7.0%} "
                f"{_ms(s['ttft_first_turn_s']):>9s} {_ms(s['ttft_later_turns_s']):>10s} "
                f"{s['tokens_per_s']:7.1f} {s.get('identical_to_off', '')!s:>5s}"
            )
        if "later_turn_ttft_on_over_off" in summary:
            lines.append(f"  later-turn TTFT on/off: {summary['later_turn_ttft_on_over_off']:.2f}")
        if "tokens_per_s_on_over_off" in summary:
            lines.append(f"  tok/s on/off: {summary['tokens_per_s_on_over_off']:.2f}x")
    lines.append(
        "(TTFT in ms; cached = prompt tokens taken from the prefix cache; same = outputs equal to off)"
    )
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f}"
