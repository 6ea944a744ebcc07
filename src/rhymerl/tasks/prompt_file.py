"""Prompts from a JSONL file: `prompt` (text or chat messages) or GSM8K's `question` (+ `answer`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rhymerl.errors import UserError


class PromptFileError(UserError):
    """A prompts file that cannot be read, or a row that is malformed (the message names file:line and field)."""


@dataclass(frozen=True)
class PromptRow:
    prompt: str | list  # text, or a list of {role, content} chat messages
    answer: str | None = None


def _valid_messages(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m for m in value)


def read_prompt_file(path: Path) -> list[PromptRow]:
    """Rows with a `prompt` (a string or chat messages) or a `question` string. A file that cannot be read
    as UTF-8 text, or a bad row, raises PromptFileError naming the file (and the line and the field)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except IsADirectoryError:
        raise PromptFileError(f"{path}: is a directory; --file takes a JSONL file, one {{\"prompt\": ...}} "
                              f"object a line") from None
    except OSError as e:
        raise PromptFileError(f"{path}: cannot read the prompts file ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise PromptFileError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptFileError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise PromptFileError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        field = "prompt" if "prompt" in row else "question"
        value = row.get(field)
        if not (isinstance(value, str) or (field == "prompt" and _valid_messages(value))):
            raise PromptFileError(f"{path}:{lineno}: field '{field}' must be a string"
                                  f"{' or a list of {role, content} messages' if field == 'prompt' else ''}, "
                                  f"got {type(value).__name__}")
        answer = row.get("answer")
        rows.append(PromptRow(value, answer if isinstance(answer, str) else None))
    return rows
