"""The OpenAI-compatible routes, served by the router process next to its gRPC API.

Every generation goes through `RouterServicer.start_session` and `stream_session`, the path gRPC
Generate takes: same validation, Redis state, rounds, metrics and cancellation. Streams are server-sent
events, one chunk per speculative round, ending in `data: [DONE]`; each chunk carries the round in a
`specserve` extension object (which tokens the target accepted from the draft, which it added itself).

Bodies are read and refused (content type, size, JSON, prompt length) by body.py before the tokenizer
runs. No CORS headers are sent: a page on another site can neither read a response nor send JSON.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from importlib.resources import files
from typing import Annotated, Any

from fastapi import FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.router.http.body import Body, BodyBounds, read_body
from services.router.http.errors import HttpError, error_body, from_specserve, invalid, too_large
from services.router.http.generation import (
    FINISH_REASONS,
    Generation,
    Round,
    TextAssembler,
    chat_logprobs,
    check_model,
    completion_logprobs,
    constraint_error,
    generation_request,
    usage,
)
from services.router.http.openapi import (
    GENERATION_RESPONSES,
    MODEL_RESPONSES,
    RESUME_RESPONSES,
    RuntimeBounds,
    install_openapi,
    nullable,
)
from services.router.http.schemas import ChatCompletionRequest, CompletionRequest, StreamOptions
from services.router.http.structured import BodyConstraint, body_constraint
from services.router.http.tool_calls import ToolStream
from services.router.http.tools import chat_messages, grammar_tool_mode, template_tools
from services.router.servicer import RouterServicer
from services.router.state import SessionRecord
from specserve import __version__
from specserve.catalog import method_info
from specserve.core.constraint import InvalidConstraint
from specserve.errors import SpecserveError, quoted
from specserve.v1 import router_pb2

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
STREAM_ID = r"^(chatcmpl|cmpl)-[A-Za-z0-9_-]{1,64}$"  # a streamed response's id: its kind and session id
MAX_TOKENS_PARAM = 2**31 - 1  # received_tokens: the wire's int32, as gRPC Resume takes it


class BodyLimit:
    """413 for request bodies over `max_bytes`, whether announced (Content-Length) or streamed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = too_large(self.max_bytes)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await JSONResponse(error_body(refusal), 413)(scope, receive, send)
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise refusal
            return message

        await self.app(scope, limited, send)


