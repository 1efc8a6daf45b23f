"""The KV feed: committed K/V of the layers a draft reads, streamed as positions are committed.

A subscriber names the first position it needs; the feed sends [cursor, committed) in chunks of at most
`chunk_positions`, then waits for the next commit. Positions below the committed length never change
except by a rebuild, which re-creates the same tokens' KV; after a rebuild to a shorter history the
cursor moves back to the new end, so the subscriber overwrites what it had there (start_position below
what it holds is how it learns that). The stream ends when the session is released or evicted.
A session prefilled with keep_hidden_states streams, when asked, each position's features too: the input
of a hidden-state draft (specserve/eagle), its final hidden state or the outputs of the layers a fused
draft reads (`Models.eagle_feature_layers`); other sessions never compute or send them.
Each chunk also carries its positions' token ids, and the chunk that reaches the committed length the
root token after them: everything a draft needs to build the next round's proposal unasked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from services.target.sessions import SessionStore, TargetSession
from specserve.errors import FailedPrecondition, InvalidArgument
from specserve.serving.tensor_convert import DTYPE_TO_PB, kv_to_bytes
from specserve.v1 import target_pb2

POLL_SECONDS = 0.5  # how often a waiting feed re-checks that its client is still there


def kv_feed(
    store: SessionStore,
    session_id: str,
    from_position: int,
    layers: Sequence[int],
    chunk_positions: int,
    is_active: Callable[[], bool],
    hidden_states: bool = False,
) -> Iterator[target_pb2.KVChunk]:
    num_layers = len(store.runner.model.model.layers)
    if not (layers or hidden_states) or any(not 0 <= layer < num_layers for layer in layers):
        raise InvalidArgument(
            f"layers must name target layers in [0, {num_layers}) (at least one unless hidden states are "
            f"asked for), got {list(layers)}"
        )
    if from_position < 0:
        raise InvalidArgument("from_position must be >= 0")
    cursor = from_position
    with store.lock:
        session = store.get(session_id)
        epoch = session.epoch
        if hidden_states and session.verifier.cache.features is None:
            raise FailedPrecondition(
                "this session keeps no hidden states: prefill it with keep_hidden_states to stream them"
            )
    while is_active():
        with store.lock:
            current = store.peek(session_id)
            if current is None or current.closed:
                return  # released or evicted: the subscriber resubscribes after the rebuild
            if current is not session:  # rebuilt (a new epoch): same tokens, so continue at our cursor
                session, epoch = current, current.epoch
            cursor = min(cursor, session.committed_length)
            if cursor >= session.committed_length:
                session.changed.wait(POLL_SECONDS)  # its commits and its close wake it; no other's
                continue
            end = min(session.committed_length, cursor + chunk_positions)
            chunk = _chunk(session, epoch, cursor, end, layers, hidden_states)
        cursor = end
        yield chunk


def _chunk(
    session: TargetSession,
    epoch: int,
    start: int,
    end: int,
    layers: Sequence[int],
    hidden_states: bool = False,
) -> target_pb2.KVChunk:
    """Copies positions [start, end) of each layer (caller holds the store lock)."""
    message = target_pb2.KVChunk(
        session_id=session.session_id,
        start_position=start,
        num_positions=end - start,
        epoch=epoch,
        commit_unix_seconds=session.committed_at,
        token_ids=session.verifier.token_ids[start:end],
    )
    if end == session.committed_length:  # the newest commit: the draft may start the next round
        message.root_token = session.verifier.token_ids[end]
    for layer in layers:
        keys, values = session.verifier.cache.layer_kv(layer)  # [1, H, L, D]
        message.layers.append(
            target_pb2.LayerKV(
                layer=layer,
                keys=kv_to_bytes(keys[0, :, start:end]),
                values=kv_to_bytes(values[0, :, start:end]),
            )
        )
        message.dtype = DTYPE_TO_PB[keys.dtype]
        message.num_kv_heads, message.head_dim = keys.shape[1], keys.shape[3]
    if hidden_states:
        states = session.verifier.cache.hidden_states()  # [1, L, H]
        message.hidden_states = kv_to_bytes(states[:, start:end])
        message.hidden_size = states.shape[2]
        message.dtype = DTYPE_TO_PB[states.dtype]
    return message
