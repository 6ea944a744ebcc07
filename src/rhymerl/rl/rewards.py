"""Rewards for completions: answer correctness, answer format, and user reward functions.

The reward of a completion is its correctness plus format_weight times its format reward. Correctness comes
from the user's function when one is given (see `load_reward_function`), else from `default_score`, which
dispatches on the example's data_source as verl's default_compute_score does: countdown equations are checked
exactly, everything else is compared as a math answer with math_verify.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import re
import sys
import threading
import zlib
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Callable

from math_verify import parse, verify

from rhymerl.data.dataset import Example
from rhymerl.tasks import countdown

# math_verify's own timeouts bound a pathological parse or comparison; seconds.
MATH_VERIFY_TIMEOUT_S = 5
# How many error messages a RewardBatch keeps; the count of errors is always exact.
MAX_ERROR_MESSAGES = 5

_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
# Not inside a word, and a minus only where it is a sign: the last number of "5-3" is 3, not -3.
_LAST_NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?")


def final_answer(completion: str) -> str | None:
    """The answer a completion gives: the line after its last '####', else its last \\boxed{...}, else the last
    number in it; None when there is none of these."""
    marked = countdown.marked_answer(completion)
    if marked is not None:
        return marked
    numbers_in_text = _LAST_NUMBER.findall(countdown.strip_special_tokens(completion))
    return numbers_in_text[-1].rstrip(",") if numbers_in_text else None


def _plain_number(text: str) -> Fraction | None:
    text = text.strip().rstrip(".").lstrip("$")
    if not _PLAIN_NUMBER.fullmatch(text):
        return None
    return Fraction(text.replace(",", ""))


def _math_verify_timeout() -> int | None:
    # math_verify times out with signal.alarm, which Python allows only in the main thread (elsewhere parse
    # raises ValueError). Off the main thread the timeout is disabled: answers are a line or a box, short.
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _parse(text: str, timeout: int | None) -> list:
    # Plain text first: "$72$" would read "18 dollars" as a product of symbols. Wrapping in $...$ rescues
    # LaTeX that plain parsing misses, such as "\$18" or "\text{72}".
    parsed = parse(text, parsing_timeout=timeout)
    return parsed or parse(f"${text}$", parsing_timeout=timeout)


def math_reward(completion: str, ground_truth: str) -> float:
    """1.0 if the completion's final answer (see `final_answer`) equals ground_truth, else 0.0.

    Plain numbers are compared exactly ("72.0" equals "72", "1,000" equals "1000"); anything else (fractions,
    LaTeX, expressions) is compared with math_verify. Safe to call from any thread (math_verify's
    signal-based timeout is used only in the main thread).
    """
    candidate = final_answer(completion)
    if candidate is None:
        return 0.0
    gold_number, candidate_number = _plain_number(ground_truth), _plain_number(candidate)
    if gold_number is not None and candidate_number is not None:
        return 1.0 if gold_number == candidate_number else 0.0
    timeout = _math_verify_timeout()
    gold, answer = _parse(ground_truth, timeout), _parse(candidate, timeout)
    if not gold or not answer:
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=timeout) else 0.0


# A final line "#### <answer>": the answer is short and has no '#' (a policy trained on a looser check
# learned to pad "#### 12" with hundreds of '#' up to the length limit).
_FORMAT_LINE = re.compile(r"\s*####\s*[^#\s][^#]{0,60}")


def format_reward(completion: str) -> float:
    """1.0 if the completion ends with a line "#### <answer>" (a short answer without '#', after trailing
    whitespace and end-of-sequence tokens are stripped) or contains a non-empty \\boxed{...}, else 0.0."""
    text = countdown.strip_special_tokens(completion)
    lines = text.splitlines()
    if lines and _FORMAT_LINE.fullmatch(lines[-1].rstrip()):
        return 1.0
    return 1.0 if countdown.last_boxed(text) else 0.0


def default_score(data_source: str, completion: str, ground_truth: str) -> float:
    """Correctness by data_source, like verl's default_compute_score: "countdown" checks the equation against
    the JSON ground truth {"numbers": [...], "target": N}; every other source is a math answer (math_reward).
    Raises ValueError for a countdown ground truth that is not that JSON."""
    if data_source == "countdown":
        puzzle_numbers, target = countdown.read_ground_truth(ground_truth)
        return countdown.score_equation(completion, puzzle_numbers, target)
    return math_reward(completion, ground_truth)


class RewardFunctionError(ValueError):
    """A reward function spec that cannot be loaded (the message names the spec)."""


def load_reward_function(spec: str) -> Callable:
    """The function named by "package.module:function" or "path/to/file.py:function".

    It is called once per completion with keyword arguments and returns its correctness as a number:

        fn(completion: str, ground_truth: str, data_source: str, prompt: str | list[dict]) -> float

    prompt is the example's text, or its chat messages as [{"role", "content"}, ...]. (verl users: returning
    a dict with a "score" key, as verl's reward functions may, works too.) Raises RewardFunctionError when the
    spec is malformed, the module or file cannot be found or imported, or the name is missing or not callable.
    """
    target, _, name = spec.rpartition(":")
    if not target or not name.isidentifier():
        raise RewardFunctionError(f"reward function {spec!r}: expected 'package.module:function' or "
                                  f"'path/to/file.py:function'")
    if target.endswith(".py") or "/" in target or "\\" in target:
        module = _module_from_file(spec, Path(target))
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            if e.name == target or target.startswith(f"{e.name}."):
                raise RewardFunctionError(f"reward function {spec!r}: module {target!r} not found") from None
            raise RewardFunctionError(f"reward function {spec!r}: importing {target!r} failed: {e}") from e
        except Exception as e:
            raise RewardFunctionError(f"reward function {spec!r}: importing {target!r} failed: "
                                      f"{type(e).__name__}: {e}") from e
    if not hasattr(module, name):
        raise RewardFunctionError(f"reward function {spec!r}: {target!r} has no attribute {name!r}")
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardFunctionError(f"reward function {spec!r}: {name!r} is a {type(fn).__name__}, not callable")
    return fn


def _module_from_file(spec: str, path: Path):
    if not path.is_file():
        raise RewardFunctionError(f"reward function {spec!r}: file {str(path)!r} not found")
    # A name of its own per file, registered before running it (dataclasses and pickling look modules up in
    # sys.modules), without shadowing a real module of the same stem.
    module_name = f"rhymerl_reward_{path.stem}_{zlib.crc32(str(path.resolve()).encode()):08x}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise RewardFunctionError(f"reward function {spec!r}: cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise RewardFunctionError(f"reward function {spec!r}: running {str(path)!r} failed: "
                                  f"{type(e).__name__}: {e}") from e
    return module


@dataclass
class RewardBatch:
    """Per-completion rewards and their parts, in the order scored.

    reward = correct + format_weight * formatted. errors counts completions whose correctness could not be
    computed (the function raised or returned a non-number, NaN or inf; their correctness is 0.0);
    error_messages keeps the first MAX_ERROR_MESSAGES of them.
    """

    rewards: list[float]
    correct: list[float]
    formatted: list[float]
    errors: int = 0
    error_messages: list[str] = field(default_factory=list)


class RewardScorer:
    """Scores completions of examples: correctness (the user's function if given, else `default_score`) plus
    format_weight times `format_reward`. A failing correctness function never stops training: see RewardBatch.
    """

    def __init__(self, format_weight: float = 0.0, function: Callable | None = None):
        self.format_weight = format_weight
        self.function = function

    def _correctness(self, completion: str, example: Example) -> float:
        if self.function is None:
            value = default_score(example.data_source, completion, example.ground_truth)
        else:
            prompt = example.prompt if isinstance(example.prompt, str) else example.messages()
            value = self.function(completion=completion, ground_truth=example.ground_truth,
                                  data_source=example.data_source, prompt=prompt)
            if isinstance(value, dict) and "score" in value:
                value = value["score"]
        if not isinstance(value, numbers.Real):  # bools count: `return answer == truth` is natural
            raise TypeError(f"returned {type(value).__name__} {value!r:.60}, not a number")
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"returned {value}, not a finite number")
        return value

    def score(self, completions: list[str], examples: list[Example]) -> RewardBatch:
        """One reward per completion; completions[i] answers examples[i]. Raises ValueError only when the two
        lists differ in length."""
        if len(completions) != len(examples):
            raise ValueError(f"{len(completions)} completions for {len(examples)} examples; "
                             f"expected one example per completion")
        batch = RewardBatch([], [], [])
        for completion, example in zip(completions, examples):
            try:
                correct = self._correctness(completion, example)
            except Exception as e:  # a user's reward bug costs that sample's reward, not the run
                correct = 0.0
                batch.errors += 1
                if len(batch.error_messages) < MAX_ERROR_MESSAGES:
                    batch.error_messages.append(f"{example.source}: reward failed: {type(e).__name__}: {e}")
            formatted = format_reward(completion)
            batch.correct.append(correct)
            batch.formatted.append(formatted)
            batch.rewards.append(correct + self.format_weight * formatted)
        return batch
