"""Training-free drafting from text the model has already seen (SuffixDecoding, prompt lookup).

Much of what a served model writes is already in front of it: code it edits, a document it quotes, its
own earlier sentences. At each round the longest suffix of the session's text that occurred earlier
proposes the tokens that followed it then. Several earlier occurrences give several continuations,
which form one trie rooted at the last committed token (shared prefixes once), each node scored by the
fraction of occurrences whose continuation passes through it.

Pure Python, no torch: the router, which has no torch, drafts with it.

- `SuffixIndex`: one per session, over the session's own stream (prompt + committed tokens).
- `SharedSuffixCache`: finished outputs of one tenant, offered to that tenant's other sessions.
- `merge_proposals`: one trie out of several trees with the same root (suffix candidates and a model
  draft), for one verification.

Lookup cost does not grow with the text: every n-gram (min_match <= n <= max_match) of the indexed text
maps to the end positions of its most recent occurrences, so `extend` does O(max_match) dictionary work
per token and `propose` O(max_match) lookups plus O(max_occurrences * depth) to build the trie.

Node order in a proposal is priority order: by descending score; among equal scores the shallower
node first (a deeper node can only be accepted with its ancestors), then the one whose most recent
supporting occurrence is newer (recent text predicts better). Scores never rise along a path, so this
order puts parents before children, and its first k nodes are the best k-node subtree: a caller that
can afford fewer nodes may truncate the tree.
"""

from __future__ import annotations

import heapq
import math
import threading
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specserve.core.tree import TokenTree
from specserve.errors import InvalidArgument


@dataclass(frozen=True)
class SuffixProposal:
    tree: TokenTree  # node 0: the last token of the asking text
    scores: tuple[float, ...]  # [N]; root 1.0, else the fraction of occurrences through the node
    match_length: int  # n: the asking text's last n tokens occurred earlier
    num_occurrences: int  # earlier occurrences the continuations came from


