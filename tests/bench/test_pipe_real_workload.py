"""`bench pipe`'s real runs: which workload they roll out (`real_workload`: the recorded `repeat` task under
`--trace rhyming`, with several waves per worker; arithmetic otherwise; `--real-data` and the sizes given win),
and a real run that encodes the chosen task's prompts (a tiny random model with a byte tokenizer)."""

import pytest

from rhymerl.bench import pipe_real
from rhymerl.bench.pipe_real import MIN_WAVES, RECORDED, RealWorkload, real_workload
from rhymerl.data.dataset import builtin_examples
from rhymerl.errors import UserError
from tiny_models import byte_model_dir


def test_rhyming_trace_takes_the_recorded_task_with_several_waves_per_worker():
    w = real_workload("rhyming", None, ray_workers=2)
    assert w == RECORDED and w.task == "repeat"
    assert (w.prompts, w.max_tokens, w.temperature) == (12, 192, 0.6)  # as the recorded training run
    assert w.waves(2) >= MIN_WAVES and w.waves(1) >= 2 * MIN_WAVES
    # more workers: fewer slots each, so that every worker still fills its slots MIN_WAVES times
    assert real_workload("rhyming", None, ray_workers=4).waves(4) >= MIN_WAVES
    assert real_workload(None, "repeat", ray_workers=2) == w  # --real-data repeat: the same workload


def test_other_traces_keep_the_arithmetic_workload_and_options_win():
    assert real_workload(None, None) == RealWorkload("arithmetic", 16, 4, 16, 128, 1.0)
    assert real_workload("runs/x/lengths.jsonl", None).task == "arithmetic"
    assert real_workload("rhyming", "countdown").task == "countdown"  # --real-data wins over the trace
    given = real_workload("rhyming", None, prompts=4, slots=2, temperature=None)
    assert (given.task, given.prompts, given.slots, given.temperature) == ("repeat", 4, 2, 0.6)
    with pytest.raises(UserError, match="--real-data chess"):
        real_workload(None, "chess")


def test_recorded_trace_constant_names_the_shipped_file():
    assert pipe_real.RECORDED_TRACE.is_file() and pipe_real.RECORDED_TRACE.name == "repeat.jsonl"


def test_real_run_rolls_out_the_chosen_task(tmp_path):
    model = byte_model_dir(tmp_path / "model", 1024)
    real = pipe_real.run_real(str(model), num_prompts=2, num_generations=2, slots=2, max_tokens=8, repeats=1,
                              dtype="fp32", device="cpu", speculative="off", task="repeat")
    assert real["task"] == "repeat" and real["prompts"] == 2 and real["identical"] is True
    # the prompts are the task's: the byte tokenizer's prompt ids decode to the example's text
    from rhymerl.model.pretrained import load_pretrained
    _, tokenizer, _ = load_pretrained(str(model), "fp32", "cpu")
    ids = pipe_real.task_prompts(tokenizer, "repeat", 2)
    assert [tokenizer.decode(p).strip() for p in ids] == [e.prompt for e in builtin_examples("repeat", 2, 0)]


class _Pool:
    """A stand-in pool: each request's tokens name its request id and seed; `record` keeps what it is given."""

    def __init__(self):
        self.calls, self.recorded = [], []

    def rollout(self, groups, params):
        from types import SimpleNamespace
        self.calls.append(([r for g in groups for r in g.request_ids], params.seed))
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=[r, params.seed])
                                        for g in groups for r in g.request_ids])

    def record(self, prompt, responses):
        self.recorded.append((prompt, responses))


def test_history_epochs_record_each_epoch_with_its_own_draws():
    from rhymerl.rollout import RolloutGroup
    prompts = [[1, 2], [3]]

    def groups(tag):
        return [RolloutGroup(p, [f"{tag}-p{i}-g{g}" for g in range(2)]) for i, p in enumerate(prompts)]

    pool = _Pool()
    tokens = pipe_real.record_history(pool, groups, prompts, 2, 3, temperature=0.6, max_tokens=8, seed=5)
    # epoch 1 as a single epoch always was (tag e1, seed + 1000), then other tags and seeds
    assert [(ids[0], seed) for ids, seed in pool.calls] == [("e1-p0-g0", 1005), ("h2-p0-g0", 1007),
                                                           ("h3-p0-g0", 1008)]
    assert len(pool.recorded) == 6 and tokens == 3 * 4 * 2
    assert pool.recorded[1] == ([3], [["e1-p1-g0", 1005], ["e1-p1-g1", 1005]])  # each prompt its own siblings
    with pytest.raises(UserError, match="--real-history-epochs"):
        pipe_real.record_history(_Pool(), groups, prompts, 2, 0, temperature=0.6, max_tokens=8, seed=5)


def test_the_history_epochs_default_to_one_and_the_option_wins():
    assert real_workload("rhyming", None).history_epochs == 1 and real_workload(None, None).history_epochs == 1
    assert real_workload("rhyming", None, history_epochs=3).history_epochs == 3
