"""Rewards for completions: answer correctness, answer format, user reward functions, DAPO's overlong penalty.

The reward of a completion is its correctness plus format_weight times its format reward, plus the overlong
penalty when it is on. Correctness comes from the user's functions when given (TRL's reward_funcs with
reward_weights: their weighted sum; see `rhymerl.rl.reward_functions`), else from `default_score`, which
dispatches on the example's data_source as verl's default_compute_score does: countdown equations are checked
exactly, repeat's copies graded by word similarity, everything else is compared as a math answer with
math_verify.
"""

from __future__ import annotations

import math
import numbers
import re
import threading
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Sequence

from math_verify import parse, verify

from rhymerl.data.dataset import Example
from rhymerl.rl.reward_functions import (RewardCallError, RewardFunction, RewardFunctionError, RewardTimeoutError,
                                         RewardWorker, load_reward_function, load_reward_functions,
                                         named_functions)
from rhymerl.tasks import countdown, repeat

__all__ = [  # load_reward_function and the errors live in rl.reward_functions; importable from here as before
    "RewardBatch", "RewardFunction", "RewardFunctionError", "RewardScorer", "RewardTimeoutError", "default_score",
    "final_answer", "format_reward", "load_reward_function", "load_reward_functions", "math_reward",
    "overlong_penalty",
]

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
    the JSON ground truth {"numbers": [...], "target": N}; "repeat" grades a copy of the ground-truth text
    (`repeat.score_copy`, 1.0 iff word for word); every other source is a math answer (math_reward).
    Raises ValueError for a countdown ground truth that is not that JSON."""
    if data_source == "countdown":
        puzzle_numbers, target = countdown.read_ground_truth(ground_truth)
        return countdown.score_equation(completion, puzzle_numbers, target)
    if data_source == "repeat":
        return repeat.score_copy(completion, ground_truth)
    return math_reward(completion, ground_truth)


def overlong_penalty(length: int, max_length: int, buffer_len: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment, as verl's overlong buffer computes it: 0 up to max_length - buffer_len
    tokens, then falling linearly to -factor at max_length (min(-(length - (max_length - buffer_len)) /
    buffer_len * factor, 0)). buffer_len 0 is off (0.0)."""
    if buffer_len <= 0:
        return 0.0
    return min(-(length - (max_length - buffer_len)) / buffer_len * factor, 0.0)


@dataclass
class RewardBatch:
    """Per-completion rewards and their parts, in the order scored.

    reward = correct + format_weight * formatted + overlong. correct is the weighted sum of the user's
    functions (`by_function` holds each one's unweighted values, 0.0 where it failed), or `default_score`.
    errors counts completions whose correctness could not be computed in full (a function raised, returned a
    non-number, NaN or inf, or did not return within reward.timeout_s; that function's value is 0.0); timeouts
    counts the calls among those that timed out; error_messages keeps the first MAX_ERROR_MESSAGES messages.
    """

    rewards: list[float]
    correct: list[float]
    formatted: list[float]
    errors: int = 0
    error_messages: list[str] = field(default_factory=list)
    by_function: dict[str, list[float]] = field(default_factory=dict)
    overlong: list[float] = field(default_factory=list)  # the overlong penalties (empty when it is off)
    timeouts: int = 0

    def metrics(self, prefix: str = "critic") -> dict[str, float]:
        """Means to log: each user function's (unweighted, TRL's rewards/<name>/mean) as
        `<prefix>/rewards/<name>/mean`, the overlong penalty's as `<prefix>/overlong_penalty/mean` with the share
        of completions it hit, and the timeouts (`reward/timeouts` for the training prefix "critic", else
        `<prefix>/reward_timeouts`)."""
        n = max(len(self.rewards), 1)
        out = {f"{prefix}/rewards/{name}/mean": sum(v) / n for name, v in self.by_function.items()}
        if self.overlong:
            out[f"{prefix}/overlong_penalty/mean"] = sum(self.overlong) / n
            out[f"{prefix}/overlong_frac"] = sum(p < 0 for p in self.overlong) / n
        out["reward/timeouts" if prefix == "critic" else f"{prefix}/reward_timeouts"] = self.timeouts
        return out


