"""The distributed stack produces the in-process engine's tokens, survives its parts failing, and frees
everything when a client leaves.

One stack (real Redis, target, draft and router processes) for the module. Greedy output through it
must equal the in-process output; then tests kill or restart processes and check the output still
does, and that cancelled or timed-out sessions leave nothing behind in Redis, the target or the draft.
A second, short-lived stack serves the tiny Qwen2 target: the same equality on another architecture.
"""

from __future__ import annotations

import signal
import time

import pytest
import redis
from pinned_costs import pinned_env
from stack_metrics import free_metrics_ports, metric, metrics_env

from specserve.catalog import DEFAULT_METHOD
from specserve.client import Client
from specserve.core.request import GenerationRequest
from specserve.engine import Engine
from specserve.errors import DeadlineExceeded, SpecserveError
from specserve.serving.stack import LocalStack
from specserve.settings import EngineSettings

pytestmark = [pytest.mark.distributed, pytest.mark.model]

PROMPT = "List three facts about the Moon."
METHOD = "glide"
MAX_NEW_TOKENS = 48
# Long enough that rounds remain after a killed draft has reloaded its model (the router is held while
# it reloads: stream_until_killed) for the router to ask it again after its back-off (core/backoff.py).
LONG_NEW_TOKENS = 320


@pytest.fixture(scope="module")
def stack(tmp_path_factory, pinned_costs):
    metrics = free_metrics_ports()
    env = metrics_env(metrics)
    env.update(pinned_env(pinned_costs))  # default_engine's costs: seeded sampling takes the same trees
    env["SPECSERVE_ROUTER_TARGET_TIMEOUT_SECONDS"] = "90"  # long enough for a restarted target to load
    # Rounds the target runs on its own are bounded by rounds and tokens only: with the default time
    # bound, how many fit in a call depends on how fast the host runs them (a slow or busy host runs
    # fewer), and the test of those rounds counts them.
    env["SPECSERVE_ROUTER_MAX_AHEAD_MS"] = "0"
    with LocalStack(log_dir=tmp_path_factory.mktemp("stack-logs"), env=env) as running:
        running.metrics_ports = metrics
        yield running


@pytest.fixture(scope="module")
def reference(default_engine) -> list[int]:
    request = GenerationRequest.build(method=METHOD, max_new_tokens=MAX_NEW_TOKENS)
    return default_engine.generate(PROMPT, request).token_ids


@pytest.fixture(scope="module")
def long_reference(default_engine) -> list[int]:
    request = GenerationRequest.build(method=METHOD, max_new_tokens=LONG_NEW_TOKENS, ignore_eos=True)
    return default_engine.generate(PROMPT, request).token_ids


EQUALITY_PROMPTS = (
    "Explain what a hash table is.",
    "Write a haiku about autumn rain.",
    "What is 17 times 23? Show your steps.",
)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["glide-cape", "eagle-cape", ""])  # "" = the router's default method
def test_greedy_output_equals_in_process(stack, default_engine, method):
    in_process_method = method or DEFAULT_METHOD  # the router's default (RouterServiceSettings)
    drafts_before = metric(stack, "router", "specserve:spec_decode_num_drafts_total")
    rounds = 0
    with Client(stack.router_address) as client:
        for prompt in EQUALITY_PROMPTS:
            remote = client.generate(prompt, method=method, max_new_tokens=32)
            request = GenerationRequest.build(method=in_process_method, max_new_tokens=32)
            local = default_engine.generate(prompt, request)
            assert remote.token_ids == local.token_ids, prompt
            assert remote.text == local.text
            assert remote.finish_reason == local.finish_reason.value
            assert remote.stats["num_draft_fallbacks"] == 0  # the draft really took part
            assert remote.stats["num_prepared_proposals"] == 0  # off by default
            rounds += int(remote.stats["num_target_forwards"]) - 1  # the prefill is not a round
    # vLLM-named speculation counters: one draft per round, per-position acceptance counted.
    assert metric(stack, "router", "specserve:spec_decode_num_drafts_total") - drafts_before == rounds
    assert metric(stack, "router", "specserve:spec_decode_num_accepted_tokens_per_pos_total") > 0


def save_fused_eagle_draft(target_dir, directory):
    """A hidden-state draft reading the outputs of the target's layers 0 and 1 side by side (EAGLE-3's
    fused input), its weights random but confident enough to draft trees."""
    import torch
    from transformers import AutoModelForCausalLM

    from specserve.eagle.model import build_eagle, save_eagle

    target = AutoModelForCausalLM.from_pretrained(target_dir)
    draft = build_eagle(target, seed=0, draft_vocab_size=None, feature_layers=(0, 1))
    draft.init_weights(torch.Generator().manual_seed(0), std=0.3)
    save_eagle(draft, directory)
    return directory


