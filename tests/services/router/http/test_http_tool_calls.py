"""An answer's text split into content and tool calls: OpenAI's deltas as it streams (however the text is
cut into rounds), the same calls in a whole response, the finish reasons, and a round's forced tokens.
The chat output is fed the router's own messages in process (no stack)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from services.router.http.app import ChatOutput
from services.router.http.schemas import ChatCompletionRequest
from services.router.http.tool_calls import ToolCallParser, ToolStream, call_id
from services.router.tokenizer import RouterTokenizer
from specserve.v1 import common_pb2, router_pb2, target_pb2

ARGUMENTS = '{"city": "Pa\\"ris}", "days": [1, {"x": "]"}], "ok": true}'
CALLS = (
    f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGUMENTS}}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time"}},
]


def assembled(deltas: list[dict]) -> list[dict]:
    """Streamed tool-call deltas joined as a client joins them (by index)."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        call = calls.setdefault(delta["index"], {"id": None, "name": None, "arguments": ""})
        if "id" in delta:
            assert call["id"] is None and delta["type"] == "function"  # id and name come once, first
            call["id"], call["name"] = delta["id"], delta["function"]["name"]
        call["arguments"] += delta["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("piece", [1, 2, 3, 7, len(CALLS)])
def test_calls_parse_the_same_however_the_text_is_cut(piece: int) -> None:
    parser = ToolCallParser()
    deltas = [d.to_json() for i in range(0, len(CALLS), piece) for d in parser.feed(CALLS[i : i + piece])]
    calls = assembled(deltas)
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", ARGUMENTS), ("get_time", "{}")]
    assert [c["id"] for c in calls] == [c.id for c in parser.calls]
    assert all(c.complete for c in parser.calls) and parser.complete
    json.loads(calls[0]["arguments"])  # exactly the model's JSON text


def test_a_cut_call_is_incomplete_with_the_arguments_so_far() -> None:
    parser = ToolCallParser()
    parser.feed(CALLS[:60])
    assert not parser.complete and [c.name for c in parser.calls] == ["get_weather"]
    assert ARGUMENTS.startswith(parser.calls[0].arguments) and not parser.calls[0].complete


@pytest.mark.parametrize(
    ("pieces", "content", "calls"),
    [
        (["Sunny", " today"], "Sunny today", 0),
        (["  <tool", "_c", "all>\n", '{"name": "f", "arguments": {}}\n</tool_call>'], "", 1),
        (["<to", "ols are", " fine"], "<tools are fine", 0),
        (["<tool_"], "<tool_", 0),  # the answer ended undecided: it was text
    ],
)
def test_auto_decides_at_the_first_characters(pieces: list[str], content: str, calls: int) -> None:
    stream = ToolStream("auto")
    text = "".join(stream.feed(p)[0] for p in pieces) + stream.finish()
    assert text == content and len(stream.calls) == calls


@pytest.fixture(scope="module")
def servicer(default_model_dir: Path) -> SimpleNamespace:
    info = target_pb2.ModelInfo(tokenizer_json=(default_model_dir / "tokenizer.json").read_text())
    return SimpleNamespace(tokenizer=RouterTokenizer(info))


def output(servicer, **fields: Any) -> ChatOutput:
    body = ChatCompletionRequest.model_validate_json(
        json.dumps({"messages": [{"role": "user", "content": "hi"}]} | fields)
    )
    record = SimpleNamespace(public_id="s1", prompt_ids=[1, 2, 3], request=SimpleNamespace(constraint=None))
    return ChatOutput(servicer, body, record, "model", "target")


def messages(servicer, text: str, per_round: int, finish: int = common_pb2.FINISH_REASON_EOS):
    token_ids = servicer.tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
    for i in range(0, len(token_ids), per_round):
        chunk = token_ids[i : i + per_round]
        info = router_pb2.RoundInfo(num_draft_tokens=len(chunk), num_accepted_tokens=len(chunk) - 1)
        yield router_pb2.GenerateResponse(session_id="s1", token_ids=chunk, index=i, round=info)
    stats = router_pb2.GenerationStats(num_generated_tokens=len(token_ids), num_target_forwards=2)
    yield router_pb2.GenerateResponse(session_id="s1", finish_reason=finish, stats=stats)


def run(out: ChatOutput, stream) -> list[dict]:
    chunks = out.start_chunks()
    for message in stream:
        chunks += out.add(message)
    return chunks + out.end_chunks()


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_streamed_calls_assemble_to_the_response_and_finish_with_tool_calls(
    servicer, tool_choice: str
) -> None:
    streamed = output(servicer, tools=TOOLS, tool_choice=tool_choice, stream=True)
    chunks = run(streamed, messages(servicer, CALLS, 3))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert not any(d.get("content") for d in deltas)  # calls, no content
    calls = assembled([t for d in deltas for t in d.get("tool_calls", [])])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"

    whole = output(servicer, tools=TOOLS, tool_choice=tool_choice)
    for message in messages(servicer, CALLS, 5):
        whole.add(message)
    [choice] = whole.response()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    answer = [
        (c["type"], c["function"]["name"], c["function"]["arguments"])
        for c in choice["message"]["tool_calls"]
    ]
    assert answer == [("function", c["name"], c["arguments"]) for c in calls]
    assert all(c["id"].startswith("call_") for c in choice["message"]["tool_calls"])


def test_auto_text_is_content_and_a_cut_call_keeps_length(servicer) -> None:
    out = output(servicer, tools=TOOLS)
    for message in messages(servicer, "It is sunny.", 2):
        out.add(message)
    [choice] = out.response()["choices"]
    assert choice["message"] == {"role": "assistant", "content": "It is sunny."}
    assert choice["finish_reason"] == "stop"

    out = output(servicer, tools=TOOLS, tool_choice="required")
    for message in messages(servicer, CALLS[:70], 4, finish=common_pb2.FINISH_REASON_LENGTH):
        out.add(message)
    [choice] = out.response()["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["tool_calls"][0]["function"]["name"]


def test_without_tools_nothing_changes(servicer) -> None:
    chunks = run(output(servicer, stream=True), messages(servicer, CALLS, 4))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == CALLS
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_rounds_forced_tokens_are_the_tail_of_its_accepted_text(servicer) -> None:
    """The engine appends forced tokens to the drafted path's end (core/grammar.py): of 3 accepted
    tokens of each round here, the suffix index's 1 and the forced 1 are the last two, in that order."""
    token_ids = servicer.tokenizer.tokenizer.encode(CALLS, add_special_tokens=False).ids
    out = output(servicer, stream=True)
    chunks = out.start_chunks()
    for i in range(0, 16, 4):
        info = router_pb2.RoundInfo(
            num_draft_tokens=4,
            num_accepted_tokens=3,
            num_suffix_accepted_tokens=1,
            num_forced_accepted_tokens=1,
        )
        chunks += out.add(router_pb2.GenerateResponse(token_ids=token_ids[i : i + 4], index=i, round=info))
    rounds = [c["specserve"]["round"] for c in chunks if "round" in c.get("specserve", {})]
    decode = servicer.tokenizer.decode
    assert [r["forced_text"] for r in rounds] == [decode(token_ids[i + 2 : i + 3]) for i in range(0, 16, 4)]
    assert [r["suffix_text"] for r in rounds] == [decode(token_ids[i + 1 : i + 2]) for i in range(0, 16, 4)]
    assert all(r["accepted_text"].endswith(r["suffix_text"] + r["forced_text"]) for r in rounds)
    whole = run(output(servicer, stream=True), messages(servicer, CALLS, 4))
    usage = whole[-1]["specserve"]["stats"]
    assert "num_forced_draft_tokens" in usage and "num_forced_accepted_tokens" in usage


@pytest.mark.parametrize("cut", [0, 3, 9, 20])
def test_a_resumed_stream_continues_the_calls_where_the_client_is(servicer, cut: int) -> None:
    """GET /v1/streams/... has the session, not the request's tools: the session's constraint says how
    they bound the answer, and the calls keep their ids and indices across the cut."""
    from services.router.http.structured import body_constraint

    body = ChatCompletionRequest.model_validate_json(
        json.dumps(
            {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "required"}
        )
    )
    found = body_constraint(body)
    assert found is not None
    record = SimpleNamespace(
        public_id="s1", prompt_ids=[1], request=SimpleNamespace(constraint=found.constraint)
    )
    token_ids = servicer.tokenizer.tokenizer.encode(CALLS, add_special_tokens=False).ids
    first = ChatOutput(servicer, body, record, "model", "target")
    before = first.start_chunks()
    for i in range(cut):
        before += first.add(router_pb2.GenerateResponse(token_ids=token_ids[i : i + 1], index=i))
    resumed_body = ChatOutput.resumed_body(SimpleNamespace(request=_request_of(found.constraint)), False)
    resumed = ChatOutput(servicer, resumed_body, record, "model", "target", received=token_ids[:cut])
    after = resumed.start_chunks()
    for message in messages(servicer, CALLS, 4):
        if message.HasField("stats"):
            after += resumed.add(message)
        elif message.index + len(message.token_ids) > cut:
            skip = max(0, cut - message.index)
            trimmed = router_pb2.GenerateResponse(
                token_ids=message.token_ids[skip:], index=message.index + skip
            )
            after += resumed.add(trimmed)
    after += resumed.end_chunks()
    deltas = [c["choices"][0]["delta"] for c in before + after if c["choices"]]
    calls = assembled([t for d in deltas for t in d.get("tool_calls", [])])
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", ARGUMENTS), ("get_time", "{}")]
    assert [c["id"] for c in calls] == [call_id("s1", 0), call_id("s1", 1)]  # as a whole parse names them
    assert after[-1]["choices"][0]["finish_reason"] == "tool_calls"


def _request_of(constraint):
    from specserve.core.request import GenerationRequest

    return GenerationRequest.build(method="target", constraint=constraint)
