"""How many structured answers are valid, through a local stack's HTTP API and the official openai client.

Starts the local stack (Redis, target, draft, router with the HTTP API), then sends the json-extraction
workload's 16 requests with `response_format: json_schema` (strict) and the tool-calls workload's 16
questions with their four `tools` and `tool_choice: "required"` (one call), greedy, with the router's
default method and with `target`. Each answer is checked: the extraction's content parses and validates
against its schema (jsonschema), each call names a function and its arguments validate against that
function's parameters. Prints one line per workload and method, and writes them as JSON. docs/structured-
output.md quotes:

    python scripts/diagnostics/structured_validity.py --out structured-validity.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import openai

from specserve.bench.prompts import load_prompts
from specserve.serving.stack import LocalStack

ROOT = Path(__file__).resolve().parents[2]


def _tool_workload():
    """The tool-calls workload's functions and questions, as scripts/make_tool_call_prompts.py writes them."""
    spec = importlib.util.spec_from_file_location(
        "make_tool_call_prompts", ROOT / "scripts" / "make_tool_call_prompts.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FUNCTIONS, module.QUESTIONS


# One request: the create() arguments beyond model and method, whether its answer is valid, and the
# finish reason a complete answer has.
Request = tuple[dict[str, Any], Callable[[Any], bool], str]


def _tally(client: openai.OpenAI, model: str, method: str, max_tokens: int, requests: list[Request]) -> dict:
    valid, finished, tokens, start = 0, 0, 0, time.perf_counter()
    for arguments, is_valid, complete in requests:
        response = client.chat.completions.create(
            model=model, max_tokens=max_tokens, temperature=0, extra_body={"method": method}, **arguments
        )
        choice = response.choices[0]
        tokens += response.usage.completion_tokens if response.usage else 0
        finished += choice.finish_reason == complete
        with contextlib.suppress(AssertionError, json.JSONDecodeError, jsonschema.ValidationError):
            valid += bool(is_valid(choice))
    seconds = time.perf_counter() - start
    return {
        "valid": valid,
        "finished": finished,
        "requests": len(requests),
        "tokens_per_s": round(tokens / seconds, 2),
    }


def extraction(client: openai.OpenAI, model: str, method: str, max_tokens: int) -> dict:
    requests: list[Request] = []
    for prompt in load_prompts("json-extraction"):
        assert prompt.constraint is not None
        schema = json.loads(prompt.constraint.source)
        response_format = {
            "type": "json_schema",
            "json_schema": {"name": prompt.category, "schema": schema, "strict": True},
        }
        arguments = {
            "messages": [{"role": "user", "content": prompt.text}],
            "response_format": response_format,
        }

        def is_valid(choice: Any, schema: dict = schema) -> bool:
            jsonschema.validate(json.loads(choice.message.content or ""), schema)
            return True

        requests.append((arguments, is_valid, "stop"))
    return {"workload": "json-extraction"} | _tally(client, model, method, max_tokens, requests)


def tool_calls(client: openai.OpenAI, model: str, method: str, max_tokens: int) -> dict:
    functions, questions = _tool_workload()
    tools = [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in functions]
    parameters = {f.name: f.parameters for f in functions}

    def is_valid(choice: Any) -> bool:
        calls = choice.message.tool_calls or []
        assert len(calls) == 1 and calls[0].function.name in parameters
        jsonschema.validate(json.loads(calls[0].function.arguments), parameters[calls[0].function.name])
        return True

    requests: list[Request] = [
        (
            {
                "messages": [{"role": "user", "content": question}],
                "tools": tools,
                "tool_choice": "required",
                "parallel_tool_calls": False,
            },
            is_valid,
            "tool_calls",
        )
        for _, question in questions
    ]
    return {"workload": "tool-calls"} | _tally(client, model, method, max_tokens, requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="default,target", help="comma-separated; default = the router's")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as logs, LocalStack(log_dir=Path(logs), http_port=0) as stack:
        assert stack.http_url is not None
        client = openai.OpenAI(base_url=stack.http_url, api_key="unused", timeout=600)
        model = client.models.list().data[0].id
        for method in args.methods.split(","):
            name = "" if method == "default" else method
            for run in (extraction, tool_calls):
                row = run(client, model, name, args.max_tokens) | {"method": method}
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