class _NgramWindow:
    """An n-gram index over the retained window of a token stream, optionally cut into segments.

    Positions are absolute (counted from the first token ever appended). An occurrence is named by its
    end: the position one past its last token, where its continuation starts. An n-gram is indexed only
    if it lies wholly in the window and in one segment; it leaves the index when its first token leaves
    the window. Each key keeps its `keep` most recent ends, oldest first.

    Memory: up to (max_match - min_match + 1) keys per retained token (a tuple key and a dict slot:
    about 1.5 KB per token at min_match = 1, max_match = 8 on text whose n-grams are mostly distinct),
    plus the tokens themselves, whose evicted prefix is dropped once it is as long as the retained part
    (at most twice the window).
    """

    def __init__(self, min_match: int, max_match: int, keep: int) -> None:
        self.min_match = min_match
        self.max_match = max_match
        self.keep = keep
        self.tokens: list[int] = []  # tokens[i] is position offset + i
        self.offset = 0
        self.start = 0  # first retained position; offset <= start <= end
        self.end = 0  # one past the last position appended
        self.seg_starts: list[int] = [0]  # ascending starts of the segments that reach the window
        self.index: dict[tuple[int, ...], list[int]] = {}  # n-gram -> ends, ascending

    @classmethod
    def after(
        cls, context: Sequence[int], end: int, min_match: int, max_match: int, keep: int
    ) -> _NgramWindow:
        """A window that indexes what follows position `end` of a stream whose n-grams up to there are
        indexed elsewhere; `context` is the stream's tokens just before `end` (at least its last
        max_match - 1, when it has them). Only n-grams ending after `end` will be indexed here, and
        continuations may start inside `context`."""
        window = cls(min_match, max_match, keep)
        window.tokens = list(context)
        window.offset = end - len(context)
        window.end = end
        window.start = max(window.offset, end - max_match + 1)  # new n-grams begin here or later
        window.seg_starts = [window.offset]
        return window

    @property
    def retained(self) -> int:
        return self.end - self.start

    def new_segment(self) -> None:
        """Later tokens start a new segment: no n-gram or continuation crosses into it."""
        if self.seg_starts[-1] < self.end:
            self.seg_starts.append(self.end)

    def skip(self, count: int) -> None:
        """Advances the stream by `count` tokens that are never indexed; the window empties."""
        self.evict_to(self.end)
        self.tokens.clear()
        self.end += count
        self.offset = self.start = self.end
        self.seg_starts = [max(self.seg_starts[-1], self.start)]

    def append(self, token_ids: Sequence[int]) -> None:
        tokens, index, keep = self.tokens, self.index, self.keep
        min_match, max_match, offset = self.min_match, self.max_match, self.offset
        lo = max(self.seg_starts[-1], self.start)  # n-grams start at or after lo
        tokens.extend(token_ids)
        for e in range(self.end + 1, self.end + len(token_ids) + 1):
            top = min(max_match, e - lo)
            if top < min_match:
                continue
            i = e - offset
            window = tuple(tokens[i - top : i])  # [top]: the longest n-gram ending at e
            for n in range(min_match, top + 1):
                key = window[top - n :]
                ends = index.get(key)
                if ends is None:
                    index[key] = [e]
                else:
                    ends.append(e)
                    if len(ends) > keep:
                        del ends[0]
        self.end += len(token_ids)

    def evict_to(self, new_start: int) -> None:
        """Drops positions before new_start from the window (and the n-grams starting there)."""
        new_start = min(new_start, self.end)
        tokens, index, offset = self.tokens, self.index, self.offset
        for p in range(self.start, new_start):
            i = p - offset
            window = tuple(tokens[i : i + self.max_match])  # n-grams starting at p, if indexed
            for n in range(self.min_match, len(window) + 1):
                key = window[:n]
                ends = index.get(key)
                # The oldest end of a key is the only one that can start at p: older ones left earlier.
                if ends is not None and ends[0] == p + n:
                    if len(ends) == 1:
                        del index[key]
                    else:
                        del ends[0]
        self.start = max(self.start, new_start)
        while len(self.seg_starts) > 1 and self.seg_starts[1] <= self.start:
            del self.seg_starts[0]
        dead = self.start - self.offset
        if dead and dead >= len(tokens) - dead:
            del tokens[:dead]
            self.offset = self.start

    def segment_end(self, pos: int) -> int:
        """One past the last position of the segment holding position pos."""
        k = bisect_right(self.seg_starts, pos)
        return self.seg_starts[k] if k < len(self.seg_starts) else self.end

    def lookup(
        self,
        tail: Sequence[int],
        max_occurrences: int,
        max_depth: int,
        earlier: Sequence[tuple[Mapping[tuple[int, ...], list[int]], int]] = (),
    ) -> tuple[int, list[list[int]]] | None:
        """The longest n such that tail's last n tokens occurred with a token after them in their
        segment, and the continuations (up to max_depth tokens, in-segment) of those occurrences,
        most recent first, at most max_occurrences. `earlier`: the indexes of the stream's spans before
        this window's, oldest first, each with the last end that may be read in it (IndexedPrefix.readable):
        this window's tokens continue those ends."""
        top = min(self.max_match, len(tail))
        if top < self.min_match:
            return None
        key_tail = tuple(tail[len(tail) - top :])  # [top]
        indexes = ((self.index, self.end), *reversed(earlier))  # newest ends first
        for n in range(top, self.min_match - 1, -1):
            key = key_tail[top - n :]
            continuations: list[list[int]] = []
            for index, last in indexes:
                ends = index.get(key)
                if not ends:
                    continue
                for i in range((len(ends) if ends[-1] <= last else bisect_right(ends, last)) - 1, -1, -1):
                    e = ends[i]
                    stop = min(e + max_depth, self.segment_end(e - 1))
                    if stop > e:
                        continuations.append(self.tokens[e - self.offset : stop - self.offset])
                        if len(continuations) == max_occurrences:
                            return n, continuations
            if continuations:
                return n, continuations
        return None


def _check_match_args(min_match: int, max_match: int, max_occurrences: int, max_tokens: int) -> None:
    if not 1 <= min_match <= max_match:
        raise InvalidArgument(f"need 1 <= min_match <= max_match, got {min_match} and {max_match}")
    if max_occurrences < 1:
        raise InvalidArgument(f"max_occurrences must be >= 1, got {max_occurrences}")
    if max_tokens < max_match:
        raise InvalidArgument(f"max_tokens must be >= max_match ({max_match}), got {max_tokens}")