@pytest.mark.timeout(300)
def test_a_qwen2_stack_equals_in_process(tiny_qwen2_target_dir, tmp_path):
    """Over the tiny Qwen2 target (biased q/k/v, 2 KV heads of 32 on the feed, RoPE theta 1e6, tied head)
    the GliDe draft service mirrors the target's K/V, and a fused hidden-state draft's target keeps and
    streams the outputs of the layers that draft names (the services share only its directory); the
    output is the in-process engine's."""
    settings = {
        "model_dir": tiny_qwen2_target_dir,
        "draft_layers": 1,
        "calibration_path": tmp_path / "costs.json",
        "eagle_dir": save_fused_eagle_draft(tiny_qwen2_target_dir, tmp_path / "eagle"),
    }
    env = {f"SPECSERVE_{name.upper()}": str(value) for name, value in settings.items()}
    engine = Engine(EngineSettings.from_env(**settings))
    with (
        LocalStack(log_dir=tmp_path / "logs", env=env) as qwen2_stack,
        Client(qwen2_stack.router_address) as client,
    ):
        for method in ("glide-cape", "eagle-cape"):
            request = GenerationRequest.build(method=method, max_new_tokens=24)
            for prompt in EQUALITY_PROMPTS[:2]:
                remote = client.generate(prompt, method=method, max_new_tokens=24)
                assert remote.token_ids == engine.generate(prompt, request).token_ids, (method, prompt)
                assert remote.stats["num_draft_fallbacks"] == 0  # the draft really took part
                assert remote.stats["num_draft_tokens"] > 0


@pytest.mark.timeout(300)
def test_seeded_sampling_equals_in_process(stack, default_engine):
    """At T > 0 the stack reproduces the in-process run of the same seed token for token."""
    request = GenerationRequest.build(method=DEFAULT_METHOD, max_new_tokens=32, temperature=0.8, seed=31337)
    with Client(stack.router_address) as client:
        for prompt in EQUALITY_PROMPTS[:2]:
            remote = client.generate(prompt, max_new_tokens=32, temperature=0.8, seed=31337)
            local = default_engine.generate(prompt, request)
            assert remote.token_ids == local.token_ids, prompt


@pytest.mark.timeout(300)
def test_suffix_only_rounds_make_no_draft_call(stack, default_engine):
    """Text that repeats what is in front of the model: rounds the suffix index carries alone are
    verified without a Propose call to the draft service, and the output is the target's own."""
    prompt = "Repeat this line four times, one per line: the quick brown fox jumps over the lazy dog"
    local = default_engine.generate(prompt, GenerationRequest.build(method="target", max_new_tokens=64))
    proposes_before = metric(stack, "draft", "specserve:propose_latency_seconds_count")
    rounds = suffix_only = 0
    tokens: list[int] = []
    with Client(stack.router_address) as client:
        for chunk in client.stream(prompt, method="glide-cape-suffix", max_new_tokens=64):
            tokens += chunk.token_ids
            if chunk.round is not None and chunk.index > 0:  # the prefill's token is no round
                rounds += 1
                drafted, by_suffix = chunk.round.num_draft_tokens, chunk.round.num_suffix_draft_tokens
                suffix_only += drafted > 0 and drafted == by_suffix
    proposes = metric(stack, "draft", "specserve:propose_latency_seconds_count") - proposes_before
    assert tokens == local.token_ids
    assert suffix_only >= 1, (suffix_only, rounds)  # repeated text: suffix rounds accept many tokens each
    assert proposes <= rounds - suffix_only, (proposes, rounds, suffix_only)


@pytest.mark.timeout(300)
def test_rounds_that_ask_no_draft_model_run_on_the_target(stack, default_engine):
    """A greedy session's rounds that would ask no draft model (the suffix method has none) run on the
    target after the round the router sends, without a call each; the output is the in-process
    engine's, whose rounds run one by one. A sampled session's rounds all stay the router's."""
    prompt = "Repeat this line four times, one per line: the quick brown fox jumps over the lazy dog"
    local = default_engine.generate(prompt, GenerationRequest.build(method="suffix", max_new_tokens=48))
    verifies_before = metric(stack, "target", "specserve:verify_latency_seconds_count")
    calls_before = metric(stack, "router", "specserve:verify_rpc_latency_seconds_count")
    with Client(stack.router_address) as client:
        remote = client.generate(prompt, method="suffix", max_new_tokens=48)
        verifies = metric(stack, "target", "specserve:verify_latency_seconds_count") - verifies_before
        calls = metric(stack, "router", "specserve:verify_rpc_latency_seconds_count") - calls_before
        sampled = client.generate(prompt, method="suffix", max_new_tokens=16, temperature=0.8, seed=5)
    assert remote.token_ids == local.token_ids
    rounds = remote.stats["num_target_forwards"] - 1  # the prefill is not a round
    assert remote.stats["num_ahead_rounds"] > rounds / 2
    assert verifies == rounds - remote.stats["num_ahead_rounds"]  # one Verify call for each of the rest
    assert calls == verifies  # the router times each call once, not once per round it carried
    assert sampled.stats["num_ahead_rounds"] == 0


