"""Draft sessions: the committed tokens as the draft knows them, a drafter, and the KV mirror feeding it."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from services.draft.mirror import FeedSubscriber, KVMirror
from services.draft.prefix import PendingPrompt
from specserve.core.protocols import Drafter, DraftTree, RoundOutcome
from specserve.core.tree import tree_depths
from specserve.errors import NotFound
from specserve.runtime.batching import wait_until
from specserve.serving.model_thread import run_inline
from specserve.v1 import common_pb2


@dataclass(frozen=True)
class Proposal:
    """A drafted tree, ready for the wire, and what it was drafted from."""

    token_ids: tuple[int, ...]  # the committed tokens it was drafted from, the root last
    round_seed: int
    tree: common_pb2.DraftTree
    num_nodes: int
    depth: int

    def answers(self, token_ids: Sequence[int], round_seed: int) -> bool:
        """Whether it is exactly the tree a Propose with these arguments would build (the session's
        sampling is fixed)."""
        return self.round_seed == round_seed and self.token_ids == tuple(token_ids)


@dataclass
class DraftSession:
    session_id: str
    method: str
    token_ids: list[int]
    drafter: Drafter
    mirror: KVMirror
    subscriber: FeedSubscriber | None  # None: the drafter reads nothing of the target, so no feed
    # The request seed (Prefill), from which each round's draft seed derives (core/rng.py,
    # draft_round_seed); None = never prepare proposals ahead.
    request_seed: int | None = None
    # The prompt's blocks the draft's prefix cache takes once mirrored (None: it keeps none of them)
    prompt_blocks: PendingPrompt | None = None
    # What the round of the newest tree asked for committed, as the router counted it
    # (ProposeRequest.last_round_committed): set by the call, taken on the model thread
    last_round_committed: int | None = None
    # Written and read on the model thread only:
    proposed_root: int = -1  # root position of the newest tree built (asked for or prepared)
    last_draft: DraftTree | None = None  # that tree, until the drafter has observed its round
    prepared: Proposal | None = None  # built ahead, when the KV feed delivered its commit
    closed: bool = False
    # A job is using the drafter. Jobs of many sessions interleave on the model thread (their forwards
    # are batched), so the jobs of one session take turns: see `exclusive`.
    drafting: bool = False

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """On the model thread: waits until no other job of this session uses the drafter, then holds it."""
        wait_until(lambda: not self.drafting)
        self.drafting = True
        try:
            yield
        finally:
            self.drafting = False

    def observe_committed(self, token_ids: Sequence[int]) -> None:
        """On the model thread, before the next round opens: the drafter observes how its last tree's round
        went. The router runs the loop and sends tokens, so the outcome is read from the tokens committed
        after that tree's root (RoundOutcome.from_committed): as many as the router said that round
        committed (rounds without a call may have followed it), else all of them when no round can commit
        more. A sequence that does not continue the tree (another root there, fewer tokens) tells
        nothing."""
        draft, self.last_draft = self.last_draft, None
        count, self.last_round_committed = self.last_round_committed, None
        root = self.proposed_root
        if draft is None or len(token_ids) <= root + 1 or token_ids[root] != draft.tree.token_ids[0]:
            return
        committed = token_ids[root + 1 :]
        if count is not None:  # >= 1: the call was refused otherwise
            if count > len(committed):
                return
            committed = committed[:count]
        elif len(committed) > max(tree_depths(draft.tree.parent_ids)) + 1:
            return
        self.drafter.observe(RoundOutcome.from_committed(draft, committed))

    def close(self) -> None:
        """On the model thread (DraftSessionStore's `run`): a tree being built never sees its drafter
        released under it, and one queued behind this sees `closed`."""
        wait_until(lambda: not self.drafting)
        self.closed = True
        if self.subscriber is not None:
            self.subscriber.close()
        self.drafter.release()


class DraftSessionStore:
    """At most `max_sessions`; a new session evicts the least recently used (its router re-prefills).

    `run` is how a session is closed: the servicer passes its model thread's run, where drafters work.
    """

    def __init__(
        self,
        max_sessions: int,
        on_evict: Callable[[], None] = lambda: None,
        run: Callable[..., object] = run_inline,
    ) -> None:
        self.max_sessions = max_sessions
        self.on_evict = on_evict
        self._run = run
        self.lock = threading.Lock()
        self._sessions: OrderedDict[str, DraftSession] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def put(self, session: DraftSession) -> None:
        with self.lock:
            old = self._sessions.pop(session.session_id, None)
            evicted = []
            while len(self._sessions) >= self.max_sessions:
                evicted.append(self._sessions.popitem(last=False)[1])
            self._sessions[session.session_id] = session
        for s in [*([old] if old else []), *evicted]:
            self._run(s.close)
        for _ in evicted:
            self.on_evict()

    def get(self, session_id: str) -> DraftSession:
        with self.lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise NotFound(f"draft has no session {session_id!r} (never created, released or evicted)")
            self._sessions.move_to_end(session_id)
            return session

    def peek(self, session_id: str) -> DraftSession | None:
        """The session, if it exists, without marking it used (the KV feed's view)."""
        with self.lock:
            return self._sessions.get(session_id)

    def release(self, session_id: str) -> bool:
        with self.lock:
            session = self._sessions.pop(session_id, None)
        if session is not None:
            self._run(session.close)
        return session is not None

    def clear(self) -> None:
        with self.lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
        for s in sessions:
            self._run(s.close)