def _check_propose_args(max_depth: int, max_nodes: int, min_score: float) -> None:
    if max_depth < 0 or max_nodes < 0:
        raise InvalidArgument(f"max_depth and max_nodes must be >= 0, got {max_depth} and {max_nodes}")
    if not 0.0 <= min_score <= 1.0:  # also rejects NaN
        raise InvalidArgument(f"min_score must be in [0, 1], got {min_score}")


def _best_first(
    children: list[list[int]], keys: Sequence[tuple[float, int, int]], max_nodes: int
) -> list[int]:
    """Node 0, then up to max_nodes more: always the smallest-key node whose parent is taken.

    Closed under parents by construction; the top max_nodes by key whenever keys never fall along a
    path (a child's key is never smaller than its parent's).
    """
    order = [0]
    frontier = [(keys[c], c) for c in children[0]]
    heapq.heapify(frontier)
    while frontier and len(order) <= max_nodes:
        _, node = heapq.heappop(frontier)
        order.append(node)
        for c in children[node]:
            heapq.heappush(frontier, (keys[c], c))
    return order


def _reindex(order: Sequence[int], token_ids: Sequence[int], parents: Sequence[int]) -> TokenTree:
    """The subtree made of `order` (parents listed before children), renumbered in that order."""
    new_index = {old: new for new, old in enumerate(order)}
    return TokenTree(
        tuple(token_ids[old] for old in order),
        (-1, *(new_index[parents[old]] for old in order[1:])),
    )


def build_trie_proposal(
    root_token: int,
    continuations: Sequence[Sequence[int]],
    match_length: int,
    max_nodes: int,
    min_score: float = 0.0,
) -> SuffixProposal | None:
    """A proposal from continuations given most recent first (see the module docstring for the order).

    A node's score is the fraction of continuations passing through it. Nodes below min_score go;
    of the rest, the best max_nodes (closed under parents) stay. None if no node stays.
    """
    total = len(continuations)
    if total == 0 or max_nodes == 0:
        return None
    token_ids = [root_token]
    parents = [-1]
    counts = [total]
    newest = [-1]  # index of the most recent continuation through the node
    depths = [0]
    children: list[dict[int, int]] = [{}]
    for rank, continuation in enumerate(continuations):
        node = 0
        for token in continuation[:max_nodes]:  # a node deeper than max_nodes cannot be kept
            child = children[node].get(token)
            if child is None:
                child = len(token_ids)
                children[node][token] = child
                children.append({})
                token_ids.append(token)
                parents.append(node)
                counts.append(0)
                newest.append(rank)
                depths.append(depths[node] + 1)
            counts[child] += 1
            node = child
    min_count = min_score * total
    keys = [(-float(counts[i]), depths[i], newest[i]) for i in range(len(token_ids))]
    kept_children = [[c for c in kids.values() if counts[c] >= min_count] for kids in children]
    order = _best_first(kept_children, keys, max_nodes)
    if len(order) == 1:
        return None
    return SuffixProposal(
        tree=_reindex(order, token_ids, parents),
        scores=(1.0, *(counts[i] / total for i in order[1:])),
        match_length=match_length,
        num_occurrences=total,
    )