def stream_until_killed(
    client: Client,
    role: str,
    stack: LocalStack,
    after_tokens: int,
    max_new_tokens: int = MAX_NEW_TOKENS,
    hold_router: bool = False,
):
    """Streams; once `after_tokens` arrived, kills `role` and restarts it. Returns (tokens, final chunk).
    hold_router: the router is paused (SIGSTOP) while `role` restarts, so the generation is still running
    when it is back, however fast the target decodes (the router runs ahead of the client's reading)."""
    tokens, restarted = [], False
    long = max_new_tokens != MAX_NEW_TOKENS
    for chunk in client.stream(PROMPT, method=METHOD, max_new_tokens=max_new_tokens, ignore_eos=long):
        tokens += chunk.token_ids
        if not restarted and len(tokens) >= after_tokens:
            router = stack.processes["router"]
            if hold_router:
                router.send_signal(signal.SIGSTOP)
            try:
                stack.kill(role)
                stack.start(role)
            finally:
                if hold_router:
                    router.send_signal(signal.SIGCONT)
            restarted = True
        if chunk.finish_reason:
            return tokens, chunk
    raise AssertionError("the stream ended without a final chunk")


@pytest.mark.timeout(300)
def test_target_killed_mid_generation_is_rebuilt_from_history(stack, reference):
    with Client(stack.router_address) as client:
        tokens, last = stream_until_killed(client, "target", stack, after_tokens=8)
    assert tokens == reference
    assert last.stats["num_target_rebuilds"] >= 1
    # The draft's feed lost its target and resubscribed to the restarted one.
    assert metric(stack, "draft", "specserve:kv_feed_resyncs_total") >= 1


@pytest.mark.timeout(300)
def test_draft_killed_mid_generation_reconnects_and_catches_up(stack, long_reference):
    with Client(stack.router_address) as client:
        tokens, _ = stream_until_killed(
            client, "draft", stack, after_tokens=8, max_new_tokens=LONG_NEW_TOKENS, hold_router=True
        )
    assert tokens == long_reference
    # The restarted draft was prefilled again, mirrored the feed from position 0 and proposed.
    assert metric(stack, "draft", "specserve:propose_latency_seconds_count") >= 1
    assert metric(stack, "draft", "specserve:kv_feed_received_bytes_total") > 0


@pytest.mark.timeout(300)
def test_router_restart_and_client_resumes_session(stack, reference):
    received: list[int] = []
    with Client(stack.router_address, retries=0) as client:
        with pytest.raises(SpecserveError):
            for chunk in client.stream(PROMPT, method=METHOD, max_new_tokens=MAX_NEW_TOKENS):
                received += chunk.token_ids
                session_id = chunk.session_id
                if len(received) >= 8:
                    stack.kill("router")
        stack.start("router")
        rest = []
        for chunk in client.resume(session_id, received_tokens=len(received)):
            rest += chunk.token_ids
    assert received + rest == reference


def assert_no_state_left(stack: LocalStack, session_id: str) -> None:
    r = redis.Redis.from_url(stack.redis_url)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        keys = r.keys(f"specserve:session:{session_id}*")
        target = metric(stack, "target", "specserve:target_sessions")
        draft = metric(stack, "draft", "specserve:draft_sessions")
        if not keys and target == 0 and draft == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"state left behind: redis {keys}, target sessions {target}, draft sessions {draft}")


@pytest.mark.timeout(300)
def test_cancel_frees_redis_target_and_draft(stack):
    with Client(stack.router_address) as client:
        stream = client.stream(PROMPT, method=METHOD, max_new_tokens=200, ignore_eos=True)
        first = next(stream)
        client.cancel(first.session_id)
        chunks = [first, *stream]
    assert chunks[-1].finish_reason == "cancelled"
    assert_no_state_left(stack, first.session_id)


@pytest.mark.timeout(300)
def test_deadline_frees_redis_target_and_draft(stack):
    with Client(stack.router_address, retries=0) as client:
        session_id = None
        with pytest.raises(DeadlineExceeded):
            for chunk in client.stream(
                PROMPT, method=METHOD, max_new_tokens=400, ignore_eos=True, timeout=3.0
            ):
                session_id = chunk.session_id
    assert session_id is not None
    assert_no_state_left(stack, session_id)
