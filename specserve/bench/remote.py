"""`specserve bench --remote HOST:PORT`: the router's methods next to the in-process ones, in one run.

Remote methods are named `remote:<method>` and go through the client SDK, so their time is what a
client sees (tokenization, network, Redis included). Besides the usual table, each remote method gets a
per-round breakdown: draft and verify as the router sees them, the share spent inside the services
(the rest is network and serialization), Redis, and bytes on the wire per round.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import replace
from typing import Any

from specserve.client import Client
from specserve.client.common import GenerateOptions
from specserve.core.request import GenerationRequest
from specserve.results import FinishReason, GenerationResult, GenerationStats, OnTokens

REMOTE_PREFIX = "remote:"
_SUMMED = (
    "num_target_forwards",
    "num_generated_tokens",
    "draft_seconds",
    "verify_seconds",
    "draft_service_seconds",
    "target_service_seconds",
    "redis_seconds",
    "rpc_bytes",
    "kv_feed_bytes",
    "num_draft_fallbacks",
    "num_target_rebuilds",
    "num_prepared_proposals",
)


def client_options(request: GenerationRequest) -> GenerateOptions:
    """The client SDK's keyword arguments for `request` (the router has no allow_lossy: it serves no
    lossy method)."""
    return {
        "method": request.method,
        "max_new_tokens": request.stopping.max_new_tokens,
        "temperature": request.sampling.temperature,
        "top_p": request.sampling.top_p,
        "top_k": request.sampling.top_k,
        "seed": request.seed,
        "stop": request.stopping.stop,
        "ignore_eos": request.stopping.ignore_eos,
        "constraint": request.constraint,
    }


class WithRemote:
    """An EngineLike (bench/runner.py) that adds the router's methods to an in-process engine."""

    def __init__(self, engine: Any, address: str) -> None:
        self.engine = engine
        self.client = Client(address)
        self.remote_methods = [REMOTE_PREFIX + m["name"] for m in self.client.list_methods()]
        self.totals: dict[str, dict[str, float]] = defaultdict(
            lambda: dict.fromkeys((*_SUMMED, "num_requests"), 0.0)
        )

    @property
    def methods(self) -> list[str]:
        return [*self.engine.methods, *self.remote_methods]

    def generate(
        self, prompt: str, request: GenerationRequest, on_tokens: OnTokens | None = None
    ) -> GenerationResult:
        method = request.method
        if not method.startswith(REMOTE_PREFIX):
            return self.engine.generate(prompt, request, on_tokens)
        start = time.perf_counter()
        remote = replace(request, method=method.removeprefix(REMOTE_PREFIX))
        completion = self.client.generate(prompt, **client_options(remote))
        elapsed = time.perf_counter() - start
        s = completion.stats
        for key in _SUMMED:
            self.totals[method][key] += s.get(key, 0.0)
        self.totals[method]["num_requests"] += 1
        stats = GenerationStats(
            num_target_forwards=int(s["num_target_forwards"]),
            num_draft_tokens=int(s["num_draft_tokens"]),
            num_accepted_tokens=int(s["num_accepted_tokens"]),
            num_generated_tokens=int(s["num_generated_tokens"]),
            elapsed_s=elapsed,  # end to end, as the client sees it
            draft_s=s["draft_seconds"],
            verify_s=s["verify_seconds"],
        )
        return GenerationResult(
            completion.token_ids, completion.text, FinishReason(completion.finish_reason), stats
        )

    def breakdown(self) -> dict[str, dict[str, float]]:
        """Per remote method: milliseconds and bytes per speculation round."""
        out = {}
        for method, t in self.totals.items():
            rounds = max(1.0, t["num_target_forwards"])
            draft_ms, verify_ms = 1000 * t["draft_seconds"] / rounds, 1000 * t["verify_seconds"] / rounds
            draft_service_ms = 1000 * t["draft_service_seconds"] / rounds
            target_service_ms = 1000 * t["target_service_seconds"] / rounds
            out[method] = {
                "draft_ms_per_round": draft_ms,
                "draft_service_ms_per_round": draft_service_ms,
                "verify_ms_per_round": verify_ms,
                "target_service_ms_per_round": target_service_ms,
                "network_ms_per_round": draft_ms - draft_service_ms + verify_ms - target_service_ms,
                "redis_ms_per_round": 1000 * t["redis_seconds"] / rounds,
                "rpc_bytes_per_round": t["rpc_bytes"] / rounds,
                "kv_feed_bytes_per_round": t["kv_feed_bytes"] / rounds,
                "draft_fallbacks": t["num_draft_fallbacks"],
                # the prefill is not a round; a method without a draft prepares nothing
                "prepared_share": t["num_prepared_proposals"] / max(1.0, rounds - t["num_requests"]),
                "target_rebuilds": t["num_target_rebuilds"],
            }
        return out

    def format_breakdown(self) -> str:
        rows = self.breakdown()
        if not rows:
            return ""
        head = (
            "remote method          draft  (in svc)  verify  (in svc)  network  redis  rpc B/rnd  kv B/rnd"
            "  prepared"
        )
        lines = [head, "-" * len(head)]
        for method, r in rows.items():
            lines.append(
                f"{method:20s} {r['draft_ms_per_round']:7.1f} {r['draft_service_ms_per_round']:9.1f} "
                f"{r['verify_ms_per_round']:7.1f} {r['target_service_ms_per_round']:9.1f} "
                f"{r['network_ms_per_round']:8.1f} {r['redis_ms_per_round']:6.2f} "
                f"{r['rpc_bytes_per_round']:10.0f} {r['kv_feed_bytes_per_round']:9.0f}"
                f" {r['prepared_share']:9.0%}"
            )
        legend = (
            "(milliseconds per round; 'in svc' = inside the service's handler; 'prepared' = rounds whose"
            " tree the draft had built ahead from the KV feed)"
        )
        return "\n".join([*lines, legend])