@dataclass(frozen=True, eq=False)
class IndexedSpan:
    """The n-grams of a token stream that end in one span of it, [start, start + len(tokens)), with every
    end (none dropped), frozen: shared by every index whose stream holds the same tokens up to a point
    in the span, which reads the ends up to that point."""

    start: int
    tokens: tuple[int, ...]  # [end - start]
    index: Mapping[tuple[int, ...], list[int]]  # n-gram -> all its ends in the span, ascending

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(frozen=True)
class IndexedPrefix:
    """The n-gram index of a stream's first `length` tokens: consecutive frozen spans from position 0, the
    last read up to `length` only.

    A SuffixIndex that starts from it (`SuffixIndex.extend_from`) proposes exactly what one that indexed
    those tokens itself would, without indexing them again: a span's index is built once and then only
    read, so one prefix serves any number of sessions at once, and a prompt that leaves a cached one in
    the middle of a span still reads that span up to where they part.
    """

    spans: tuple[IndexedSpan, ...]
    ends: tuple[int, ...]  # [len(spans)]: where each span is read up to (and the next one starts)
    min_match: int
    max_match: int

    @property
    def length(self) -> int:
        return self.ends[-1] if self.ends else 0

    @classmethod
    def empty(cls, min_match: int, max_match: int) -> IndexedPrefix:
        _check_match_args(min_match, max_match, 1, max_match)
        return cls((), (), min_match, max_match)

    def cut(self, length: int) -> IndexedPrefix:
        """The first `length` tokens of this prefix."""
        if not 0 <= length <= self.length:
            raise InvalidArgument(f"a cut must be in [0, {self.length}], got {length}")
        kept = sum(1 for span in self.spans if span.start < length)
        ends = (*self.ends[: kept - 1], length) if kept else ()
        return IndexedPrefix(self.spans[:kept], ends, self.min_match, self.max_match)

    def extended(self, stream: Sequence[int], end: int) -> IndexedPrefix:
        """This prefix and one more span, up to `end`, of `stream` (whose first `length` tokens must be
        this prefix's): O((end - length) * max_match)."""
        start = self.length
        if not start < end <= len(stream):
            raise InvalidArgument(f"a span must end after {start} and by {len(stream)}, got {end}")
        context = stream[max(0, start - self.max_match + 1) : start]
        window = _NgramWindow.after(context, start, self.min_match, self.max_match, keep=len(stream))
        window.append(stream[start:end])
        span = IndexedSpan(start, tuple(stream[start:end]), window.index)
        return IndexedPrefix((*self.spans, span), (*self.ends, end), self.min_match, self.max_match)

    def matches(self, stream: Sequence[int]) -> bool:
        """Whether `stream` starts with this prefix's tokens."""
        if len(stream) < self.length:
            return False
        return all(
            span.tokens[: end - span.start] == tuple(stream[span.start : end])
            for span, end in zip(self.spans, self.ends, strict=True)
        )

    def readable(self) -> list[tuple[Mapping[tuple[int, ...], list[int]], int]]:
        """Each span's index and the last end readable in it, oldest first."""
        return [(span.index, end) for span, end in zip(self.spans, self.ends, strict=True)]