class Admission:
    """At most `limit` generations at once over HTTP; the next gets 429 at once (no queue)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.active = limit, 0
        self._lock = threading.Lock()

    def enter(self) -> Callable[[], None]:
        with self._lock:
            if self.active >= self.limit:
                raise HttpError(
                    429, f"the server is at its limit of {self.limit} concurrent generations; retry later",
                    "rate_limit_error", None, "overloaded",
                )  # fmt: skip
            self.active += 1
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                with self._lock:
                    self.active -= 1

        return release


def create_app(servicer: RouterServicer, secured: bool) -> FastAPI:
    """The API's routes; `secured`: bearer tokens are required (serving/auth.py, around this app), which
    the OpenAPI document declares."""
    settings = servicer.settings
    app = FastAPI(
        title="specserve",
        summary="An OpenAI-compatible API for speculative decoding (docs/api.md)",
        version=__version__,
        docs_url=None,  # the interactive pages load scripts from a CDN; the schema is enough for tools
        redoc_url=None,
        openapi_url=None,  # served below, built off the event loop
    )
    admission = Admission(settings.max_concurrent_rpcs)

    playground = files("services.router.http").joinpath("static/index.html").read_text()

    @app.exception_handler(HttpError)
    async def _http_error(request: Request, error: HttpError) -> JSONResponse:
        return JSONResponse(error_body(error), error.status)

    @app.exception_handler(SpecserveError)
    async def _specserve_error(request: Request, error: SpecserveError) -> JSONResponse:
        converted = from_specserve(error)
        return JSONResponse(error_body(converted), converted.status)

    @app.exception_handler(RequestValidationError)
    async def _parameter_error(request: Request, error: RequestValidationError) -> JSONResponse:
        # A path or query parameter (the bodies are read by body.py): 400 naming it, as a body field.
        first = error.errors()[0]
        param = str(first["loc"][-1]) if first.get("loc") else None
        body = error_body(invalid(f"{param}: {first['msg']}" if param else first["msg"], param))
        return JSONResponse(body, 400)

    @app.exception_handler(StarletteHTTPException)
    async def _route_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {error.detail}"
        code = {404: "unknown_url", 405: "method_not_allowed"}.get(error.status_code)
        body = error_body(HttpError(error.status_code, message, "invalid_request_error", None, code))
        # Starlette's headers carry a 405's `Allow` (the methods the path takes), which RFC 9110 requires.
        return JSONResponse(body, error.status_code, headers=error.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unexpected error in %s %s", request.method, request.url.path)
        body = error_body(HttpError(500, f"internal error: {type(error).__name__}", "server_error"))
        return JSONResponse(body, 500)

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        return HTMLResponse(playground)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    async def model_name() -> str:
        return (await asyncio.to_thread(lambda: servicer.model)).model_name

    def bounds() -> BodyBounds:
        return BodyBounds.of(
            servicer.model.max_prompt_tokens, servicer.tokenizer.max_token_chars, settings.http_max_body_bytes
        )

    async def read(request: Request, model: type[Body]) -> Body:
        return await read_body(request, model, await asyncio.to_thread(bounds))

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(await model_name())]}

    @app.get("/v1/models/{model_id:path}", responses=MODEL_RESPONSES)
    async def model(model_id: str) -> dict:
        served = await model_name()
        if model_id != served:
            raise HttpError(404, f"the model {quoted(model_id)} does not exist", "not_found_error", "model",
                            "model_not_found")  # fmt: skip
        return _model_card(served)

    @app.get("/v1/methods")
    async def methods() -> dict:
        """specserve's extension: the draft methods a request may name in `method`, with the axes it may
        name instead (`eagle+cape+cost+suffix`; any other valid axes are served too)."""
        listed = servicer.ListMethods(router_pb2.ListMethodsRequest(), None).methods
        return {
            "object": "list",
            "default": settings.default_method,
            "data": [
                {
                    "id": m.name,
                    "axes": method_info(m.name).axes_spelling,
                    "description": m.description,
                    "lossless": m.lossless,
                }
                for m in listed
            ],
        }

    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat_completions(request: Request) -> Response:
        """`chat.completion`, or with `stream: true` server-sent `chat.completion.chunk` events."""
        body = await read(request, ChatCompletionRequest)
        if not any(m.text.strip() for m in body.messages):
            # The callers' own text, as the document says: the tools' instructions and calls the router
            # renders into the prompt do not make a blank chat a conversation.
            raise invalid("the messages are empty", "messages")

        def prompt_ids() -> list[int]:
            tokenizer = servicer.tokenizer
            native = tokenizer.native_tools
            tools = template_tools(body) if native and body.tool_mode != "none" else None
            return tokenizer.encode_chat(chat_messages(body, native), tools)

        return await _serve(request, body, prompt_ids, ChatOutput)

    @app.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(request: Request) -> Response:
        """`text_completion`, or with `stream: true` server-sent `text_completion` events."""
        body = await read(request, CompletionRequest)

        def prompt_ids() -> list[int]:
            prompt = body.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                return list(prompt)
            text = prompt[0] if isinstance(prompt, list) and prompt else prompt
            return servicer.tokenizer.encode_text(text if isinstance(text, str) else "")

        return await _serve(request, body, prompt_ids, CompletionOutput)

    async def _serve(request: Request, body, prompt_ids: Callable[[], list[int]], output_type) -> Response:
        constraint = body_constraint(body)  # a malformed one is refused before anything starts
        release = admission.enter()
        try:
            served = await model_name()
            check_model(body, served)

            def start() -> SessionRecord:
                ids = prompt_ids()
                return servicer.start_session(generation_request(body, ids, servicer, constraint), ids)

            # In the request's context: the caller's principal (serving/auth.py BearerTokenASGI) binds the
            # session to its creator, as over gRPC.
            try:  # the router compiles the constraint before it stores the session
                record = await asyncio.to_thread(start)
            except InvalidConstraint as e:
                raise invalid(str(e), None if constraint is None else constraint.param) from None
            generation = Generation(record.session_id, lambda gone: servicer.stream_session(record, gone))
        except BaseException:
            release()
            raise
        output = output_type(servicer, body, record, served, record.request.method)
        return await _respond(request, body, generation, output, release, constraint)

    @app.get("/v1/streams/{stream_id}", responses=RESUME_RESPONSES)
    async def resume_stream(
        request: Request,
        stream_id: Annotated[str, Path(pattern=STREAM_ID)],
        received_tokens: Annotated[int | None, Query(ge=0, le=MAX_TOKENS_PARAM)] = None,
        include_usage: bool = False,
    ) -> Response:
        """specserve's extension: a streamed completion continued from its `received_tokens`-th token
        (else the `Last-Event-ID` header, else 0), for a client whose stream was cut (docs/api.md,
        Streaming). `stream_id` is the stream's `id` (`chatcmpl-...` or `cmpl-...`)."""
        output_type, session_id = _stream_kind(stream_id)
        received = received_tokens if received_tokens is not None else _last_event_id(request)
        release = admission.enter()
        try:
            served = await model_name()
            record, generated = await asyncio.to_thread(servicer.load_own, session_id)
            body = output_type.resumed_body(record, include_usage)
            generation = Generation(
                record.session_id, lambda gone: servicer.resume_session(session_id, received, gone)
            )
        except BaseException:
            release()
            raise
        output = output_type(
            servicer, body, record, served, record.request.method, received=generated[:received]
        )
        return await _respond(request, body, generation, output, release)

    async def _respond(
        request: Request,
        body,
        generation: Generation,
        output: Output,
        release,
        constraint: BodyConstraint | None = None,
    ) -> Response:
        loop = asyncio.get_running_loop()
        deadline = None if body.timeout_seconds is None else loop.time() + body.timeout_seconds

        def close() -> None:
            generation.cancel()  # a no-op once the session finished
            release()

        async def first_message() -> router_pb2.GenerateResponse | None:
            try:  # the prefill compiles a constraint: its errors come with the first message
                return await generation.next(deadline)
            except HttpError as e:
                raise constraint_error(e, constraint) from None

        if body.stream:
            try:  # errors before the first round still get their HTTP status
                first = await first_message()
            except BaseException:
                close()
                raise
            return SessionStream(_events(output, generation, first, deadline), close)
        watcher = asyncio.create_task(_cancel_on_disconnect(request, generation))
        try:
            message = await first_message()
            while message is not None:
                output.add(message)
                message = await generation.next(deadline)
            return JSONResponse(output.response())
        finally:
            watcher.cancel()
            close()

    def runtime_bounds() -> RuntimeBounds:
        """What this router accepts beyond the static bounds (schemas.py): the served model's name, its
        token limit, vocabulary and prompt bound, log-probabilities if its target reports them, the
        methods served here, and which of them need allow_lossy (or temperature 0: 1 when unset)."""
        info = servicer.model
        max_tokens = {"type": "integer", "minimum": 1, "maximum": info.max_new_tokens_limit}
        common = {
            "model": nullable({"enum": [info.model_name, ""]}),
            "method": nullable(
                {
                    "anyOf": [
                        {"enum": sorted(servicer.methods)},
                        {"type": "string", "pattern": servicer.method_support.axes_pattern()},
                    ]
                }
            ),
            "max_tokens": nullable(max_tokens),
        }
        token_ids = {"type": "integer", "minimum": 0, "maximum": info.vocab_size - 1}
        prompt = {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
                {"type": "array", "items": token_ids, "minItems": 1, "maxItems": info.max_prompt_tokens},
            ]
        }
        chat: dict[str, Any] = common | {"max_completion_tokens": nullable(max_tokens)}
        completion: dict[str, Any] = common | {"prompt": prompt}
        if not info.supports_logprobs:
            chat |= {"logprobs": {"const": False, "default": False}, "top_logprobs": nullable({"const": 0})}
            completion |= {"logprobs": {"type": "null", "default": None}}
        lossy = sorted(m for m in servicer.methods if not method_info(m).lossless)
        conditions = {}
        if lossy:
            conditions["lossy"] = {
                "if": {"properties": {"method": {"enum": lossy}}, "required": ["method"]},
                "then": {
                    "anyOf": [
                        {"properties": {"allow_lossy": {"const": True}}, "required": ["allow_lossy"]},
                        {"properties": {"temperature": {"const": 0}}, "required": ["temperature"]},
                    ]
                },
            }
        return {"ChatCompletionRequest": chat, "CompletionRequest": completion, "allOf": conditions}

    install_openapi(
        app,
        {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest},
        secured,
        runtime_bounds,
    )

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_document() -> JSONResponse:
        # Built once, off the event loop: its first build asks a target for the model's bounds.
        return JSONResponse(await asyncio.to_thread(app.openapi))

    return app


