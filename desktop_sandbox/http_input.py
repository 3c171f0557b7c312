"""What a request to the action server may carry: `RequestError` (a refusal, answered as JSON
{"error"} with its status) and the checks of a body's fields.
"""
from __future__ import annotations

from typing import Any


class RequestError(Exception):
    """A request the server refuses: answered as JSON {"error"} with `status`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def truthy(value: Any) -> bool:
    """OSWorld's task files give `shell` as true, false or the string "true"."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


def path_field(value: Any) -> str:
    if not isinstance(value, str) or not value or "\0" in value:
        raise RequestError(400, "path must be a non-empty string")
    return value


def command_field(body: dict[str, Any]) -> list[str] | str:
    command = body.get("command")
    if isinstance(command, str) and command and "\0" not in command:
        return command
    if isinstance(command, list) and command and all(isinstance(c, str) and "\0" not in c for c in command):
        return command
    raise RequestError(400, "command must be a non-empty string or list of strings")


def number_field(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(400, f"{key} must be a number in [{low}, {high}]")
    return float(value)


def as_float(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def safe(text: str) -> str:
    """Text that survives JSON encoding and logs (lone surrogates replaced), at most 500 chars."""
    return text.encode("utf-8", "replace").decode("utf-8")[:500]
