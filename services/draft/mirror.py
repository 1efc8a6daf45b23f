"""The draft's mirror of one session's target KV, filled by a KV-feed subscription.

`KVMirror` satisfies GliDe's `TargetKVSource`: `layer_kv` returns views of the first `visible` positions
(the committed tokens before this round's root), exactly what the in-process drafter reads from the
target's own cache. `FeedSubscriber` keeps the mirror current on a daemon thread and resyncs on a gap,
a dropped stream or a target restart, always from the first position it lacks.

A subscription is held only while it is wanted: `follow()` subscribes, `pause()` drops the stream. The
servicer pauses a session whose rounds draft nothing (the cost policy under load), so that neither the
target nor the draft spends a core streaming K/V nobody reads; the next round that drafts follows again,
and the first chunk carries every position committed meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import grpc
import torch
from opentelemetry import context as otel_context
from opentelemetry.propagate import inject

from specserve.errors import FailedPrecondition, Unavailable
from specserve.serving import telemetry
from specserve.serving.model_thread import run_inline
from specserve.serving.tensor_convert import DTYPE_FROM_PB, chunk_payload_bytes, kv_from_bytes
from specserve.v1 import target_pb2, target_pb2_grpc

logger = logging.getLogger(__name__)

RETRY_SECONDS = (0.02, 0.05, 0.1, 0.25, 0.5, 1.0)  # backoff between resubscriptions


class KVMirror:
    def __init__(self, layers: list[int], num_layers: int, capacity: int, device: torch.device) -> None:
        self.num_layers = num_layers
        self.layers = [layer % num_layers for layer in layers]  # -1 = the last layer, as in GliDe configs
        self.capacity = capacity
        self.device = device
        self._keys: dict[int, torch.Tensor] = {}  # layer -> [1, H, capacity, D]
        self._values: dict[int, torch.Tensor] = {}
        # A hidden-state draft's input (specserve/eagle): asked for by `keep_features` before the first
        # subscription, then streamed with the K/V. [1, capacity, hidden] once the first chunk arrives.
        self.wants_hidden_states = False
        self._hidden: torch.Tensor | None = None
        self.length = 0  # positions [0, length) hold the target's committed KV
        self.visible = 0  # positions the drafter may read this round
        self.received_bytes = 0
        self.changed = threading.Condition()

    def read_layers(self, layers: Sequence[int]) -> None:
        """The target layers whose K/V the feed must carry (the drafter's declared reads), before any."""
        self.layers = [layer % self.num_layers for layer in layers]

    def write(self, chunk: target_pb2.KVChunk) -> None:
        """Stores a chunk; start_position may be below `length` (a rebuilt target re-sending)."""
        start, n = chunk.start_position, chunk.num_positions
        if start > self.length:
            raise FailedPrecondition(
                f"gap in the KV feed: have {self.length} positions, chunk starts at {start}"
            )
        if start + n > self.capacity:
            raise FailedPrecondition(f"KV feed exceeds the mirror's capacity {self.capacity}")
        dtype = DTYPE_FROM_PB[chunk.dtype]
        heads, dim = chunk.num_kv_heads, chunk.head_dim
        for layer_kv in chunk.layers:
            keys = kv_from_bytes(layer_kv.keys, dtype, heads, n, dim)  # [H, n, D]
            values = kv_from_bytes(layer_kv.values, dtype, heads, n, dim)
            self._store(layer_kv.layer, keys, values, start)
        if chunk.hidden_states:
            states = kv_from_bytes(chunk.hidden_states, dtype, 1, n, chunk.hidden_size)[0]  # [n, hidden]
            self._store_hidden(states, start)
        elif self.wants_hidden_states and n:
            raise FailedPrecondition("the KV feed sent no hidden states; the draft reads them")
        with self.changed:
            self.length = start + n
            self.received_bytes += chunk_payload_bytes(chunk)
            self.changed.notify_all()

    def _store(self, layer: int, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """keys, values: [H, n, D], a layer's positions [start, start + n); its buffers made at first use."""
        if layer not in self._keys:
            heads, _, dim = keys.shape
            shape = (1, heads, self.capacity, dim)
            self._keys[layer] = torch.zeros(shape, dtype=keys.dtype, device=self.device)
            self._values[layer] = torch.zeros(shape, dtype=keys.dtype, device=self.device)
        n = keys.shape[1]
        self._keys[layer][0, :, start : start + n] = keys.to(self.device)
        self._values[layer][0, :, start : start + n] = values.to(self.device)

    def _store_hidden(self, states: torch.Tensor, start: int) -> None:
        """states: [n, hidden], positions [start, start + n); the buffer made at first use."""
        if self._hidden is None:
            shape = (1, self.capacity, states.shape[1])
            self._hidden = torch.zeros(shape, dtype=states.dtype, device=self.device)
        self._hidden[0, start : start + states.shape[0]] = states.to(self.device)

    def load_prefix(self, kv: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """Positions [0, n) from the draft's prefix cache (services/draft/prefix.py), into an empty mirror
        before its first subscription, which then asks the feed for what follows them.
        kv: [len(layers), 2, H, n, D], keys then values of `layers` in order; hidden: [n, hidden] or None."""
        if self.length:
            raise FailedPrecondition("a cached prefix loads only into an empty mirror")
        n = kv.shape[3] if self.layers else (0 if hidden is None else hidden.shape[0])
        for index, layer in enumerate(self.layers):
            self._store(layer, kv[index, 0], kv[index, 1], 0)
        if hidden is not None:
            self._store_hidden(hidden, 0)
        with self.changed:
            self.length = n
            self.changed.notify_all()

    def kv_block(self, start: int, end: int) -> torch.Tensor:
        """[len(layers), 2, H, end - start, D]: the mirrored K/V of positions [start, end), copied (the
        prefix cache's BlockSource); no layers (a hidden-state draft's mirror): an empty tensor."""
        if not self.layers:
            return torch.zeros((0, 2, 0, end - start, 0), device=self.device)
        return torch.stack(
            [
                torch.stack((self._keys[layer][0, :, start:end], self._values[layer][0, :, start:end]))
                for layer in self.layers
            ]
        )

    def feature_block(self, start: int, end: int) -> tuple[torch.Tensor, tuple[int, ...]] | None:
        """([end - start, hidden] copied, ()) when the mirror keeps hidden states, else None."""
        if not self.wants_hidden_states or self._hidden is None:
            return None
        return self._hidden[0, start:end].clone(), ()

    def wait_for(self, positions: int, timeout: float) -> float:
        """Blocks until `positions` are mirrored; returns the seconds waited (Unavailable after timeout)."""
        start = time.perf_counter()
        with self.changed:
            if not self.changed.wait_for(lambda: self.length >= positions, timeout):
                raise Unavailable(
                    f"KV feed behind: {self.length} of {positions} positions after {timeout:.1f} s"
                )
        return time.perf_counter() - start

    def keep_features(self, layers: Sequence[int] = ()) -> None:
        """The session's drafter reads hidden states: subscriptions ask the target for them. Which ones
        (the final state, or `layers`' outputs) is the target's to keep: it keeps those of the
        hidden-state draft it is configured with, and the drafter checks the width it receives."""
        self.wants_hidden_states = True

    def hidden_states(self) -> torch.Tensor:
        """[1, visible, hidden]: a view, as the target's own `PositionalKVCache.hidden_states`."""
        if self._hidden is None:
            if self.visible:
                raise FailedPrecondition("no hidden states mirrored yet")
            return torch.zeros((1, 0, 1), device=self.device)
        return self._hidden[:, : self.visible]

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([1, H, visible, D], same): views, no copy."""
        layer_idx %= self.num_layers
        if self.visible == 0 and layer_idx not in self._keys:
            empty = torch.zeros((1, 1, 0, 1), device=self.device)
            return empty, empty
        return self._keys[layer_idx][:, :, : self.visible], self._values[layer_idx][:, :, : self.visible]


class FeedSubscriber:
    """Keeps one session's mirror current. `target_address` may change (the router moved the session)."""

    def __init__(
        self,
        session_id: str,
        mirror: KVMirror,
        target_address: str,
        channel_for: Callable[[str], grpc.Channel],  # a plain channel: the call must stay cancellable
        on_chunk: Callable[[target_pb2.KVChunk], None] = lambda chunk: None,
        on_resync: Callable[[], None] = lambda: None,
        # how a chunk reaches the mirror: the servicer runs it on its model thread (model_thread.py)
        run: Callable[..., object] = run_inline,
    ) -> None:
        self.session_id = session_id
        self.mirror = mirror
        self.target_address = target_address
        self.channel_for = channel_for
        self.on_chunk = on_chunk
        self.on_resync = on_resync
        self._write_on = run
        self._closed = threading.Event()
        self._wanted = threading.Event()  # set: stay subscribed; clear: paused (see the module doc)
        self._pauses = 0  # how many times pause() dropped a stream: a stream it dropped is no failure
        self._call: grpc.Future | None = None
        self._lock = threading.Lock()
        self._trace_context = otel_context.get_current()
        self._thread = threading.Thread(target=self._run, name=f"kv-feed-{session_id}", daemon=True)

    def start(self, follow: bool = True) -> None:
        """Starts the feed thread, subscribed at once or paused until `follow()`."""
        if follow:
            self._wanted.set()
        self._thread.start()

    def follow(self) -> None:
        """Subscribes (from the first position the mirror lacks) unless already subscribed."""
        self._wanted.set()

    def pause(self) -> None:
        """Drops the stream until `follow()`; what the mirror holds stays."""
        with self._lock:
            if not self._wanted.is_set():
                return
            self._wanted.clear()
            self._pauses += 1
            if self._call is not None:
                self._call.cancel()

    def retarget(self, target_address: str) -> None:
        """Follows the session to another target: the current stream is dropped and resubscribed."""
        if target_address and target_address != self.target_address:
            self.target_address = target_address
            self.reconnect()

    def reconnect(self) -> None:
        with self._lock:
            if self._call is not None:
                self._call.cancel()

    def close(self) -> None:
        self._closed.set()
        self._wanted.set()  # wakes a paused thread, which then sees `closed`
        self.reconnect()

    def _run(self) -> None:
        otel_context.attach(self._trace_context)  # the feed's spans join the trace that opened the session
        attempt = 0
        while not self._closed.is_set():
            self._wanted.wait()
            if self._closed.is_set():
                return
            stub = target_pb2_grpc.TargetServiceStub(self.channel_for(self.target_address))
            request = target_pb2.StreamKVRequest(
                session_id=self.session_id,
                from_position=self.mirror.length,
                layers=self.mirror.layers,
                hidden_states=self.mirror.wants_hidden_states,
            )
            call = None
            pauses = self._pauses
            try:
                carrier: dict[str, str] = {}
                inject(carrier)  # W3C traceparent: the target's feed spans join this trace
                with self._lock:
                    if not self._wanted.is_set():
                        continue  # paused since the wait above
                    pauses = self._pauses
                    # wait_for_ready: ride out a target that is (re)starting instead of failing fast
                    call = self._call = stub.StreamKV(
                        request, metadata=tuple(carrier.items()), wait_for_ready=True
                    )
                for chunk in call:
                    with telemetry.span(
                        telemetry.SPAN_KV_RECEIVE,
                        **{
                            telemetry.ATTR_POSITIONS: chunk.num_positions,
                            telemetry.ATTR_SESSION: self.session_id,
                        },
                    ):
                        self._write_on(self.mirror.write, chunk)
                    self.on_chunk(chunk)
                    attempt = 0
            except grpc.RpcError as e:
                if self._pauses == pauses and not self._closed.is_set():
                    logger.info("KV feed of %s: %s", self.session_id, e)
            except FailedPrecondition as e:  # a gap: resubscribe from what we have
                logger.warning("KV feed of %s: %s", self.session_id, e)
            except Exception:  # never let the feed thread die: resubscribe
                logger.exception("KV feed of %s failed", self.session_id)
            finally:
                if call is not None:
                    call.cancel()
            if self._closed.is_set():
                return
            if self._pauses != pauses:
                attempt = 0  # paused (and maybe followed again since): no failure, no resync, no backoff
                continue
            self.on_resync()
            time.sleep(RETRY_SECONDS[min(attempt, len(RETRY_SECONDS) - 1)])
            attempt += 1
