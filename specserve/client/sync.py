"""The synchronous client."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, Unpack

import grpc

from specserve.client.common import (
    CHANNEL_OPTIONS,
    RETRY_SECONDS,
    Chunk,
    Collector,
    Completion,
    GenerateOptions,
    RetryBudget,
    generate_request,
    to_chunk,
)
from specserve.client.credentials import ClientSecurity, open_channel
from specserve.serving.status import error_from_rpc
from specserve.v1 import router_pb2, router_pb2_grpc


class Client:
    def __init__(
        self,
        address: str,
        *,
        retry_seconds: float = RETRY_SECONDS,  # how long a broken stream is retried (RetryBudget)
        retries: int | None = None,  # and at most this many times in a row (None: the time alone counts)
        channel: grpc.Channel | None = None,
        token: str | None = None,  # bearer token for a router with auth on
        tls: bool | None = None,  # TLS with the system's roots (implied by any tls_* file)
        tls_ca_file: str | None = None,  # the CA that signed the router's certificate
        tls_cert_file: str | None = None,  # a client certificate, where the router asks for one
        tls_key_file: str | None = None,
    ) -> None:
        security = ClientSecurity.create(tls, tls_ca_file, tls_cert_file, tls_key_file, token)
        self.channel = channel or open_channel(address, CHANNEL_OPTIONS, security)
        self.stub = router_pb2_grpc.RouterServiceStub(self.channel)
        self.retry_seconds, self.retries = retry_seconds, retries

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def stream(
        self, prompt: str | list[int], *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> Iterator[Chunk]:
        """Yields chunks as tokens are accepted (`options`: `GenerateOptions`). `timeout` is the whole
        generation's deadline (seconds); when it passes, the router frees the session and
        DeadlineExceeded is raised. A stream broken by UNAVAILABLE resumes where it stopped, on the
        same router restarted or another, for up to `retry_seconds` (the chunks go on seamlessly)."""
        request = generate_request(prompt, **options)
        deadline = None if timeout is None else time.monotonic() + timeout
        collector = Collector()
        budget = RetryBudget(self.retry_seconds, self.retries)
        resume = False
        while True:
            try:
                for message in self._open(request, len(collector.token_ids), deadline, resume):
                    budget.received()
                    chunk = collector.add(to_chunk(message))
                    if chunk is not None:
                        yield chunk
                return
            except grpc.RpcError as e:
                delay = budget.delay(e.code() is grpc.StatusCode.UNAVAILABLE, deadline)
                if delay is None:
                    raise error_from_rpc(e) from None
                time.sleep(delay)
                resume = True

    def _open(
        self, request: router_pb2.GenerateRequest, received: int, deadline: float | None, resume: bool
    ) -> Iterator[router_pb2.GenerateResponse]:
        """A retry resumes the session (a restarted router continues it from Redis); if the router no longer
        has it (the failed stream cancelled it), it is generated again: the seed is fixed, so the tokens are
        the same, and the ones the caller already has are skipped."""
        if resume:
            try:
                yield from self.stub.Resume(
                    router_pb2.ResumeRequest(session_id=request.session_id, received_tokens=received),
                    timeout=_remaining(deadline),
                )
                return
            except grpc.RpcError as e:
                if e.code() is not grpc.StatusCode.NOT_FOUND:
                    raise
        yield from self.stub.Generate(request, timeout=_remaining(deadline))

    def generate(self, prompt: str | list[int], **kwargs: Any) -> Completion:
        collector = Collector()
        for chunk in self.stream(prompt, **kwargs):
            collector.add(chunk)
        return collector.completion()

    def resume(
        self, session_id: str, received_tokens: int = 0, timeout: float | None = None
    ) -> Iterator[Chunk]:
        try:
            for message in self.stub.Resume(
                router_pb2.ResumeRequest(session_id=session_id, received_tokens=received_tokens),
                timeout=timeout,
            ):
                yield to_chunk(message)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    def cancel(self, session_id: str, timeout: float = 10.0) -> None:
        try:
            self.stub.Cancel(router_pb2.CancelRequest(session_id=session_id), timeout=timeout)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    def list_methods(self, timeout: float = 10.0) -> list[dict[str, Any]]:
        try:
            response = self.stub.ListMethods(router_pb2.ListMethodsRequest(), timeout=timeout)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        return [
            {"name": m.name, "description": m.description, "lossless": m.lossless} for m in response.methods
        ]


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.001, deadline - time.monotonic())
