"""Row formats: a raw row -> a conversation, the one shape templates render.

A conversation is a list of turns {"role": "system" | "user" | "assistant", "content": str}. An Alpaca row
becomes [user, assistant] whose user turn also keeps the row's `input` apart (key "input"), because the
Alpaca template places it in its own section. A source's `fields` maps a format field to the source's
column name, so any column layout can be read without code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tunelab.core import registries


class RowError(ValueError):
    """A row that does not fit its format; `field` names the offending format field."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _get(row: dict, field: str, col: str, *, required: bool, kind: type | tuple = str):
    if col not in row or row[col] is None:
        if required:
            raise RowError(field, f"has no column {col!r} (format field {field!r}); its columns: {sorted(row)}")
        return None
    value = row[col]
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise RowError(field, f"column {col!r} (format field {field!r}) is a {type(value).__name__}, "
                              f"expected a {names}")
    return value


def _alpaca(row: dict, cols: dict[str, str]) -> list[dict]:
    system = _get(row, "system", cols["system"], required=False)
    turns = [{"role": "system", "content": system}] if system else []
    user = {"role": "user", "content": _get(row, "instruction", cols["instruction"], required=True),
            "input": _get(row, "input", cols["input"], required=False) or ""}
    return [*turns, user, {"role": "assistant", "content": _get(row, "output", cols["output"], required=True)}]


# ShareGPT speaker names seen in the wild -> roles.
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "chatgpt": "assistant", "model": "assistant", "bing": "assistant"}


def _turns(row: dict, cols: dict[str, str], list_field: str, role_key: str, text_key: str,
           roles: dict[str, str]) -> list[dict]:
    system = _get(row, "system", cols["system"], required=False)
    out = [{"role": "system", "content": system}] if system else []
    for i, turn in enumerate(_get(row, list_field, cols[list_field], required=True, kind=list)):
        if not isinstance(turn, dict) or not isinstance(turn.get(role_key), str):
            raise RowError(list_field, f"turn {i} of {cols[list_field]!r} is not a mapping with a {role_key!r} string")
        role = roles.get(turn[role_key].lower())
        if role is None:
            raise RowError(list_field, f"turn {i} has {role_key} {turn[role_key]!r}; known: {', '.join(roles)}")
        if not isinstance(turn.get(text_key), str):
            raise RowError(list_field, f"turn {i} of {cols[list_field]!r} has no {text_key!r} string")
        out.append({"role": role, "content": turn[text_key]})
    return out


def _sharegpt(row: dict, cols: dict[str, str]) -> list[dict]:
    return _turns(row, cols, "conversations", "from", "value", SHAREGPT_ROLES)


def _messages(row: dict, cols: dict[str, str]) -> list[dict]:
    return _turns(row, cols, "messages", "role", "content", {r: r for r in ("system", "user", "assistant")})


@dataclass(frozen=True)
class Format:
    name: str
    fields: tuple[str, ...]  # format fields; a source's `fields` maps them to its columns
    fn: Callable[[dict, dict[str, str]], list[dict]]

    def to_conversation(self, row: dict, mapping: dict[str, str]) -> list[dict]:
        return self.fn(row, {f: mapping.get(f, f) for f in self.fields})


ALPACA = Format("alpaca", ("instruction", "input", "output", "system"), _alpaca)
SHAREGPT = Format("sharegpt", ("conversations", "system"), _sharegpt)
MESSAGES = Format("messages", ("messages", "system"), _messages)
FORMATS = registries.FORMATS  # name -> Format (registered there, lazily, by the names above)


def has_response(conv: list[dict]) -> bool:
    """At least one assistant turn with non-blank content: the empty-response filter."""
    return any(t["role"] == "assistant" and t["content"].strip() for t in conv)


def trim(conv: list[dict]) -> list[dict]:
    """Turns after the last assistant turn carry no trained token: drop them."""
    last = max((i for i, t in enumerate(conv) if t["role"] == "assistant"), default=-1)
    return conv[: last + 1]
