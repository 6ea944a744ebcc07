"""Training examples, from a built-in task or read from a dataset file (JSONL, JSON or Parquet).

Files are read in the layout they already have, one example per row:

* GSM8K (openai/gsm8k): `question` text and `answer` text whose final answer follows '####' ("...\\n#### 72").
  The prompt is the question plus the arithmetic task's instruction; the ground truth is the final answer with
  thousands separators removed; data_source "gsm8k".
* verl (its RL parquet files): `prompt` as chat messages [{role, content}, ...], `reward_model: {ground_truth}`
  and an optional `data_source` (default "verl"). A non-text ground truth (TinyZero's countdown stores
  {"numbers", "target"}) is kept as JSON.
* simple: `prompt` text (or messages) with an `answer` or `ground_truth`; data_source "math" unless given.

A row that fits none of these is malformed: `read_dataset` raises DatasetError naming the file, the row and the
field, or with skip_malformed=True skips the row and records that message.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from rhymerl.errors import UserError
from rhymerl.tasks import arithmetic, countdown, repeat

BUILTIN_TASKS = ("arithmetic", "countdown", "repeat")
EXTENSIONS = (".jsonl", ".json", ".parquet")


class DatasetError(UserError):
    """A dataset file that cannot be read, or a row that is malformed (the message names file:row and field)."""


@dataclass(frozen=True)
class Example:
    """One training prompt and what its reward compares against.

    prompt is either text (one user turn) or chat messages as a tuple of (role, content) pairs: pairs rather
    than dicts so that Example stays hashable; `messages()` gives the list of dicts a chat template takes.
    Message keys other than role and content are dropped when reading a file.
    """

    prompt: str | tuple[tuple[str, str], ...]
    ground_truth: str  # a number as text, countdown's JSON {"numbers": [...], "target": N}, or repeat's text
    data_source: str  # "arithmetic" | "countdown" | "repeat" | "gsm8k" | "math" | verl's data_source value
    source: str  # where it came from, for messages: "path/to/file.jsonl:12" or "arithmetic#3"

    def __post_init__(self):
        # A list of dicts here would only fail later, when the example is hashed; fail where it is built.
        if not isinstance(self.prompt, (str, tuple)):
            raise TypeError(f"Example {self.source}: prompt must be text or a tuple of (role, content) pairs, "
                            f"got {type(self.prompt).__name__}")

    def messages(self) -> list[dict[str, str]]:
        """The prompt as chat messages: [{"role": "user", "content": text}] for a text prompt."""
        if isinstance(self.prompt, str):
            return [{"role": "user", "content": self.prompt}]
        return [{"role": role, "content": content} for role, content in self.prompt]


@dataclass
class DatasetFile:
    """The examples read from one file, and a message (file:row: field ...) for each malformed row skipped."""

    examples: list[Example]
    skipped: list[str] = field(default_factory=list)


def builtin_examples(task: str, n: int, seed: int) -> list[Example]:
    """n examples of a built-in task ("arithmetic", "countdown" or "repeat"), fixed by seed; source is
    "task#index"."""
    if task == "arithmetic":
        return [Example(arithmetic.prompt_text(p), str(p.answer), "arithmetic", f"arithmetic#{i}")
                for i, p in enumerate(arithmetic.make_problems(n, seed))]
    if task == "countdown":
        return [Example(countdown.prompt_text(p), countdown.ground_truth(p), "countdown", f"countdown#{i}")
                for i, p in enumerate(countdown.make_puzzles(n, seed))]
    if task == "repeat":
        return [Example(repeat.prompt_text(t), t, "repeat", f"repeat#{i}")
                for i, t in enumerate(repeat.make_texts(n, seed))]
    raise ValueError(f"unknown built-in task {task!r}; choose one of {', '.join(BUILTIN_TASKS)}")


def read_dataset(path, *, skip_malformed: bool = False) -> DatasetFile:
    """Examples from a .jsonl (one object a line, blank lines ignored), .json (a JSON array of objects, or JSON
    lines) or .parquet file; rows are numbered from 1 (JSONL: line numbers).

    Raises DatasetError for a missing or unreadable file, an unknown extension, a malformed row (unless
    skip_malformed, which skips it and records the message in `skipped`), or a file with no usable examples.
    """
    path = Path(path)
    if path.is_dir():
        raise DatasetError(f"{path}: is a directory; name a dataset file ({', '.join(EXTENSIONS)})")
    if not path.is_file():
        raise DatasetError(f"{path}: dataset file not found")
    suffix = path.suffix.lower()
    if suffix not in EXTENSIONS:
        raise DatasetError(f"{path}: unknown dataset extension {path.suffix!r}; "
                           f"expected one of {', '.join(EXTENSIONS)}")
    rows = _parquet_rows(path) if suffix == ".parquet" else _json_rows(path)
    examples, skipped = [], []
    for where, row in rows:
        try:
            if isinstance(row, DatasetError):
                raise row
            examples.append(_example(row, where))
        except DatasetError as e:
            if not skip_malformed:
                raise
            skipped.append(str(e))
    if not examples:
        detail = f"; {len(skipped)} malformed rows skipped, the first: {skipped[0]}" if skipped else ""
        raise DatasetError(f"{path}: no examples{detail}")
    return DatasetFile(examples, skipped)


# Row readers yield (where, row) with where = "path:row". A row that cannot even be decoded is yielded as a
# DatasetError instead of raised, so that skip_malformed can skip it like any other malformed row.

def _json_rows(path: Path) -> Iterator[tuple[str, object]]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: cannot read as UTF-8 text ({e})") from None
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        for i, row in enumerate(rows, 1):
            yield f"{path}:{i}", row
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as e:
            yield where, DatasetError(f"{where}: not valid JSON ({e.msg} at column {e.colno})")


def _parquet_rows(path: Path) -> Iterator[tuple[str, object]]:
    import pyarrow as pa  # imported here: reading JSONL should not pay for pyarrow
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
        row = 0
        for batch in batches:
            for value in batch.to_pylist():  # structs become dicts, lists of structs lists of dicts
                row += 1
                yield f"{path}:{row}", value
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{path}: not a readable Parquet file ({e})") from None


def _example(row, where: str) -> Example:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected an object, got {type(row).__name__}")
    if "prompt" in row:
        return _prompt_example(row, where)
    if "question" in row:
        return _gsm8k_example(row, where)
    raise DatasetError(f"{where}: field 'prompt' missing: a row needs 'prompt' (verl or simple layout) or "
                       f"'question' (GSM8K layout); it has {', '.join(map(repr, row)) or 'no fields'}")


def _gsm8k_example(row: dict, where: str) -> Example:
    question = row["question"]
    if not isinstance(question, str) or not question.strip():
        raise DatasetError(f"{where}: field 'question' must be non-empty text, got {_describe(question)}")
    answer = row.get("answer")
    if not isinstance(answer, str) or "####" not in answer:
        raise DatasetError(f"{where}: field 'answer' must be text ending in '#### <final answer>', "
                           f"got {_describe(answer)}")
    final = _final_answer(answer)
    if not final:
        raise DatasetError(f"{where}: field 'answer' has nothing after its last '####'")
    prompt = f"{question.strip()}\n{arithmetic.INSTRUCTION}"
    return Example(prompt, final, _data_source(row, where, "gsm8k"), where)


def _prompt_example(row: dict, where: str) -> Example:
    prompt = _prompt(_plain(row["prompt"]), where)
    if "reward_model" in row:
        reward_model = row["reward_model"]
        if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
            raise DatasetError(f"{where}: field 'reward_model' must be an object with a 'ground_truth', "
                               f"got {_describe(reward_model)}")
        truth = _ground_truth(reward_model["ground_truth"], where, "reward_model.ground_truth")
        default_source = "verl"
    elif "ground_truth" in row:
        truth = _ground_truth(row["ground_truth"], where, "ground_truth")
        default_source = "math"
    elif "answer" in row:
        answer = row["answer"]
        # A GSM8K-style worked answer is accepted here too; its final answer is what the reward compares.
        truth = _final_answer(answer) if isinstance(answer, str) and "####" in answer else answer
        truth = _ground_truth(truth, where, "answer")
        default_source = "math"
    else:
        raise DatasetError(f"{where}: field 'reward_model' missing: a 'prompt' row needs "
                           f"'reward_model': {{'ground_truth': ...}} (verl), 'ground_truth' or 'answer'")
    return Example(prompt, truth, _data_source(row, where, default_source), where)


def _prompt(value, where: str) -> str | tuple[tuple[str, str], ...]:
    if isinstance(value, str):
        if not value.strip():
            raise DatasetError(f"{where}: field 'prompt' is empty")
        return value
    if not isinstance(value, (list, tuple)) or not value:
        raise DatasetError(f"{where}: field 'prompt' must be text or a non-empty list of {{role, content}} "
                           f"messages, got {_describe(value)}")
    messages = []
    for i, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise DatasetError(f"{where}: field 'prompt' message {i} must be an object with text 'role' and "
                               f"'content', got {_describe(message)}")
        messages.append((message["role"], message["content"]))
    return tuple(messages)


def _ground_truth(value, where: str, name: str) -> str:
    value = _plain(value)
    if isinstance(value, str) and value.strip():
        return value.strip()
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return str(value)
    if isinstance(value, (dict, list)) and value:
        return json.dumps(value)
    raise DatasetError(f"{where}: field '{name}' must be non-empty text, a number or a JSON object, "
                       f"got {_describe(value)}")


def _data_source(row: dict, where: str, default: str) -> str:
    value = row.get("data_source")
    if value is None:
        return default
    if not isinstance(value, str) or not value:
        raise DatasetError(f"{where}: field 'data_source' must be non-empty text, got {_describe(value)}")
    return value


def _final_answer(answer: str) -> str:
    """GSM8K's final answer: the text after the last '####', without thousands separators ("1,000" -> "1000")."""
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def _plain(value):
    """Lists for numpy arrays and scalars (rows that went through pandas), without importing numpy."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return value.tolist()
    return value


def _describe(value) -> str:
    if value is None:
        return "nothing"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"