def _stream_kind(stream_id: str) -> tuple[type[Output], str]:
    """The output a stream id names (by its prefix) and its session id."""
    for output_type in (ChatOutput, CompletionOutput):
        if stream_id.startswith(output_type.id_prefix):
            return output_type, stream_id.removeprefix(output_type.id_prefix)
    raise HttpError(
        400,
        f"a stream id is a streamed response's id, chatcmpl-... or cmpl-..., got {quoted(stream_id)}",
        "invalid_request_error",
        "stream_id",
    )


def _last_event_id(request: Request) -> int:
    """The tokens the client has by the server-sent events' own reconnection header (0 without it)."""
    value = request.headers.get("last-event-id", "").strip()
    if not value:
        return 0
    if not value.isdigit() or len(value) > len(str(MAX_TOKENS_PARAM)):
        raise invalid(f"Last-Event-ID must be a token count, got {quoted(value)}", "Last-Event-ID")
    return int(value)


def _model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "specserve"}


async def _cancel_on_disconnect(request: Request, generation: Generation) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)
    generation.cancel()


class SessionStream(StreamingResponse):
    """Server-sent events whose session is cancelled however the response ends (finished, client gone,
    or never started)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _sse(data: dict, event_id: int | None = None) -> str:
    """One event; `event_id`: the tokens the client has once it read this event (where to resume)."""
    event = f"data: {json.dumps(data, separators=(',', ':'))}\n"
    return event + ("" if event_id is None else f"id: {event_id}\n") + "\n"


async def _events(output, generation: Generation, first, deadline: float | None) -> AsyncIterator[str]:
    try:
        for chunk in output.start_chunks():
            yield _sse(chunk, output.num_tokens)
        message = first
        while message is not None:
            for chunk in output.add(message):
                yield _sse(chunk, output.num_tokens)
            message = await generation.next(deadline)
        for chunk in output.end_chunks():
            yield _sse(chunk, output.num_tokens)
        yield "data: [DONE]\n\n"
    except HttpError as e:  # after the first event the status is sent: the error is an event
        yield _sse(error_body(e))
    except SpecserveError as e:
        yield _sse(error_body(from_specserve(e)))
    except Exception as e:
        # Whatever else goes wrong while this process lives still ends the stream with an event: a stream
        # cut without [DONE] or an error must mean the router process itself is gone.
        logger.exception("stream of session %s failed", generation.session_id)
        yield _sse(error_body(HttpError(500, f"internal error: {type(e).__name__}", "server_error")))


class Output:
    """Folds a session's messages into OpenAI's objects: stream chunks as they come, or one response."""

    object_name = ""
    id_prefix = ""

    def __init__(
        self, servicer: RouterServicer, body, record, model: str, method: str, received: Sequence[int] = ()
    ) -> None:
        """received: the tokens a resumed stream's client already has; the chunks continue from them."""
        self.tokenizer = servicer.tokenizer
        self.num_tokens = len(received)  # the tokens the client has once it read the last chunk
        self.body = body
        self.id = f"{self.id_prefix}{record.public_id}"
        self.session_id = record.public_id
        self.record = record
        self.prompt_tokens = len(record.prompt_ids)
        self.model, self.method = model, method
        self.created = int(time.time())
        self.text = TextAssembler(self.tokenizer, body.stop_strings, received)
        self.logprobs: list = []
        self.finish_reason: str | None = None
        self.stats: router_pb2.GenerationStats | None = None

    def add(self, message: router_pb2.GenerateResponse) -> list[dict]:
        """Accumulates one message; returns the stream chunks it makes."""
        if message.HasField("stats"):
            self.finish_reason = FINISH_REASONS.get(message.finish_reason, "stop")
            self.stats = message.stats
            rest = self.text.finish()
            return [self._chunk(rest, [], None)] if rest else []
        self.num_tokens += len(message.token_ids)
        num_accepted = message.round.num_accepted_tokens
        num_forced = min(message.round.num_forced_accepted_tokens, num_accepted)
        num_suffix = min(message.round.num_suffix_accepted_tokens, num_accepted - num_forced)
        parts = self.text.add_round(list(message.token_ids), num_accepted, num_suffix, num_forced)
        logprobs = list(message.logprobs)
        self.logprobs.extend(logprobs)
        round_ = Round(
            message.index,
            list(message.token_ids),
            message.round.num_draft_tokens,
            num_accepted,
            parts.accepted,
            parts.target,
            num_suffix,
            parts.suffix,
            num_forced,
            parts.forced,
        )
        return [self._chunk(parts.accepted + parts.target, logprobs, round_)]

    def usage(self) -> dict:
        assert self.stats is not None
        return usage(self.prompt_tokens, self.stats, self.method, self.session_id)

    @classmethod
    def resumed_body(cls, record: SessionRecord, include_usage: bool) -> Any:
        """The stream options of a resumed session's chunks, as its first request's body gave them
        (stop strings and log-probabilities are the session's own)."""
        raise NotImplementedError

    def start_chunks(self) -> list[dict]:
        return []

    def end_chunks(self) -> list[dict]:
        chunks = [self._finish_chunk()]
        if self.body.include_usage:
            chunks.append(self._envelope([]) | {"usage": self.usage()})
        return chunks

    def _envelope(self, choices: list[dict]) -> dict:
        envelope = {
            "id": self.id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.body.include_usage:
            envelope["usage"] = None
        return envelope

    def _chunk(self, text: str, logprobs: list, round_: Round | None) -> dict:
        raise NotImplementedError

    def _finish_chunk(self) -> dict:
        raise NotImplementedError

    def response(self) -> dict:
        raise NotImplementedError


class ChatOutput(Output):
    object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    @classmethod
    def resumed_body(cls, record: SessionRecord, include_usage: bool) -> ChatCompletionRequest:
        request = record.request
        return ChatCompletionRequest.model_construct(
            stop=list(request.stopping.stop),
            logprobs=request.logprobs,
            top_logprobs=request.top_logprobs,
            stream=True,
            stream_options=StreamOptions(include_usage=include_usage),
        )

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # With tools in play the text is split into content and calls (tool_calls.py). A resumed stream
        # has no tools: its session's constraint says how they bound the answer, and the text the client
        # has already brings the split to where the client is.
        mode = self.body.tool_mode
        if mode == "none":
            mode = grammar_tool_mode(self.record.request.constraint)
        self.tools = None if mode == "none" else ToolStream(mode, self.session_id)
        if self.tools is not None and self.num_tokens:
            self.tools.feed(self.text.text)

    def start_chunks(self) -> list[dict]:
        # A resumed stream's client has had the role (in the first chunk) already. An answer that may be
        # calls has no content yet, as OpenAI's.
        if self.num_tokens:
            return []
        return [self._choice({"role": "assistant", "content": "" if self.tools is None else None})]

    def _choice(self, delta: dict, logprobs: dict | None = None, finish: str | None = None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return self._envelope([choice])

    def _delta(self, text: str) -> dict:
        if self.tools is None:
            return {"content": text}
        content, calls = self.tools.feed(text)
        delta: dict = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [c.to_json() for c in calls]
        return delta

    def _chunk(self, text: str, logprobs: list, round_: Round | None) -> dict:
        chunk = self._choice(
            self._delta(text), chat_logprobs(self.tokenizer, logprobs) if self.body.logprobs else None
        )
        if round_ is not None:
            chunk["specserve"] = {"round": round_.to_json()}
        return chunk

    def end_chunks(self) -> list[dict]:
        held = self.tools.finish() if self.tools is not None else ""
        return ([self._choice({"content": held})] if held else []) + super().end_chunks()

    @property
    def answer_finish_reason(self) -> str | None:
        """`tool_calls` for an answer of calls that all closed at the end of the text, as OpenAI's."""
        tools = self.tools
        if tools is not None and tools.calls and tools.parser.complete and self.finish_reason == "stop":
            return "tool_calls"
        return self.finish_reason

    def _finish_chunk(self) -> dict:
        chunk = self._choice({}, None, self.answer_finish_reason)
        chunk["specserve"] = {"stats": self.usage()["specserve"]}
        return chunk

    def response(self) -> dict:
        message: dict = {"role": "assistant", "content": self.text.text}
        if self.tools is not None:
            self.tools.finish()
            if self.tools.calls:
                message = {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [c.to_json() for c in self.tools.calls],
                }
        logprobs = chat_logprobs(self.tokenizer, self.logprobs) if self.body.logprobs else None
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": self.answer_finish_reason,
                }
            ],
            "usage": self.usage(),
        }


