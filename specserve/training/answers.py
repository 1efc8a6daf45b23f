"""The target's own answers to prompts: self-distillation text, generated in padded batches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from specserve.models import encode_chat

if TYPE_CHECKING:
    from specserve.models.loading import CausalLM


@torch.inference_mode()
def generate_answers(
    model: CausalLM,  # the target
    tokenizer: Any,
    prompts: Sequence[str],
    max_new_tokens: int,
) -> list[list[int]]:
    """-> for each prompt, its chat-formatted prompt ids followed by the target's greedy answer.

    Greedy, because greedy serving is what the draft must predict best; batching several prompts
    (left-padded) multiplies throughput on a CPU, where one stream leaves the matrix units idle.
    """
    encoded = [encode_chat(tokenizer, p) for p in prompts]
    width = max(len(e) for e in encoded)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)  # [B, W], left-padded
    attention_mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(encoded):
        input_ids[i, width - len(ids) :] = torch.tensor(ids)
        attention_mask[i, width - len(ids) :] = 1
    device = next(model.parameters()).device
    # Any: some transformers releases type generate's `self` as a Protocol no model meets under mypy.
    out = cast(Any, model).generate(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad_id,
    )  # [B, W + new]
    answers = []
    eos = tokenizer.eos_token_id
    for ids, row in zip(encoded, out[:, width:].tolist(), strict=True):
        if eos in row:
            row = row[: row.index(eos) + 1]  # keep the eos: the draft should learn to predict it
        answers.append(list(ids) + row)
    return answers
