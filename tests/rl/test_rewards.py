"""Rewards: math answers, format, countdown dispatch, user reward functions and a scorer that never raises."""

from __future__ import annotations

import math
import os
import sys
import threading
import time

import pytest

from rhymerl.config import load_config
from rhymerl.data.dataset import Example
from rhymerl.rl.rewards import (
    RewardFunction, RewardFunctionError, RewardScorer, RewardTimeoutError, default_score, final_answer,
    format_reward, load_reward_function, load_reward_functions, math_reward, overlong_penalty)


@pytest.mark.parametrize("completion, truth", [
    ("48 + 24 = 72\n#### 72", "72"),
    ("so the answer is \\boxed{72}.", "72"),
    ("the answer is 72.", "72"),
    ("#### 72.0", "72"),
    ("#### 1,000", "1000"),
    ("#### 1000", "1,000"),
    ("#### $18", "18"),
    ("#### 72 apples", "72"),
    ("#### 72<|im_end|>", "72"),
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("#### 1/2", "\\frac{1}{2}"),
    ("#### 3\nwait, no\n#### 4\n", "4"),
])
def test_math_reward_correct(completion, truth):
    assert math_reward(completion, truth) == 1.0


@pytest.mark.parametrize("completion, truth", [
    ("#### 71", "72"),
    ("\\boxed{73}", "72"),
    ("72 is wrong, it is 70", "72"),
    ("no numbers at all", "72"),
    ("", "72"),
    ("#### 7.2", "72"),
    ("#### 100", "1,000"),
])
def test_math_reward_wrong(completion, truth):
    assert math_reward(completion, truth) == 0.0


def test_math_reward_off_the_main_thread():
    results = []
    thread = threading.Thread(target=lambda: results.append(math_reward("\\boxed{\\frac{6}{4}}", "1.5")))
    thread.start()
    thread.join()
    assert results == [1.0]


def test_final_answer():
    assert final_answer("#### 72\n") == "72"
    assert final_answer("\\boxed{x^{2}}") == "x^{2}"
    assert final_answer("got 1,234, done") == "1,234"
    assert final_answer("nothing") is None
    assert final_answer("so 5-3 makes 2") == "2" and final_answer("it was 5-3") == "3"
    assert final_answer("it fell to -3.") == "-3"


@pytest.mark.parametrize("completion, expected", [
    ("work\n#### 72", 1.0),
    ("work\n#### 72  \n<|im_end|>", 1.0),
    ("work\n#### 72</s>", 1.0),
    ("it is \\boxed{72} I think", 1.0),
    ("work\n#### \n", 0.0),
    ("#### 72\nand then more text", 0.0),
    ("#### 12#############################", 0.0),  # reward hacking seen in a real run
    ("#### " + "1" * 80, 0.0),
    ("#### (3 + 5) * 2", 1.0),
    ("the answer is 72", 0.0),
    ("\\boxed{}", 0.0),
])
def test_format_reward(completion, expected):
    assert format_reward(completion) == expected


def test_default_score_dispatches_on_data_source():
    truth = '{"numbers": [3, 5, 2], "target": 16}'
    assert default_score("countdown", "#### (3 + 5) * 2", truth) == 1.0
    assert default_score("countdown", "#### 16", truth) == 0.0
    assert default_score("gsm8k", "#### 16", "16") == 1.0
    assert default_score("openai/gsm8k", "#### 16", "16") == 1.0
    with pytest.raises(ValueError):
        default_score("countdown", "#### 16", "16")


def example(truth="4", source="row#1", data_source="math", prompt="2+2?"):
    return Example(prompt, truth, data_source, source)


def test_scorer_default_with_format_weight():
    batch = RewardScorer(format_weight=0.5).score(
        ["#### 4", "it is 4", "#### 5"], [example(), example(), example()])
    assert batch.correct == [1.0, 1.0, 0.0]
    assert batch.formatted == [1.0, 0.0, 1.0]
    assert batch.rewards == [1.5, 1.0, 0.5]
    assert batch.errors == 0 and batch.error_messages == []


