"""The draft methods whose greedy losslessness on the real model test_shipped_drafts.py proves (3 prompts x
40 tokens against the target). test_engine.py checks every other lossless method against transformers,
so no method pays for the same real-model check twice (CI time)."""

SHIPPED_DRAFT_METHODS = (
    "glide",
    "glide-cape",
    "vanilla",
    "glide-cape-svip",
    "glide-cape-adaedl",
    "glide-cape-decision",
    "glide-cape-cost",
)
