"""The asyncio client (grpc.aio); same behaviour as the sync one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
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
from specserve.client.credentials import ClientSecurity, open_aio_channel
from specserve.serving.status import error_from_rpc
from specserve.v1 import router_pb2, router_pb2_grpc


class AsyncClient:
    def __init__(
        self,
        address: str,
        *,
        retry_seconds: float = RETRY_SECONDS,  # as Client
        retries: int | None = None,
        token: str | None = None,
        tls: bool | None = None,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
    ) -> None:
        security = ClientSecurity.create(tls, tls_ca_file, tls_cert_file, tls_key_file, token)
        self.channel = open_aio_channel(address, CHANNEL_OPTIONS, security)
        self.stub = router_pb2_grpc.RouterServiceStub(self.channel)
        self.retry_seconds, self.retries = retry_seconds, retries

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def stream(
        self, prompt: str | list[int], *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> AsyncIterator[Chunk]:
        """As `Client.stream`."""
        request = generate_request(prompt, **options)
        deadline = None if timeout is None else time.monotonic() + timeout
        collector = Collector()
        budget = RetryBudget(self.retry_seconds, self.retries)
        resume = False
        while True:
            try:
                async for message in self._open(request, len(collector.token_ids), deadline, resume):
                    budget.received()
                    chunk = collector.add(to_chunk(message))
                    if chunk is not None:
                        yield chunk
                return
            except grpc.aio.AioRpcError as e:
                delay = budget.delay(e.code() is grpc.StatusCode.UNAVAILABLE, deadline)
                if delay is None:
                    raise error_from_rpc(e) from None
                await asyncio.sleep(delay)
                resume = True

    async def _open(
        self, request: router_pb2.GenerateRequest, received: int, deadline: float | None, resume: bool
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        if resume:
            try:
                call = self.stub.Resume(
                    router_pb2.ResumeRequest(session_id=request.session_id, received_tokens=received),
                    timeout=_remaining(deadline),
                )
                async for message in call:
                    yield message
                return
            except grpc.aio.AioRpcError as e:
                if e.code() is not grpc.StatusCode.NOT_FOUND:
                    raise
        async for message in self.stub.Generate(request, timeout=_remaining(deadline)):
            yield message

    async def generate(self, prompt: str | list[int], **kwargs: Any) -> Completion:
        collector = Collector()
        async for chunk in self.stream(prompt, **kwargs):
            collector.add(chunk)
        return collector.completion()

    async def cancel(self, session_id: str, timeout: float = 10.0) -> None:
        try:
            await self.stub.Cancel(router_pb2.CancelRequest(session_id=session_id), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e) from None


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.001, deadline - time.monotonic())