def test_a_completion_cut_off_at_the_length_limit_earns_no_format_reward():
    """Its text cannot tell: a response cut off inside a repeated '#### ...' line ends with one (the default
    job learned exactly that, docs/notebook); correctness is still scored."""
    looping = "#### 4\n#### 4\n#### 4"
    batch = RewardScorer(format_weight=0.5).score([looping, looping, "#### 5"], [example()] * 3,
                                                  finished=[False, True, False])
    assert batch.formatted == [0.0, 1.0, 0.0] and batch.correct == [1.0, 1.0, 0.0]
    assert batch.rewards == [1.0, 1.5, 0.0]
    with pytest.raises(ValueError, match="2 finished flags"):
        RewardScorer().score(["a"] * 3, [example()] * 3, finished=[True, False])


def test_scorer_counts_failing_functions():
    def fn(completion, ground_truth, data_source, prompt):
        if completion == "raise":
            raise KeyError("boom")
        if completion == "nan":
            return math.nan
        if completion == "inf":
            return math.inf
        if completion == "text":
            return "1.0"
        if completion == "dict":
            return {"score": 0.25}
        if completion == "bool":
            return True
        return 0.75

    completions = ["raise", "nan", "ok", "text", "inf", "dict", "bool"]
    examples = [example(source=f"data.jsonl:{i + 1}") for i in range(len(completions))]
    batch = RewardScorer(function=fn).score(completions, examples)
    assert batch.correct == [0.0, 0.0, 0.75, 0.0, 0.0, 0.25, 1.0]
    assert batch.rewards == batch.correct
    assert batch.errors == 4
    assert batch.error_messages[0].startswith("data.jsonl:1:") and "KeyError" in batch.error_messages[0]
    assert "nan" in batch.error_messages[1] and "data.jsonl:4:" in batch.error_messages[2]


def test_scorer_bad_countdown_truth_is_an_error_not_a_crash():
    batch = RewardScorer().score(["#### 1 + 2"], [example("not json", data_source="countdown")])
    assert batch.correct == [0.0] and batch.errors == 1


def test_scorer_keeps_only_the_first_messages():
    def fn(**kwargs):
        raise RuntimeError("always")

    batch = RewardScorer(function=fn).score(["x"] * 20, [example(source=f"s{i}") for i in range(20)])
    assert batch.errors == 20 and len(batch.error_messages) == 5


def test_scorer_passes_prompt_and_fields_by_keyword():
    seen = []

    def fn(*, completion, ground_truth, data_source, prompt):
        seen.append((completion, ground_truth, data_source, prompt))
        return 1

    chat = (("system", "s"), ("user", "u"))
    RewardScorer(function=fn).score(["a", "b"], [example(), example(prompt=chat, data_source="verl")])
    assert seen == [("a", "4", "math", "2+2?"),
                    ("b", "4", "verl", [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])]


def test_scorer_length_mismatch():
    with pytest.raises(ValueError, match="2 completions for 1 examples"):
        RewardScorer().score(["a", "b"], [example()])


def test_load_reward_function_from_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def score(completion, ground_truth, data_source, prompt):\n"
                    "    return float(completion.strip() == ground_truth)\n"
                    "NOT_CALLABLE = 3\n")
    fn = load_reward_function(f"{path}:score")
    assert RewardScorer(function=fn).score(["4", "5"], [example(), example()]).correct == [1.0, 0.0]

    with pytest.raises(RewardFunctionError, match="has no attribute 'missing'"):
        load_reward_function(f"{path}:missing")
    with pytest.raises(RewardFunctionError, match="not callable"):
        load_reward_function(f"{path}:NOT_CALLABLE")
    with pytest.raises(RewardFunctionError, match="nope.py' not found"):
        load_reward_function(f"{tmp_path}/nope.py:score")

    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere_xyz\n")
    with pytest.raises(RewardFunctionError, match="broken.py.*ModuleNotFoundError"):
        load_reward_function(f"{broken}:score")


