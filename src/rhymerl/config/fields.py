"""The field machinery of the config schema: a field with its help, choices and range (`option`), and the
checks of one section's values against its fields (`field_errors`). Torch-free and schema-free: it knows no
section; `rhymerl.config.sections` defines them and names each (a section's name is its `TrainConfig` field).
"""

from __future__ import annotations

import math
import typing
from dataclasses import field, fields
from typing import Any

__all__ = ["ConfigError", "field_errors", "must_be", "option"]


class ConfigError(ValueError):
    """A config file, override or value is invalid; the message names the offending key."""


def option(default: Any, help: str, choices: tuple[str, ...] | None = None, check: str | None = None) -> Any:
    """A dataclass field with its help text, allowed values and range kept in the field metadata.

    `check` is a bound as the error message words it: '>= 0', '> 0', 'in [0, 1)', 'in (0, 1]'.
    """
    return field(default=default, metadata={"help": help, "choices": choices, "check": check})


def _holds(value: float, check: str) -> bool:
    """Whether `value` is within the bound `check` (see `option`)."""
    if check.startswith("in "):
        lo, hi = map(float, check[4:-1].split(","))
        return (lo <= value if check[3] == "[" else lo < value) and (value <= hi if check[-1] == "]" else value < hi)
    op, bound = check.split()[:2]  # '>= 0 (0 = no clipping)' -> '>=', '0'
    return value >= float(bound) if op == ">=" else value > float(bound)


def _is_a(value: Any, typ: type) -> bool:
    """`value` fits a field of type `typ` (an int fits a float; a bool is not a number; a `tuple[X, ...]`
    field holds a tuple of X)."""
    if typing.get_origin(typ) is tuple:
        return isinstance(value, tuple) and all(_is_a(v, typing.get_args(typ)[0]) for v in value)
    return isinstance(value, (int, float) if typ is float else typ) and (typ is bool or not isinstance(value, bool))


def must_be(section: str, obj: Any, name: str, rule: str, note: str = "") -> str:
    """The error line of field `name` of section object `obj` breaking `rule`."""
    return f"{section}.{name}: must be {rule}, got {getattr(obj, name)!r}{note}"


def field_errors(section: str, obj: Any, types: dict[str, type]) -> tuple[list[str], bool]:
    """Every field of dataclass `obj` (section `section`, field types `types`) with a bad value, one line each,
    and whether the types were right: types and finite numbers first; only when those hold, choices and ranges
    (a range check on a value of the wrong type would raise TypeError)."""
    errors = []
    for f in fields(obj):
        value, typ = getattr(obj, f.name), types[f.name]
        if not _is_a(value, typ):
            hint = " (true/false)" if typ is bool else ""
            errors.append(f"{section}.{f.name}: expected {typ.__name__}{hint}, got {value!r}")
        elif typ is float and not math.isfinite(value):
            errors.append(must_be(section, obj, f.name, "a finite number"))
        elif typing.get_origin(typ) is tuple and typing.get_args(typ)[0] is float and \
                not all(map(math.isfinite, value)):
            errors.append(must_be(section, obj, f.name, "finite numbers"))
    if errors:
        return errors, False
    for f in fields(obj):
        choices, check = f.metadata.get("choices"), f.metadata.get("check")
        if choices is not None and getattr(obj, f.name) not in choices:
            errors.append(must_be(section, obj, f.name, f"one of {', '.join(map(repr, choices))}"))
        if check is not None and not _holds(getattr(obj, f.name), check):
            errors.append(must_be(section, obj, f.name, check))
    return errors, True
