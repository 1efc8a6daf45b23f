"""The prefix cache through the stack: a tenant's second request over the same long prompt reports the
prompt tokens the target took from its cache (gRPC GenerationStats.num_cached_tokens, the HTTP API's
usage.prompt_tokens_details.cached_tokens, read with the official `openai` client) and answers token for
token as before; another tenant sending the very same prompt gets no cached token. The router's suffix
index starts from the tenant's earlier prompt alike (its metrics count the tokens). A router with two
bearer tokens and the HTTP API in front of the shared stack."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from router_process import router_env, router_process
from stack_metrics import metric_at

from specserve.client import Client
from specserve.runtime.prefix_cache import FINE_BLOCK_TOKENS
from specserve.serving.stack import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.model, pytest.mark.timeout(300)]

TOKENS = {"alice": "prefix-token-alice", "bob": "prefix-token-bob"}
TIMEOUT = 120
MAX_TOKENS = 8
CHUNK = 256  # the stack target's prefill chunk: cached prefixes are whole chunks, or whole finer blocks
# (FINE_BLOCK_TOKENS) where its rows do not depend on the chunk (runtime/prefix_cache.py)
# A document of ~600 tokens that no other test sends, then a question about it.
DOCUMENT = " ".join(f"Record {i}: the pump at station {i % 7} ran {i * 3 % 11} hours." for i in range(40))


def question(text: str) -> str:
    return f"{DOCUMENT}\n\nQuestion: {text}"


@pytest.fixture(scope="module")
def router(shared_stack, tmp_path_factory) -> Iterator[tuple[str, str, int]]:
    """(gRPC address, HTTP API base URL, metrics port)."""
    env = router_env(
        shared_stack, auth_tokens=",".join(TOKENS.values()), http_port=free_port(), metrics_port=free_port()
    )
    with router_process(env, tmp_path_factory.mktemp("prefix") / "router.log"):
        yield (
            f"localhost:{env['SPECSERVE_ROUTER_PORT']}",
            f"http://localhost:{env['SPECSERVE_ROUTER_HTTP_PORT']}/v1",
            int(env["SPECSERVE_ROUTER_METRICS_PORT"]),
        )


def openai_client(base_url: str, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=TOKENS[tenant], max_retries=0, timeout=TIMEOUT)


def ask(client: openai.OpenAI, text: str, method: str = "target"):
    [model] = client.models.list().data
    return client.chat.completions.create(
        model=model.id,
        messages=[{"role": "user", "content": question(text)}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"method": method},
    )


def test_cached_tokens_are_reported_per_tenant_through_the_openai_api(router) -> None:
    _, base_url, _ = router
    alice, bob = openai_client(base_url, "alice"), openai_client(base_url, "bob")
    first = ask(alice, "Which station ran longest?")
    assert first.usage.prompt_tokens > 2 * CHUNK
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = ask(alice, "How many records are there?")
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 2 * CHUNK and cached % FINE_BLOCK_TOKENS == 0 and cached < second.usage.prompt_tokens
    # Bob sends Alice's exact prompt: nothing of hers serves him, and he gets the same answer.
    theirs = ask(bob, "How many records are there?")
    assert theirs.usage.prompt_tokens_details.cached_tokens == 0
    assert theirs.choices[0].message.content == second.choices[0].message.content


def test_grpc_stats_report_cached_tokens_and_output_is_unchanged(router) -> None:
    grpc_address, _, _ = router
    prompt = question("Which pump ran the fewest hours?")
    with Client(grpc_address, token=TOKENS["bob"]) as bob:
        first = bob.generate(prompt, method="target", max_new_tokens=MAX_TOKENS, timeout=TIMEOUT)
        warm = bob.generate(prompt, method="glide-cape", max_new_tokens=MAX_TOKENS, timeout=TIMEOUT)
    assert warm.stats["num_cached_tokens"] >= 2 * CHUNK
    assert warm.token_ids == first.token_ids  # greedy: the same tokens with the cache on


def test_the_suffix_index_starts_from_the_tenants_earlier_prompt(router) -> None:
    _, base_url, metrics_port = router
    alice, bob = openai_client(base_url, "alice"), openai_client(base_url, "bob")

    def cached_index_tokens() -> float:
        return metric_at(metrics_port, "specserve:prompt_index_cached_tokens_total")

    first = ask(alice, "Which station ran the pump for 5 hours?", method="suffix")
    before = cached_index_tokens()
    second = ask(alice, "Which stations ran it for 2 hours?", method="suffix")
    reused = cached_index_tokens() - before
    assert 2 * CHUNK <= reused < second.usage.prompt_tokens  # the document's whole blocks
    # Bob's exact copy of Alice's prompt indexes everything itself, and answers as she was answered.
    before = cached_index_tokens()
    theirs = ask(bob, "Which stations ran it for 2 hours?", method="suffix")
    assert cached_index_tokens() == before
    assert theirs.choices[0].message.content == second.choices[0].message.content
    assert first.usage.prompt_tokens > 2 * CHUNK