def test_load_reward_function_from_module(tmp_path, monkeypatch):
    (tmp_path / "reward_pkg_xyz").mkdir()
    (tmp_path / "reward_pkg_xyz" / "__init__.py").write_text("")
    (tmp_path / "reward_pkg_xyz" / "scores.py").write_text("def exact(**kw):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert load_reward_function("reward_pkg_xyz.scores:exact")() == 1.0
        # math_reward(completion, ground_truth) cannot take data_source and prompt: refused at load, not at
        # every call (issue 26 item 13)
        with pytest.raises(RewardFunctionError, match="math_reward'.*cannot be called as fn"):
            load_reward_function("rhymerl.rl.rewards:math_reward")
        with pytest.raises(RewardFunctionError, match="module 'reward_pkg_xyz.nothing' not found"):
            load_reward_function("reward_pkg_xyz.nothing:f")
        with pytest.raises(RewardFunctionError, match="module 'no_such_pkg_xyz' not found"):
            load_reward_function("no_such_pkg_xyz:f")
        with pytest.raises(RewardFunctionError, match="expected 'package.module:function'"):
            load_reward_function("reward_pkg_xyz.scores")
        with pytest.raises(RewardFunctionError, match="expected"):
            load_reward_function("reward_pkg_xyz.scores:")
    finally:
        for name in [n for n in sys.modules if n.startswith("reward_pkg_xyz")]:
            del sys.modules[name]


# ---- several functions with weights (TRL's reward_funcs / reward_weights), DAPO's overlong penalty ----------

def test_several_functions_are_a_weighted_sum_with_a_mean_each():
    def exact(completion, **kw):
        return float(completion == "4")

    def short(completion, **kw):
        return 1.0 if len(completion) < 3 else 0.0

    def exact_too(completion, **kw):  # the same __name__ twice gets a suffix
        return 1.0

    exact_too.__name__ = "exact"
    scorer = RewardScorer(functions=[RewardFunction(exact, 2.0), RewardFunction(short, -0.5), exact_too])
    batch = scorer.score(["4", "four"], [example(), example()])
    assert batch.correct == [2.0 - 0.5 + 1.0, 0.0 + 0.0 + 1.0]
    assert batch.by_function == {"exact": [1.0, 0.0], "short": [1.0, 0.0], "exact_2": [1.0, 1.0]}
    assert batch.metrics() == {"critic/rewards/exact/mean": 0.5, "critic/rewards/short/mean": 0.5,
                               "critic/rewards/exact_2/mean": 1.0, "reward/timeouts": 0}
    assert batch.metrics("val")["val/rewards/short/mean"] == 0.5


def test_a_failing_function_costs_its_part_and_counts_once_per_completion():
    def good(**kw):
        return 1.0

    def bad(completion, **kw):
        if completion == "x":
            raise KeyError("boom")
        return 1.0

    batch = RewardScorer(functions=[good, bad]).score(["x", "y"], [example(source="a:1"), example()])
    assert batch.correct == [1.0, 2.0] and batch.errors == 1
    assert batch.error_messages == ["a:1: reward bad failed: KeyError: 'boom'"]


def test_from_config_loads_functions_and_weights(tmp_path):
    path = tmp_path / "two.py"
    path.write_text("def one(**kw):\n    return 1.0\n\ndef half(**kw):\n    return 0.5\n")
    cfg = load_config(overrides=[f"reward.functions=[{path}:one, {path}:half]", "reward.weights=[1, 4]",
                                 "reward.format_weight=0", "reward.timeout_s=0"])
    batch = RewardScorer.from_config(cfg.reward, 16).score(["a"], [example()])
    assert batch.correct == [3.0] and list(batch.by_function) == ["one", "half"]
    single = load_config(overrides=[f"reward.function={path}:half", "reward.timeout_s=0"])  # one entry
    assert RewardScorer.from_config(single.reward, 16).score(["a"], [example()]).correct == [0.5]
    with pytest.raises(ValueError, match="2 weights for 1 reward functions"):
        load_reward_functions([f"{path}:one"], [1.0, 2.0])


def test_overlong_penalty_is_verls_linear_buffer():
    # max 20 tokens, buffer 4: no penalty up to 16, then -factor/4 per token down to -factor at 20
    assert [overlong_penalty(n, 20, 4, 2.0) for n in (10, 16, 17, 18, 20)] == [0.0, 0.0, -0.5, -1.0, -2.0]
    assert overlong_penalty(20, 20, 0) == 0.0  # off
    scorer = RewardScorer(format_weight=0.0, overlong_buffer_len=4, max_completion_length=20)
    batch = scorer.score(["#### 4", "#### 4"], [example(), example()], lengths=[8, 18])
    assert batch.rewards == [1.0, 0.5] and batch.overlong == [0.0, -0.5]
    assert batch.metrics()["critic/overlong_penalty/mean"] == -0.25 and batch.metrics()["critic/overlong_frac"] == 0.5
    assert scorer.score(["#### 4"], [example()]).rewards == [1.0]  # no lengths (validation): no penalty
    with pytest.raises(ValueError, match="overlong_buffer_len .30. must be at most rollout.max_completion_length"):
        RewardScorer(overlong_buffer_len=30, max_completion_length=20)


# ---- reward.timeout_s: the functions in a worker process, each call limited ----------------------------------

SLOW_REWARDS = '''
import os, time
from math_verify import parse, verify

def slow(completion, ground_truth, **kw):
    if completion == "hang":
        time.sleep(60)
    if completion == "raise":
        raise KeyError("boom")
    return float(completion == ground_truth)

def accuracy(completion, ground_truth, **kw):  # TRL's accuracy reward: math_verify with its own timeouts
    return float(verify(parse(ground_truth), parse(completion)))

def pid(**kw):
    return os.getpid()
'''


def test_a_function_that_does_not_return_scores_zero_and_the_run_goes_on(tmp_path):
    path = tmp_path / "slow_rewards.py"
    path.write_text(SLOW_REWARDS)
    scorer = RewardScorer(functions=load_reward_functions([f"{path}:slow"]), timeout_s=1.0)
    try:
        t0 = time.perf_counter()
        batch = scorer.score(["4", "hang", "raise", "5", "4"], [example(source=f"r{i}") for i in range(5)])
        assert time.perf_counter() - t0 < 30  # the hung call cost about timeout_s (plus a worker restart)
        assert batch.correct == [1.0, 0.0, 0.0, 0.0, 1.0]
        assert batch.errors == 2 and batch.timeouts == 1 and batch.metrics()["reward/timeouts"] == 1
        assert batch.error_messages == ["r1: reward failed: did not return within reward.timeout_s=1 s",
                                        "r2: reward failed: KeyError: 'boom'"]
    finally:
        scorer.close()


def test_a_stuck_function_stops_the_run_with_a_clear_message(tmp_path):
    path = tmp_path / "slow_rewards.py"
    path.write_text(SLOW_REWARDS)
    scorer = RewardScorer(functions=load_reward_functions([f"{path}:slow"]), timeout_s=0.3)
    with pytest.raises(RewardTimeoutError, match=r"slow' did not return within reward.timeout_s=0.3 s in 3 calls "
                                                 r"in a row: it looks stuck"):
        scorer.score(["hang"] * 5, [example()] * 5)
    assert isinstance(RewardTimeoutError("x"), ValueError)  # the CLI shows it as one line
    assert scorer.worker._proc is None  # the stuck process was killed


def test_the_worker_runs_math_verify_with_its_timeouts_and_leaves_no_process(tmp_path):
    path = tmp_path / "slow_rewards.py"
    path.write_text(SLOW_REWARDS)
    # math_verify's parse refuses to run off the main thread with its default timeout: a thread-based time
    # limit would score every completion 0 here
    scorer = RewardScorer(functions=load_reward_functions([f"{path}:accuracy", f"{path}:pid"], [1.0, 0.0]),
                          timeout_s=30.0)
    batch = scorer.score(["\\frac{1}{2}", "0.3"], [example("0.5"), example("0.5")])
    assert batch.by_function["accuracy"] == [1.0, 0.0] and batch.errors == 0
    child = int(batch.by_function["pid"][0])
    assert child != os.getpid()
    proc = scorer.worker._proc
    scorer.close()
    assert not proc.is_alive()


def test_a_function_given_as_a_closure_needs_no_limit_or_a_spec():
    def local(**kw):
        return 1.0

    with pytest.raises(RewardFunctionError, match="cannot be sent to the reward worker process"):
        RewardScorer(function=local, timeout_s=1.0)
    assert RewardScorer(function=local, timeout_s=0.0).score(["a"], [example()]).correct == [1.0]
