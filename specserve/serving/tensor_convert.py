"""Tensor <-> wire conversions for the target and draft services (torch; the router never imports this)."""

from __future__ import annotations

import torch

from specserve.core.protocols import DraftTree
from specserve.errors import InvalidArgument
from specserve.serving.convert import tree_to_pb
from specserve.v1 import common_pb2, target_pb2

DTYPE_TO_PB = {
    torch.float32: common_pb2.DTYPE_FLOAT32,
    torch.float16: common_pb2.DTYPE_FLOAT16,
    torch.bfloat16: common_pb2.DTYPE_BFLOAT16,
}
DTYPE_FROM_PB = {v: k for k, v in DTYPE_TO_PB.items()}


def sparse_probs_to_pb(node: int, q: torch.Tensor) -> common_pb2.SparseProbs:
    """q: [V] -> its non-zero entries (top-k / top-p keep this small; plain T > 0 sends the vocabulary)."""
    token_ids = torch.nonzero(q > 0).flatten()  # [K] ascending
    return common_pb2.SparseProbs(
        node=node, token_ids=token_ids.tolist(), probs=q[token_ids].float().tolist()
    )


def sparse_probs_from_pb(
    message: common_pb2.SparseProbs, vocab_size: int, device: torch.device
) -> torch.Tensor:
    q = torch.zeros(vocab_size, device=device)  # [V]
    if message.token_ids:
        index = torch.tensor(list(message.token_ids), device=device)
        if int(index.min()) < 0 or int(index.max()) >= vocab_size:
            raise InvalidArgument("draft_probs token id outside the vocabulary")
        q[index] = torch.tensor(list(message.probs), device=device)
    return q


def draft_to_pb(draft: DraftTree) -> common_pb2.DraftTree:
    """A drafted tree for the wire: its structure, then each dense q as sparse."""
    message = tree_to_pb(DraftTree(draft.tree, draft.kind, target_roots=draft.target_roots))
    for node, q in draft.draft_probs.items():
        message.draft_probs.append(sparse_probs_to_pb(node, q))
    return message


def with_dense_probs(
    draft: DraftTree, message: common_pb2.DraftTree, vocab_size: int, device: torch.device
) -> DraftTree:
    """The tree `message` carried (validated by serving/convert.py, tree_from_pb, into `draft`) with its
    sparse q as [V] tensors, for the acceptance rule."""
    if not message.draft_probs:
        return draft
    probs = {q.node: sparse_probs_from_pb(q, vocab_size, device) for q in message.draft_probs}
    return DraftTree(draft.tree, draft.kind, probs, draft.target_roots)


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def kv_to_bytes(tensor: torch.Tensor) -> bytes:
    """[H, n, D] any dtype -> raw little-endian bytes, row-major.

    The copy is numpy's, not torch's: the feed thread calls this, and a torch copy of a few hundred
    positions would start an OpenMP team on that thread, which slows every forward on the model thread
    (serving/model_thread.py). Reinterpreting as a same-size integer keeps bf16 (no numpy dtype) exact.
    """
    host = tensor if tensor.device.type == "cpu" else tensor.cpu()
    return host.view(_SAME_SIZE_INT[host.element_size()]).numpy().tobytes()


def kv_from_bytes(
    data: bytes, dtype: torch.dtype, num_heads: int, num_positions: int, head_dim: int
) -> torch.Tensor:
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    expected = num_heads * num_positions * head_dim * torch.empty((), dtype=dtype).element_size()
    if flat.numel() != expected:
        raise InvalidArgument(f"KV chunk has {flat.numel()} bytes, expected {expected}")
    return flat.view(dtype).view(num_heads, num_positions, head_dim)


def chunk_payload_bytes(chunk: target_pb2.KVChunk) -> int:
    return sum(len(layer.keys) + len(layer.values) for layer in chunk.layers) + len(chunk.hidden_states)