class SuffixIndex:
    """The n-gram index of one session's stream (prompt + committed tokens), which drafts from it.

    The index covers the most recent `max_tokens` tokens: beyond that the oldest are evicted, with
    their n-grams, so memory stays bounded (about 1.5 KB per retained token at the default match
    lengths: size max_tokens to the memory a session may use) and matches favour recent text. An
    `extend` of max_tokens or more tokens at once indexes only its last max_tokens. It may start from
    an IndexedPrefix of its stream (`extend_from`), shared with other sessions and only read; the first
    eviction then indexes the retained window privately, once. Not thread-safe: a session extends and
    proposes from one thread at a time.
    """

    def __init__(
        self, min_match: int = 1, max_match: int = 8, max_occurrences: int = 64, max_tokens: int = 1 << 20
    ) -> None:
        _check_match_args(min_match, max_match, max_occurrences, max_tokens)
        self.min_match = min_match
        self.max_match = max_match
        self.max_occurrences = max_occurrences
        self.max_tokens = max_tokens
        # One more end than max_occurrences per key: the stream's own tail is the newest entry of the
        # key it is asked about, and is no earlier occurrence.
        self._window = self._new_window()
        self._prefix: IndexedPrefix | None = None  # the shared spans before the window's own n-grams
        self._earlier: list[tuple[Mapping[tuple[int, ...], list[int]], int]] = []  # its readable()

    def _new_window(self) -> _NgramWindow:
        return _NgramWindow(self.min_match, self.max_match, keep=self.max_occurrences + 1)

    def __len__(self) -> int:
        """Tokens seen, evicted ones included."""
        return self._window.end

    @property
    def retained(self) -> int:
        """Tokens in the window (at most max_tokens)."""
        return self._window.end if self._prefix is not None else self._window.retained

    @property
    def shared_tokens(self) -> int:
        """Leading tokens whose n-grams come from a shared IndexedPrefix (0: none)."""
        return 0 if self._prefix is None else self._prefix.length

    def extend_from(self, prefix: IndexedPrefix, token_ids: Sequence[int]) -> None:
        """Starts an empty index on `token_ids`, whose first prefix.length tokens `prefix` indexed (with
        this index's match lengths): only the rest is indexed here. The proposals are the same as
        after `extend(token_ids)`."""
        if len(self) or self._prefix is not None:
            raise InvalidArgument("only an empty index starts from a shared prefix")
        if (prefix.min_match, prefix.max_match) != (self.min_match, self.max_match):
            raise InvalidArgument("the shared prefix was indexed with other match lengths")
        if not prefix.length or len(token_ids) > self.max_tokens:  # it would be evicted at once
            self.extend(token_ids)
            return
        if not prefix.matches(token_ids):
            raise InvalidArgument("the shared prefix is not a prefix of the stream")
        self._prefix, self._earlier = prefix, prefix.readable()
        keep = self.max_occurrences + 1
        self._window = _NgramWindow.after(
            token_ids[: prefix.length], prefix.length, self.min_match, self.max_match, keep
        )
        self._window.append(token_ids[prefix.length :])

    def extend(self, token_ids: Sequence[int]) -> None:
        """Appends committed tokens: O(len(token_ids) * max_match)."""
        window = self._window
        if self._prefix is not None and window.end + len(token_ids) > self.max_tokens:
            self._own_window()
            window = self._window
        if len(token_ids) >= self.max_tokens:  # the window will hold new tokens only
            window.skip(len(token_ids) - self.max_tokens)
            token_ids = token_ids[len(token_ids) - self.max_tokens :]
        window.append(token_ids)
        if window.retained > self.max_tokens:
            window.evict_to(window.end - self.max_tokens)

    def _own_window(self) -> None:
        """Leaves the shared prefix: the stream so far, indexed here (before the first eviction)."""
        stream = self._window.tokens  # the whole stream: a window after a prefix keeps it from 0
        self._prefix, self._earlier, self._window = None, [], self._new_window()
        self._window.append(stream)

    def propose(self, max_depth: int, max_nodes: int, min_score: float = 0.0) -> SuffixProposal | None:
        """Continuations of the longest suffix of the stream that occurred earlier, as a scored trie
        rooted at the stream's last token. None if nothing matched or no node stays."""
        _check_propose_args(max_depth, max_nodes, min_score)
        window = self._window
        if max_depth == 0 or max_nodes == 0:
            return None
        first = window.offset if self._prefix is not None else window.start  # of the retained tokens
        if window.end == first:
            return None
        tail = window.tokens[max(first, window.end - self.max_match) - window.offset :]
        found = window.lookup(tail, self.max_occurrences, min(max_depth, max_nodes), self._earlier)
        if found is None:
            return None
        match_length, continuations = found
        return build_trie_proposal(tail[-1], continuations, match_length, max_nodes, min_score)


