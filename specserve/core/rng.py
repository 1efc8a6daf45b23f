"""Counter-based seeding: the random stream of a round depends only on (request seed, position, role).

A session can therefore be resumed anywhere (another process, another replica) from its request seed and
the number of tokens committed so far, with no generator state to carry. The loop derives each round's
seeds with `draft_round_seed` and `verify_round_seed`; the draft service calls `draft_round_seed` too,
to build a round's tree before the router asks for it (with the request seed the router gave it in
Prefill), and gets the same seed the router's loop will send.
"""

from __future__ import annotations

import hashlib
import secrets
from enum import IntEnum


class Stream(IntEnum):
    VERIFY = 1
    DRAFT = 2


def fresh_seed() -> int:
    """A request seed for a request that did not give one."""
    return secrets.randbits(63)


def round_seed(request_seed: int, position: int, stream: Stream) -> int:
    digest = hashlib.blake2b(f"{request_seed}:{position}:{int(stream)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def draft_round_seed(request_seed: int, num_committed: int) -> int:
    """The drafter's seed for the round that starts with `num_committed` tokens (prompt + generated,
    the root included) committed."""
    return round_seed(request_seed, num_committed, Stream.DRAFT)


def verify_round_seed(request_seed: int, num_committed: int) -> int:
    """The verifier's seed for that round; the prefill's is the one at the prompt's length."""
    return round_seed(request_seed, num_committed, Stream.VERIFY)
