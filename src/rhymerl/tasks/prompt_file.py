"""Prompts from a JSONL file: `prompt` (text or chat messages) or GSM8K's `question` (+ `answer`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PromptRow:
    prompt: str | list  # text, or a list of {role, content} chat messages
    answer: str | None = None


def _valid_messages(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m for m in value)


def read_prompt_file(path: Path) -> list[PromptRow]:
    """Rows with a `prompt` (a string or chat messages) or a `question` string. A bad row raises
    SystemExit naming the file, the line and the field."""
    rows = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path}:{lineno}: not valid JSON ({e.msg})")
        if not isinstance(row, dict):
            raise SystemExit(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        field = "prompt" if "prompt" in row else "question"
        value = row.get(field)
        if not (isinstance(value, str) or (field == "prompt" and _valid_messages(value))):
            raise SystemExit(f"{path}:{lineno}: field '{field}' must be a string"
                             f"{' or a list of {role, content} messages' if field == 'prompt' else ''}, "
                             f"got {type(value).__name__}")
        answer = row.get("answer")
        rows.append(PromptRow(value, answer if isinstance(answer, str) else None))
    return rows