def _number(value) -> float:
    """A reward function's return value as a finite float (a verl-style {"score": x} gives x); raises
    TypeError or ValueError otherwise."""
    if isinstance(value, dict) and "score" in value:
        value = value["score"]
    if not isinstance(value, numbers.Real):  # bools count: `return answer == truth` is natural
        raise TypeError(f"returned {type(value).__name__} {value!r:.60}, not a number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"returned {value}, not a finite number")
    return value


class RewardScorer:
    """Scores completions of examples: correctness (the user's functions if given, else `default_score`) plus
    format_weight times `format_reward`, plus DAPO's overlong penalty when overlong_buffer_len > 0. A failing or
    slow correctness function never stops training (see RewardBatch), except one that is stuck (it timed out
    MAX_CONSECUTIVE_TIMEOUTS calls in a row: RewardTimeoutError).

    function / functions: the user's reward functions (callables or `RewardFunction`s with weights; `function`
    is one more at the front). timeout_s > 0 calls them in a worker process with that time limit per call
    (`rhymerl.rl.reward_functions.RewardWorker`); 0 calls them here, without a limit. The overlong penalty needs
    max_completion_length, and the completions' token counts in `score` (none given: no penalty).
    """

    def __init__(self, format_weight: float = 0.0, function: Callable | None = None, *,
                 functions: Sequence[RewardFunction | Callable] = (), timeout_s: float = 0.0,
                 overlong_buffer_len: int = 0, overlong_penalty_factor: float = 1.0,
                 max_completion_length: int | None = None):
        if overlong_buffer_len > 0 and not (max_completion_length and overlong_buffer_len <= max_completion_length):
            raise ValueError(f"reward.overlong_buffer_len ({overlong_buffer_len}) must be at most "
                             f"rollout.max_completion_length ({max_completion_length})")
        self.format_weight = format_weight
        self.functions = named_functions(([function] if function is not None else []) + list(functions))
        self.timeout_s = timeout_s
        self.overlong_buffer_len = overlong_buffer_len
        self.overlong_penalty_factor = overlong_penalty_factor
        self.max_completion_length = max_completion_length
        self.worker = RewardWorker(self.functions, timeout_s) if timeout_s > 0 and self.functions else None

    @classmethod
    def from_config(cls, reward, max_completion_length: int) -> "RewardScorer":
        """The scorer a `RewardSection` describes (reward.function is one entry of reward.functions), for
        completions of at most max_completion_length tokens. Raises RewardFunctionError for a function that
        cannot be loaded."""
        specs = list(reward.functions) or ([reward.function] if reward.function else [])
        return cls(reward.format_weight, functions=load_reward_functions(specs, reward.weights),
                   timeout_s=reward.timeout_s, overlong_buffer_len=reward.overlong_buffer_len,
                   overlong_penalty_factor=reward.overlong_penalty_factor,
                   max_completion_length=max_completion_length)

    def close(self) -> None:
        """Stop the reward worker process, if any (it also ends with the run)."""
        if self.worker is not None:
            self.worker.close()

    def _call(self, index: int, completion: str, example: Example) -> float:
        prompt = example.prompt if isinstance(example.prompt, str) else example.messages()
        kwargs = dict(completion=completion, ground_truth=example.ground_truth, data_source=example.data_source,
                      prompt=prompt)
        f = self.functions[index]
        return _number(self.worker.call(index, kwargs) if self.worker is not None else f.fn(**kwargs))

    def score(self, completions: list[str], examples: list[Example], lengths: Sequence[int] | None = None,
              finished: Sequence[bool] | None = None) -> RewardBatch:
        """One reward per completion; completions[i] answers examples[i] and has lengths[i] tokens. The overlong
        penalty applies where lengths are given (training rollouts; validation, scored without them, measures
        answers rather than lengths, as max_completion_length is the rollout's). `finished[i]` False: the
        completion was cut off at the length limit, and earns no format reward (its text, decoded without
        special tokens, cannot say so itself; without this, the default job learned to repeat "####" lines
        until cut off: docs/notebook); None: every one finished. Raises ValueError when the lists differ
        in length, and RewardTimeoutError when a function is stuck (see the class docstring)."""
        if len(completions) != len(examples) or any(x is not None and len(x) != len(completions)
                                                     for x in (lengths, finished)):
            raise ValueError(f"{len(completions)} completions for {len(examples)} examples"
                             f"{'' if lengths is None else f' and {len(lengths)} lengths'}"
                             f"{'' if finished is None else f' and {len(finished)} finished flags'}; expected one "
                             f"example (and length, and flag) per completion")
        batch = RewardBatch([], [], [], by_function={f.name: [] for f in self.functions})
        for k, (completion, example) in enumerate(zip(completions, examples)):
            failed, correct = False, 0.0
            parts = [(f, i) for i, f in enumerate(self.functions)] or [(None, -1)]
            for f, i in parts:
                try:
                    value = (self._call(i, completion, example) if f is not None else
                             default_score(example.data_source, completion, example.ground_truth))
                except RewardTimeoutError:
                    raise
                except Exception as e:  # a user's reward bug costs that sample's reward, not the run
                    value, failed = 0.0, True
                    batch.timeouts += isinstance(e, RewardCallError) and e.timed_out
                    if len(batch.error_messages) < MAX_ERROR_MESSAGES:
                        what = f"reward {f.name} failed" if len(self.functions) > 1 else "reward failed"
                        why = str(e) if isinstance(e, RewardCallError) else f"{type(e).__name__}: {e}"
                        batch.error_messages.append(f"{example.source}: {what}: {why}")
                if f is not None:
                    batch.by_function[f.name].append(value)
                correct += value * (f.weight if f is not None else 1.0)
            batch.errors += failed
            formatted = format_reward(completion) if finished is None or finished[k] else 0.0
            reward = correct + self.format_weight * formatted
            if self.overlong_buffer_len > 0 and lengths is not None:
                batch.overlong.append(overlong_penalty(lengths[k], self.max_completion_length,
                                                       self.overlong_buffer_len, self.overlong_penalty_factor))
                reward += batch.overlong[-1]
            batch.correct.append(correct)
            batch.formatted.append(formatted)
            batch.rewards.append(reward)
        return batch
