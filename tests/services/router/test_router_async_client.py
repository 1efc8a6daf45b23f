"""The asyncio client takes the sync client's options and streams the same generation through the stack."""

from __future__ import annotations

import asyncio

import pytest

from specserve.client import AsyncClient, Client, Completion

pytestmark = [pytest.mark.distributed, pytest.mark.model, pytest.mark.timeout(300)]

PROMPT = "Write a haiku about autumn rain."
# Every generation option: sampled with a fixed seed, so both clients must get the same tokens.
OPTIONS = {
    "max_new_tokens": 12,
    "temperature": 0.8,
    "top_p": 0.9,
    "top_k": 50,
    "seed": 4242,
    "stop": ("<never in a haiku>",),
    "ignore_eos": True,
}


def test_the_asyncio_client_streams_what_the_sync_client_does(shared_stack):
    address = shared_stack.address("router")
    with Client(address) as client:
        expected = client.generate(PROMPT, **OPTIONS, timeout=120)

    async def generate() -> tuple[Completion, int]:
        async with AsyncClient(address) as client:
            chunks = [chunk async for chunk in client.stream(PROMPT, **OPTIONS, timeout=120)]
            return await client.generate(PROMPT, **OPTIONS, timeout=120), len(chunks)

    completion, num_chunks = asyncio.run(generate())
    assert len(expected.token_ids) == OPTIONS["max_new_tokens"]  # ignore_eos: never cut short
    assert completion.token_ids == expected.token_ids
    assert completion.text == expected.text
    assert num_chunks >= 1
