"""Docker compose's variable interpolation, the forms Tandem's compose files use: `${VAR}`,
`${VAR:-default}`, `${VAR-default}`, `${VAR:?error}`, `${VAR?error}` and `$$` (a literal `$`).

The colon forms treat an empty variable as unset, as compose does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_REFERENCE = re.compile(r"\$(?:(?P<dollar>\$)|\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\})")


class MissingVariable(ValueError):
    """A `${VAR:?error}` whose variable is unset: compose stops with `error`."""


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """`value` (a loaded compose document, or any part of it) with every reference replaced."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if isinstance(value, str):
        return _REFERENCE.sub(lambda match: _substitute(match, env), value)
    return value


def _substitute(match: re.Match[str], env: Mapping[str, str]) -> str:
    if match["dollar"]:
        return "$"
    name, op, arg = match["name"], match["op"], match["arg"]
    value = env.get(name)
    unset = value is None or (value == "" and op is not None and op.startswith(":"))
    if not unset:
        return value or ""
    if op is not None and op.endswith("?"):
        raise MissingVariable(f"required variable {name} is missing a value: {arg}")
    return arg if op is not None else ""
