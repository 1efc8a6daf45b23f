"""A stand-in RouterService process for the SDK's tests: no models, no Redis, starts in a second.

`python counting_router.py PORT` serves Generate and Resume. A session's tokens are 0, 1, 2, ... up to
its max_new_tokens, one message per token, ROUND_SECONDS apart, and its text is the ids as words: a
resumed stream is exact by construction, whatever process answers it (as a router resuming from Redis).
"""

from __future__ import annotations

import sys
import time
from concurrent import futures

import grpc

from specserve.v1 import common_pb2, router_pb2, router_pb2_grpc

ROUND_SECONDS = 0.05


def token_text(token_id: int) -> str:
    return f"{token_id} "


class CountingRouter(router_pb2_grpc.RouterServiceServicer):
    def __init__(self) -> None:
        self.max_new_tokens: dict[str, int] = {}

    def Generate(self, request, context):
        self.max_new_tokens[request.session_id] = request.max_new_tokens
        yield from self._stream(request.session_id, 0, request.max_new_tokens)

    def Resume(self, request, context):
        # A restarted process knows no session: the id carries its length, as Redis would hold it.
        total = int(request.session_id.rsplit("-", 1)[-1])
        yield from self._stream(request.session_id, request.received_tokens, total)

    def _stream(self, session_id: str, start: int, total: int):
        for index in range(start, total):
            time.sleep(ROUND_SECONDS)
            yield router_pb2.GenerateResponse(
                session_id=session_id, token_ids=[index], index=index, text=token_text(index)
            )
        yield router_pb2.GenerateResponse(
            session_id=session_id, index=total, finish_reason=common_pb2.FINISH_REASON_LENGTH
        )


def main(port: int) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    router_pb2_grpc.add_RouterServiceServicer_to_server(CountingRouter(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("serving", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main(int(sys.argv[1]))
