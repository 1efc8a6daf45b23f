"""Function calling's prompt and grammar: the tools reach the model (natively through a template that
takes them, else in the system message), the history's calls and tool answers render, and the grammar
(compiled here by llguidance against the default model's tokenizer, as the engine compiles it) accepts
exactly the answers tool_choice allows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.router.http.schemas import ChatCompletionRequest, FunctionDefinition
from services.router.http.structured import body_constraint
from services.router.http.tools import chat_messages, grammar_tool_mode, template_tools, tool_grammar
from services.router.tokenizer import RouterTokenizer
from specserve.core.constraint import Constraint, ConstraintKind
from specserve.v1 import target_pb2

llguidance = pytest.importorskip("llguidance")

WEATHER = FunctionDefinition(
    name="get_weather",
    description="The weather in a city",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
        "required": ["city"],
        "additionalProperties": False,
        "$defs": {"unit": {"enum": ["C", "F"]}},
    },
)
TIME = FunctionDefinition(name="get_time")  # no parameters: an empty object
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]
# A template that takes tools and writes calls in the Hermes format (Qwen2.5's, shortened).
NATIVE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ c.function.arguments | tojson }}\n</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer_json(default_model_dir: Path) -> str:
    return (default_model_dir / "tokenizer.json").read_text()


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer_json: str):
    from tokenizers import Tokenizer

    return llguidance.LLTokenizer(tokenizer_json), Tokenizer.from_str(tokenizer_json)


def accepts(ll_tokenizer, grammar: str, text: str) -> bool:
    """Whether `grammar` allows `text` as a whole answer (then the end of sequence)."""
    tokenizer, hf = ll_tokenizer
    compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
    assert llguidance.LLMatcher.validate_grammar(compiled, tokenizer) == ""
    matcher = llguidance.LLMatcher(tokenizer, compiled)
    ids = hf.encode(text, add_special_tokens=False).ids
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


def test_required_allows_calls_of_any_tool_with_valid_arguments_only(ll_tokenizer) -> None:
    grammar = tool_grammar([WEATHER, TIME], mode="required")
    assert accepts(ll_tokenizer, grammar, CALL)
    assert accepts(ll_tokenizer, grammar, TIME_CALL)
    assert accepts(ll_tokenizer, grammar, f"{CALL}\n{TIME_CALL}")  # parallel calls
    assert not accepts(ll_tokenizer, grammar, "It is sunny.")
    assert not accepts(ll_tokenizer, grammar, CALL.replace('"C"', '"K"'))  # the enum, through its $ref
    assert not accepts(ll_tokenizer, grammar, CALL.replace('"city"', '"town"'))
    assert not accepts(ll_tokenizer, grammar, CALL.replace("get_weather", "get_wether"))


def test_one_call_without_parallel_calls_and_only_the_named_function(ll_tokenizer) -> None:
    single = tool_grammar([WEATHER, TIME], mode="required", parallel=False)
    assert accepts(ll_tokenizer, single, CALL) and not accepts(ll_tokenizer, single, f"{CALL}\n{TIME_CALL}")
    named = tool_grammar([WEATHER, TIME], mode="named", named="get_time")
    assert accepts(ll_tokenizer, named, TIME_CALL) and not accepts(ll_tokenizer, named, CALL)


def test_auto_allows_text_or_calls_but_no_broken_call(ll_tokenizer) -> None:
    grammar = tool_grammar([WEATHER], mode="auto")
    assert accepts(ll_tokenizer, grammar, "I cannot tell the weather.")
    assert accepts(ll_tokenizer, grammar, CALL)
    assert accepts(ll_tokenizer, grammar, "Text that mentions <tool_call> later on")
    assert not accepts(ll_tokenizer, grammar, '<tool_call>\n{"name": "get_weather"}')
    # a call opens the answer: past whitespace it would be text that looks like a call, unchecked
    assert not accepts(ll_tokenizer, grammar, f"\n {CALL}")


def test_auto_with_a_response_format_answers_in_it_or_calls(ll_tokenizer) -> None:
    grammar = tool_grammar([WEATHER], mode="auto", text_schema={"type": "object", "required": ["a"]})
    assert accepts(ll_tokenizer, grammar, '{"a": 1}') and accepts(ll_tokenizer, grammar, CALL)
    assert not accepts(ll_tokenizer, grammar, "plain text")


def request(**fields: Any) -> ChatCompletionRequest:
    tools = [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in (WEATHER, TIME)]
    return ChatCompletionRequest.model_validate_json(
        json.dumps({"messages": HISTORY, "tools": tools} | fields)
    )


def test_the_body_asks_for_the_grammar_of_its_tool_choice_which_says_its_mode() -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, mode in (("auto", "auto"), ("required", "required"), (named, "required")):
        found = body_constraint(request(tool_choice=choice))
        assert found is not None and found.param == "tools"
        assert grammar_tool_mode(found.constraint) == mode  # what a resumed stream reads
    assert grammar_tool_mode(body_constraint(request()).constraint) == "auto"  # auto by default
    assert body_constraint(request(tool_choice="none")) is None
    assert grammar_tool_mode(None) == "none"
    assert grammar_tool_mode(Constraint(ConstraintKind.GRAMMAR, 'start: "x"')) == "none"
    assert grammar_tool_mode(Constraint(ConstraintKind.REGEX, "// specserve tool calls: auto")) == "none"


def test_without_native_tools_the_system_message_describes_them_and_the_history_is_text() -> None:
    system, user, assistant, tool = chat_messages(request(tool_choice="required"), native=False)
    assert (
        system["role"] == "system"
        and "get_weather" in system["content"]
        and "<tool_call>" in system["content"]
    )
    assert "one or more function calls" in system["content"]
    assert user == {"role": "user", "content": "Weather in Paris?"}
    assert (
        assistant["content"]
        == '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'
    )
    assert tool == {"role": "user", "content": "<tool_response>\n18 C, sunny\n</tool_response>"}
    # a system message of the caller's keeps its text, the tools after it; none: no tools shown
    messages = chat_messages(
        request(messages=[{"role": "system", "content": "Be brief."}, *HISTORY]), native=False
    )
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert "# Tools" not in chat_messages(request(tool_choice="none"), native=False)[0]["content"]


def test_answers_in_a_row_share_one_turn() -> None:
    second = {"role": "tool", "tool_call_id": "call_2", "content": "12:00"}
    *_, last = chat_messages(request(messages=[*HISTORY, second]), native=False)
    assert (
        last["content"]
        == "<tool_response>\n18 C, sunny\n</tool_response>\n<tool_response>\n12:00\n</tool_response>"
    )


def test_a_template_that_takes_tools_gets_them_and_the_calls_as_objects(tokenizer_json: str) -> None:
    native = RouterTokenizer(
        target_pb2.ModelInfo(tokenizer_json=tokenizer_json, chat_template=NATIVE_TEMPLATE)
    )
    plain = RouterTokenizer(
        target_pb2.ModelInfo(tokenizer_json=tokenizer_json, chat_template="{{ messages }}")
    )
    assert native.native_tools and not plain.native_tools
    body = request()
    text = native.tokenizer.decode(
        native.encode_chat(chat_messages(body, native=True), template_tools(body)), skip_special_tokens=False
    )
    assert '"name": "get_time"' in text  # the tools, rendered by the template
    assert '<tool_call>\n{"city": "Paris"}\n</tool_call>' in text  # arguments as an object, through tojson
    assert "18 C, sunny" in text


def test_calls_are_written_in_the_engines_json_layout_so_their_fixed_parts_are_forced(ll_tokenizer) -> None:
    tokenizer, _ = ll_tokenizer
    grammar = llguidance.LLMatcher.grammar_from_lark(
        tool_grammar([WEATHER], mode="named", named="get_weather")
    )
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    forced = tokenizer.decode_str(matcher.compute_ff_tokens())
    assert forced.startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city":')
    assert not accepts(ll_tokenizer, tool_grammar([WEATHER], mode="required"), CALL.replace(", ", ","))


def test_qwens_own_template_renders_tools_and_calls_as_transformers_does() -> None:
    """With a template that takes tools (Qwen2.5's), the router's prompt is transformers' own, tools,
    earlier calls and tool answers included. Needs the profile's files (skipped where not installed)."""
    from specserve.models.install import installed_dir, is_installed
    from specserve.models.profiles import model_profile
    from specserve.settings import EngineSettings

    profile, cache_dir = model_profile("qwen2.5-coder-1.5b-instruct"), EngineSettings.from_env().cache_dir
    if not is_installed(profile, cache_dir):
        pytest.skip(f"the {profile.name} profile is not installed")
    from transformers import AutoTokenizer

    directory = installed_dir(profile, cache_dir)
    reference = AutoTokenizer.from_pretrained(directory)
    info = target_pb2.ModelInfo(
        tokenizer_json=(directory / "tokenizer.json").read_text(),
        chat_template=reference.chat_template,
        eos_token=reference.eos_token or "",
        bos_token=reference.bos_token or "",
    )
    router = RouterTokenizer(info)
    assert router.native_tools
    body = request()
    messages, tools = chat_messages(body, native=True), template_tools(body)
    expected = reference.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert router.encode_chat(messages, tools) == list(expected)
