"""When to stop asking a drafter that proposes nothing.

Under load the cost policy sizes a round down to the root alone (docs/adaptive.md, "Batches"): the
draft then proposes nothing, but the call still costs a round trip to the draft service, or the
drafter's bookkeeping in process, on every round of every session. After such a round the loop skips
the drafter for a run of rounds that doubles while it keeps proposing nothing (1, 2, 4, ... up to
`max_skip`), and verifies the root alone meanwhile, which is exactly what the drafter would have sent.
A proposal with draft tokens resets the run, so a drafter is asked again within `max_skip` rounds once
the load drops. Output does not change: a round of the root alone is plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_SKIPPED_ROUNDS = 8


@dataclass
class DraftBackoff:
    max_skip: int = MAX_SKIPPED_ROUNDS
    run: int = 0  # length of the last skipped run (0: the drafter last proposed something)
    left: int = 0  # rounds still to skip

    def should_ask(self) -> bool:
        """Whether this round asks the drafter; False uses up one skipped round."""
        if self.left > 0:
            self.left -= 1
            return False
        return True

    def hold_off(self) -> None:
        """Starts as after a long run of empty proposals: the next `max_skip` rounds skip the drafter."""
        self.run = self.left = self.max_skip

    def skip(self, count: int) -> None:
        """`count` of the rounds still to skip ran elsewhere (core/ahead.py): they are used up."""
        self.left -= min(max(0, count), self.left)

    def follow(self, num_draft_tokens: int) -> bool:
        """Follows a round that ran elsewhere from this state (core/ahead.py), as this loop would have run
        it: a skipped round (the root alone) uses up one, any other was the drafter's proposal of
        `num_draft_tokens` and is observed. Returns whether the drafter was asked."""
        if not self.should_ask():
            return False
        self.observe(num_draft_tokens)
        return True

    def observe(self, num_draft_tokens: int) -> None:
        """Called with the size of every proposal the drafter made."""
        if num_draft_tokens > 0:
            self.run = self.left = 0
        else:
            self.run = min(max(1, 2 * self.run), self.max_skip)
            self.left = self.run
