"""The one settings loader: a frozen dataclass's defaults, then <PREFIX><FIELD> environment variables
parsed by the field's type hint, then explicit overrides. Torch-free: the router uses it.

Supported hints: str, int, float, bool (1/0, true/false, yes/no), Path (`~` expanded),
tuple[str, ...] (comma-separated) and any of these or None (`X | None`; an empty variable keeps the
default). An unparsable value is an InvalidArgument naming the variable.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from specserve.errors import InvalidArgument

T = TypeVar("T")

_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")


def load_settings(
    cls: type[T],
    prefix: str,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """`cls()` with every set <prefix><FIELD> variable applied, then every override that is not None.

    Does not validate: callers run their own cross-field checks on the result."""
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        name = prefix + f.name.upper()
        raw = environ.get(name)
        if raw:
            values[f.name] = parse_value(name, raw, hints[f.name])
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return dataclasses.replace(cls(), **values)  # type: ignore[type-var]


def parse_value(name: str, raw: str, hint: Any) -> Any:
    """`raw` as the type `hint` names; InvalidArgument("<name>='raw': why") when it is not one."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
        origin = typing.get_origin(hint)
    try:
        if origin is tuple:
            return tuple(part.strip() for part in raw.split(",") if part.strip())
        if hint is bool:
            if raw.lower() not in _TRUE + _FALSE:
                raise ValueError("expected true or false")
            return raw.lower() in _TRUE
        if hint is Path:
            return Path(raw).expanduser()
        if hint in (int, float, str):
            return hint(raw)
    except ValueError as e:
        raise InvalidArgument(f"{name}={raw!r}: {e}") from None
    raise TypeError(f"{name}: no parser for settings of type {hint!r}")
