"""The TRL baseline of `rhymerl bench e2e`: one real GRPOTrainer step on the cached model.

Slow (loads TRL and trains a 135M model on the CPU), so it runs only with RHYMERL_SLOW=1.
"""

import os

import pytest

from rhymerl.model.fetch import cached_builtin_dir
from rhymerl.tasks.arithmetic import make_problems, prompt_text

pytestmark = pytest.mark.skipif(os.environ.get("RHYMERL_SLOW", "") != "1", reason="slow: set RHYMERL_SLOW=1")


def test_one_trl_step_is_timed_and_logged(tmp_path):
    pytest.importorskip("trl")
    model_dir = cached_builtin_dir("smollm2-135m")
    if model_dir is None:
        pytest.skip("smollm2-135m not cached")
    from rhymerl.bench.trl_baseline import run_trl_grpo

    problems = make_problems(4, 0)
    prompts = [[{"role": "user", "content": prompt_text(p)}] for p in problems]
    truths = [str(p.answer) for p in problems]
    seen: list[tuple[list[str], list[str], list[bool]]] = []

    def reward(texts, gts, finished):
        seen.append((texts, gts, finished))
        return [1.0 if gt in text else 0.0 for text, gt in zip(texts, gts)]

    run = run_trl_grpo(model_dir, prompts, truths, reward, num_generations=2, prompts_per_step=2,
                       micro_batch_size=2, max_completion_length=16, learning_rate=1e-6, steps=1,
                       output_dir=tmp_path)

    assert len(run.step_s) == len(run.rollout_s) == len(run.reward_mean) == len(run.completion_length) == 1
    assert 0 < run.rollout_s[0] < run.step_s[0]  # generation ran inside the timed step
    assert 0 < run.completion_length[0] <= 16
    # One reward call for the step's 2 prompts x 2 completions: plain texts, each with its prompt's answer.
    assert len(seen) == 1
    texts, gts, finished = seen[0]
    assert len(texts) == 4 and all(isinstance(t, str) for t in texts)
    assert len(finished) == 4 and all(isinstance(f, bool) for f in finished)  # cut off at 16 tokens or not
    assert set(gts) <= set(truths) and len(set(gts)) == 2  # the 4 problems' answers are distinct
    assert run.reward_mean[0] == pytest.approx(sum(gt in t for t, gt in zip(texts, gts)) / 4)
    assert run.trl_version
