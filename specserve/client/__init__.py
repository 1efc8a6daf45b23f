"""The specserve client SDK: talk to a router over gRPC, sync or asyncio.

    from specserve.client import Client
    with Client("localhost:50050") as client:
        for chunk in client.stream("Write a haiku.", max_new_tokens=64):
            print(chunk.text, end="", flush=True)

A constraint holds the text to a language (JSON Schema, any JSON object, a regex, a Lark grammar):

    from specserve.client import json_schema_constraint
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    client.generate("Where is the Eiffel tower? Answer in JSON.", constraint=json_schema_constraint(schema))

Errors are the `specserve.errors` hierarchy (one base class, `SpecserveError`, with `InvalidArgument`,
`NotFound`, `ResourceExhausted`, `DeadlineExceeded`, `Unavailable`, ...). A stream that breaks with
UNAVAILABLE (a router restarting or gone) is resumed where it stopped, on any router (the session lives
in Redis), for up to `retry_seconds` (30 s by default) since it last received anything.
"""

from specserve.client.aio import AsyncClient
from specserve.client.sync import Chunk, Client, Completion
from specserve.core.constraint import Constraint, ConstraintKind
from specserve.grammar.schema import json_schema_constraint

__all__ = [
    "AsyncClient",
    "Chunk",
    "Client",
    "Completion",
    "Constraint",
    "ConstraintKind",
    "json_schema_constraint",
]
