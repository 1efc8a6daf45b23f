"""Counter-based seeding: the random stream of a round depends only on (seed, position, role).

A session can therefore be resumed anywhere (another process, another replica) from its seed and
the number of tokens committed so far, with no generator state to carry.
"""

from __future__ import annotations

import hashlib
import secrets
from enum import IntEnum


class Stream(IntEnum):
    VERIFY = 1
    DRAFT = 2


def fresh_seed() -> int:
    return secrets.randbits(63)


def round_seed(seed: int, position: int, stream: Stream) -> int:
    digest = hashlib.blake2b(f"{seed}:{position}:{int(stream)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)