class CompletionOutput(Output):
    object_name = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.text_offset = 0

    @classmethod
    def resumed_body(cls, record: SessionRecord, include_usage: bool) -> CompletionRequest:
        request = record.request
        return CompletionRequest.model_construct(
            stop=list(request.stopping.stop),
            logprobs=request.num_top_logprobs,
            stream=True,
            stream_options=StreamOptions(include_usage=include_usage),
        )

    def _logprobs(self, logprobs: list) -> dict | None:
        if self.body.logprobs is None:
            return None
        result = completion_logprobs(self.tokenizer, logprobs, self.text_offset)
        self.text_offset += sum(len(t) for t in result["tokens"])
        return result

    def _choice(self, text: str, logprobs: dict | None, finish: str | None) -> dict:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def _chunk(self, text: str, logprobs: list, round_: Round | None) -> dict:
        chunk = self._envelope([self._choice(text, self._logprobs(logprobs), None)])
        if round_ is not None:
            chunk["specserve"] = {"round": round_.to_json()}
        return chunk

    def _finish_chunk(self) -> dict:
        chunk = self._envelope([self._choice("", None, self.finish_reason)])
        chunk["specserve"] = {"stats": self.usage()["specserve"]}
        return chunk

    def response(self) -> dict:
        self.text_offset = 0
        choice = self._choice(self.text.text, self._logprobs(self.logprobs), self.finish_reason)
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(),
        }