class SharedSuffixCache:
    """Finished outputs shared among the sessions of one tenant, bounded, thread-safe.

    Each tenant's outputs are one segmented index: a match never spans two outputs and a continuation
    stops at the end of its output. Per tenant, the oldest whole outputs are evicted beyond
    `max_tokens_per_tenant` tokens (an output longer than that alone keeps its last
    `max_tokens_per_tenant` tokens); beyond `max_tenants`, the tenant least recently added to or asked
    is dropped. Every tenant string, the empty one included, names its own tenant: whether sessions may
    share at all is the caller's decision.
    """

    def __init__(
        self,
        max_tenants: int = 64,
        max_tokens_per_tenant: int = 1 << 16,
        *,
        min_match: int = 1,
        max_match: int = 8,
        max_occurrences: int = 64,
    ) -> None:
        if max_tenants < 1:
            raise InvalidArgument(f"max_tenants must be >= 1, got {max_tenants}")
        _check_match_args(min_match, max_match, max_occurrences, max_tokens_per_tenant)
        self.max_tenants = max_tenants
        self.max_tokens_per_tenant = max_tokens_per_tenant
        self.min_match = min_match
        self.max_match = max_match
        self.max_occurrences = max_occurrences
        self._tenants: OrderedDict[str, _NgramWindow] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Tenants held."""
        with self._lock:
            return len(self._tenants)

    def num_tokens(self, tenant: str) -> int:
        """Tokens held for a tenant (0 for one not held)."""
        with self._lock:
            window = self._tenants.get(tenant)
            return 0 if window is None else window.retained

    def add(self, tenant: str, token_ids: Sequence[int]) -> None:
        """Stores one finished output of `tenant`."""
        if not token_ids:
            return
        bound = self.max_tokens_per_tenant
        token_ids = list(token_ids[len(token_ids) - bound :] if len(token_ids) > bound else token_ids)
        with self._lock:
            window = self._tenants.get(tenant)
            if window is None:
                window = _NgramWindow(self.min_match, self.max_match, keep=self.max_occurrences + 1)
                self._tenants[tenant] = window
                while len(self._tenants) > self.max_tenants:
                    self._tenants.popitem(last=False)
            else:
                self._tenants.move_to_end(tenant)
            window.new_segment()
            while window.retained + len(token_ids) > bound:  # whole oldest outputs go first
                starts = window.seg_starts
                window.evict_to(starts[1] if len(starts) > 1 else window.end)
            window.append(token_ids)

    def propose(
        self, tenant: str, context: Sequence[int], max_depth: int, max_nodes: int, min_score: float = 0.0
    ) -> SuffixProposal | None:
        """Continuations, from `tenant`'s outputs only, of the longest suffix of `context` (the asking
        session's text, whose last token is the root) found there. None if nothing matched."""
        _check_propose_args(max_depth, max_nodes, min_score)
        if not context or max_depth == 0 or max_nodes == 0:
            return None
        tail = list(context[-self.max_match :])
        with self._lock:
            window = self._tenants.get(tenant)
            if window is None:
                return None
            self._tenants.move_to_end(tenant)
            found = window.lookup(tail, self.max_occurrences, min(max_depth, max_nodes))
        if found is None:
            return None
        match_length, continuations = found
        return build_trie_proposal(tail[-1], continuations, match_length, max_nodes, min_score)


def merge_proposals(
    root_token: int, proposals: Sequence[tuple[TokenTree, Sequence[float]]], max_nodes: int
) -> tuple[TokenTree, tuple[float, ...], tuple[int, ...]]:
    """One trie out of trees that share the root token, e.g. suffix candidates and a model draft.

    A path present in several trees is one path, scored with the highest of its scores. The root
    and up to max_nodes more are kept, best-first by score (ties to the earlier proposal, then to
    the earlier node in it), closed under parents; with scores that never rise along a path that is
    the max_nodes best nodes. Returns the tree (in that order), its scores (root 1.0) and, per node,
    the index of the first proposal that contributed it (root -1).
    """
    if max_nodes < 0:
        raise InvalidArgument(f"max_nodes must be >= 0, got {max_nodes}")
    token_ids = [root_token]
    parents = [-1]
    scores = [1.0]
    sources = [-1]
    children: list[dict[int, int]] = [{}]
    for source, (tree, tree_scores) in enumerate(proposals):
        if len(tree_scores) != tree.num_nodes:
            raise InvalidArgument(
                f"proposal {source} has {tree.num_nodes} nodes but {len(tree_scores)} scores"
            )
        if tree.token_ids[0] != root_token:
            raise InvalidArgument(f"proposal {source} has root {tree.token_ids[0]}, expected {root_token}")
        merged = [0] * tree.num_nodes  # node of `tree` -> merged node
        for i in range(1, tree.num_nodes):
            score = float(tree_scores[i])
            if math.isnan(score):
                raise InvalidArgument(f"proposal {source} node {i} has a NaN score")
            parent = merged[tree.parent_ids[i]]
            node = children[parent].get(tree.token_ids[i])
            if node is None:
                node = len(token_ids)
                children[parent][tree.token_ids[i]] = node
                children.append({})
                token_ids.append(tree.token_ids[i])
                parents.append(parent)
                scores.append(score)
                sources.append(source)
            else:
                scores[node] = max(scores[node], score)
            merged[i] = node
    # Creation order already ranks ties by proposal, then by node within it.
    keys = [(-scores[i], sources[i], i) for i in range(len(token_ids))]
    order = _best_first([list(kids.values()) for kids in children], keys, max_nodes)
    return (
        _reindex(order, token_ids, parents),
        (1.0, *(scores[i] for i in order[1:])),
        tuple(sources[i] for i in order),
    )
