"""How the clients reach a router that wants TLS and a bearer token.

TLS: `tls_ca_file` verifies the router's certificate (omit it to use the system's roots);
`tls_cert_file` / `tls_key_file` present a client certificate where one is asked for. The token goes
in every call's `authorization: Bearer <token>` metadata. It is added by a channel interceptor rather
than call credentials so it also works over plaintext to a local stack (gRPC refuses call credentials
on insecure channels); send tokens over plaintext only on loopback.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc


@dataclass(frozen=True)
class ClientSecurity:
    tls: bool = False
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    token: str | None = None

    @classmethod
    def create(
        cls,
        tls: bool | None = None,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        token: str | None = None,
    ) -> ClientSecurity:
        """TLS is on when asked for, or implied by any TLS file."""
        if bool(tls_cert_file) != bool(tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together")
        on = bool(tls) or bool(tls_ca_file or tls_cert_file)
        return cls(on, tls_ca_file, tls_cert_file, tls_key_file, token or None)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
        return grpc.ssl_channel_credentials(
            read(self.tls_ca_file), read(self.tls_key_file), read(self.tls_cert_file)
        )

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


def _with_metadata(details: Any, extra: Sequence[tuple[str, str]]) -> Any:
    metadata = [*(details.metadata or ()), *extra]
    return (
        details._replace(metadata=metadata) if hasattr(details, "_replace") else _Details(details, metadata)
    )


class _Details(grpc.ClientCallDetails):
    def __init__(self, details: Any, metadata: list[tuple[str, str]]) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


class _TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self.extra = metadata

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(_with_metadata(client_call_details, self.extra), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(_with_metadata(client_call_details, self.extra), request)


class _AioDetails(grpc.aio.ClientCallDetails):
    pass


class _AioTokenInterceptor(grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self.extra = metadata

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self.extra)
        return _AioDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


def open_channel(address: str, options: list[tuple[str, Any]], security: ClientSecurity) -> grpc.Channel:
    credentials = security.channel_credentials()
    if credentials is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        channel = grpc.secure_channel(address, credentials, options=options)
    if security.metadata:
        channel = grpc.intercept_channel(channel, _TokenInterceptor(security.metadata))
    return channel


def open_aio_channel(
    address: str, options: list[tuple[str, Any]], security: ClientSecurity
) -> grpc.aio.Channel:
    credentials = security.channel_credentials()
    interceptors = [_AioTokenInterceptor(security.metadata)] if security.metadata else None
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)
