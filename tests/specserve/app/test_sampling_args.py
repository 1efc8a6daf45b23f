"""`specserve generate`'s constraint options -> the request's Constraint, for in-process and remote runs
alike (the remote run sends it through the client SDK, on GenerateRequest.constraint)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from specserve.app.sampling_args import add_constraint_options, constraint_from_args
from specserve.bench.remote import client_options
from specserve.client.common import generate_request, to_chunk
from specserve.core.constraint import Constraint, ConstraintKind
from specserve.core.request import GenerationRequest
from specserve.grammar.schema import json_schema_constraint
from specserve.serving.convert import constraint_from_pb
from specserve.v1 import router_pb2

SCHEMA_TEXT = '{"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}'


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_constraint_options(parser)
    return parser.parse_args(argv)


def test_each_option_names_its_kind(tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(SCHEMA_TEXT)
    grammar = tmp_path / "yes_no.lark"
    grammar.write_text('start: "yes" | "no"\n')
    assert constraint_from_args(parse()) is None
    assert constraint_from_args(parse("--json-object")) == Constraint(ConstraintKind.JSON_OBJECT)
    assert constraint_from_args(parse("--regex", r"\d+")) == Constraint(ConstraintKind.REGEX, r"\d+")
    # the file's own text: the properties keep their order
    assert constraint_from_args(parse("--json-schema", str(schema))) == Constraint(
        ConstraintKind.JSON_SCHEMA, SCHEMA_TEXT
    )
    assert constraint_from_args(parse("--grammar", str(grammar))).kind is ConstraintKind.GRAMMAR


def test_one_constraint_at_most() -> None:
    with pytest.raises(SystemExit):
        parse("--json-object", "--regex", "a")


def test_the_remote_request_carries_it() -> None:
    constraint = json_schema_constraint({"type": "object"})
    request = GenerationRequest.build(method="target", constraint=constraint)
    message = generate_request("hi", **client_options(request))
    assert message.HasField("constraint") and constraint_from_pb(message.constraint) == constraint
    assert not generate_request("hi").HasField("constraint")


def test_a_chunk_reports_forced_tokens() -> None:
    info = router_pb2.RoundInfo(
        num_draft_tokens=5, num_accepted_tokens=4, num_forced_draft_tokens=3, num_forced_accepted_tokens=3
    )
    chunk = to_chunk(router_pb2.GenerateResponse(session_id="s", token_ids=[1, 2, 3, 4, 5], round=info))
    assert chunk.round is not None
    assert (chunk.round.num_forced_draft_tokens, chunk.round.num_forced_accepted_tokens) == (3, 3)
    assert json.dumps(chunk.round.__dict__)
