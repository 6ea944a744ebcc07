"""The key reference printed by `rhymerl train --help`, built from the schema's field metadata."""

from __future__ import annotations

import typing
from dataclasses import fields
from typing import Any

from rhymerl.config.sections import _SECTION_NAMES, _TYPES

__all__ = ["config_help"]


def _show(value: Any) -> str:
    """A default as it would be typed in an override (YAML spelling for bools, quotes for '')."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "":
        return "''"
    if isinstance(value, tuple):  # a list key (tuple in the schema: immutable default)
        return "[" + ", ".join(map(_show, value)) + "]"
    return str(value)


def config_help() -> str:
    """Every key as `section.field  type = default  help`, grouped by section (for `rhymerl train --help`)."""
    rows = []
    for cls, section in _SECTION_NAMES.items():
        for f in fields(cls):
            text = f.metadata["help"]
            if f.metadata["choices"]:
                text += f" [{' | '.join(f.metadata['choices'])}]"
            typ = _TYPES[section][f.name]
            name = "list" if typing.get_origin(typ) is tuple else typ.__name__  # written as a YAML list
            rows.append((section, f"{section}.{f.name}", f"{name} = {_show(f.default)}", text))
    w_key = max(len(r[1]) for r in rows)
    w_type = max(len(r[2]) for r in rows)
    lines: list[str] = []
    for cls, section in _SECTION_NAMES.items():
        lines.append(f"{section}:  {(cls.__doc__ or '').strip().splitlines()[0]}".rstrip())
        for sec, key, typ_default, text in rows:
            if sec == section:
                lines.append(f"  {key:<{w_key}}  {typ_default:<{w_type}}  {text}".rstrip())
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
