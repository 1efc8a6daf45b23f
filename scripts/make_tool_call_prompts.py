"""Writes specserve/bench/data/tool-calls.jsonl: the tool-call workload. Each line is a request that must
be answered with one call of one of four functions (the HTTP API's `tool_choice: "required"` with
`parallel_tool_calls: false`): the user turn carries the API's own tool instructions (as a model whose
chat template takes no tools gets them), and the line's constraint is the API's own tool grammar
(services/router/http/tools.py), so the bench decodes exactly what the API would."""

from __future__ import annotations

import json
from pathlib import Path

from services.router.http.schemas import FunctionDefinition
from services.router.http.tools import tool_grammar, tools_instructions


# Closed objects (OpenAI's strict function schemas): the arguments hold the named keys and nothing else.
def _params(properties: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


OUT = Path(__file__).resolve().parent.parent / "specserve" / "bench" / "data" / "tool-calls.jsonl"

FUNCTIONS = [
    FunctionDefinition(
        name="get_weather",
        description="The current weather in a city.",
        parameters=_params(
            {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city", "unit"]
        ),
    ),
    FunctionDefinition(
        name="book_table",
        description="Reserve a table at a restaurant.",
        parameters=_params(
            {
                "restaurant": {"type": "string"},
                "date": {"type": "string"},
                "time": {"type": "string"},
                "guests": {"type": "integer"},
            },
            ["restaurant", "date", "time", "guests"],
        ),
    ),
    FunctionDefinition(
        name="convert_currency",
        description="Convert an amount between currencies.",
        parameters=_params(
            {
                "amount": {"type": "number"},
                "from_currency": {"type": "string"},
                "to_currency": {"type": "string"},
            },
            ["amount", "from_currency", "to_currency"],
        ),
    ),
    FunctionDefinition(
        name="send_email",
        description="Send an email.",
        parameters=_params(
            {
                "to": {"type": "string"},
                "subject": {"type": "string"},
                "body": {"type": "string"},
            },
            ["to", "subject", "body"],
        ),
    ),
]
QUESTIONS = [
    ("weather", "What's the weather like in Lisbon right now, in celsius?"),
    ("weather", "Is it cold in Chicago today? Give me fahrenheit."),
    ("weather", "Tell me the temperature in Kyoto in celsius."),
    ("weather", "How warm is it in Cape Town at the moment, in fahrenheit?"),
    ("booking", "Book a table for 4 at Casa Lucia on 2027-02-14 at 19:30."),
    ("booking", "Reserve Sushi Ren for two people on 2027-03-01 at 20:00, please."),
    ("booking", "I need a table for 6 at The Olive Tree on 2027-04-10 at 13:00."),
    ("booking", "Get me a table at Bistro Nord for 3 guests, 2027-05-22, 18:45."),
    ("currency", "Convert 250 euros to US dollars."),
    ("currency", "How many Japanese yen is 1200 Swiss francs?"),
    ("currency", "Change 75.5 British pounds into Canadian dollars."),
    ("currency", "What is 3000 Indian rupees in euros?"),
    ("email", "Email anna@example.com with the subject 'Lunch' saying I'll be ten minutes late."),
    ("email", "Send bob@example.org a note titled 'Report' telling him the report is attached."),
    ("email", "Write to team@example.com, subject 'Release', that version 2.0 ships on Friday."),
    ("email", "Send an email to li@example.net with subject 'Thanks' thanking her for the help."),
]


def main() -> None:
    instructions = tools_instructions(FUNCTIONS, "required", None)
    grammar = tool_grammar(FUNCTIONS, mode="required", parallel=False)
    lines = []
    for i, (category, question) in enumerate(QUESTIONS):
        record = {
            "question_id": f"tool-{i}",
            "category": category,
            "turns": [f"{instructions}\n\n{question}"],
        }
        lines.append(json.dumps(record | {"constraint": {"kind": "grammar", "source": grammar}}))
    OUT.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} prompts to {OUT.name}")


if __name__ == "__main__":
    main()
