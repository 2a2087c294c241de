"""Field readers for the record schema's ``from_dict`` parsers (online_opd/traces/records.py and
target_signal.py): each returns the value or raises ValueError naming the bad field, so a corrupt record in a
buffer segment is reported, not half-read."""

from __future__ import annotations

from typing import Any


def require_dict(data: Any, where: str) -> dict:
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a dict, got {type(data).__name__}")
    return data


def required_field(data: dict, name: str, where: str) -> Any:
    if name not in data:
        raise ValueError(f"{where}.{name} is missing")
    return data[name]


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def table_field(data: dict, name: str, where: str) -> list:
    """A non-empty list of lists (a [rows][k] table)."""
    value = required_field(data, name, where)
    if not isinstance(value, (list, tuple)) or not value \
            or not all(isinstance(row, (list, tuple)) for row in value):
        raise ValueError(f"{where}.{name} must be a non-empty list of lists")
    return list(value)


def int_field(data: dict, name: str, where: str) -> int:
    value = required_field(data, name, where)
    if not is_int(value):
        raise ValueError(f"{where}.{name} must be an int, got {value!r}")
    return value


def count_field(data: dict, name: str, where: str) -> int:
    """An optional non-negative int: 0 when missing or null."""
    value = data.get(name)
    if value is None:
        return 0
    if not is_int(value) or value < 0:
        raise ValueError(f"{where}.{name} must be a non-negative int or null, got {value!r}")
    return value


def str_field(data: dict, name: str) -> str:
    value = required_field(data, name, "record")
    if not isinstance(value, str):
        raise ValueError(f"record.{name} must be a str, got {value!r}")
    return value


def float_field(data: dict, name: str) -> float:
    value = required_field(data, name, "record")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"record.{name} must be a number, got {value!r}")
    return float(value)


def optional_float(data: dict, name: str) -> float:
    return float_field(data, name) if name in data else 0.0


def optional_str(data: dict, name: str) -> str:
    return "" if data.get(name) is None else str_field(data, name)


def token_tuple(data: dict, name: str, where: str) -> tuple[int, ...]:
    value = required_field(data, name, where)
    if not isinstance(value, (list, tuple)) or not all(is_int(t) and t >= 0 for t in value):
        raise ValueError(f"{where}.{name} must be a list of non-negative ints")
    return tuple(value)


def events_field(value: Any) -> tuple[dict, ...]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"record.events must be a list, got {type(value).__name__}")
    for i, event in enumerate(value):
        if not isinstance(event, dict) or not is_int(event.get("anchor_before")):
            raise ValueError(f"record.events[{i}] must be a dict with an int 'anchor_before'")
    return tuple(dict(e) for e in value)
