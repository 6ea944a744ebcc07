"""bench spec --history-from: the run's history (with its rewards) from the checkpoint's history.json alone."""

import json
import pickle

import pytest
from transformers import AutoTokenizer

from rhymerl.bench.spec_inputs import history_of_run, load_prompts
from rhymerl.history import HistoryStore


class Payload:
    """Unpickling this writes a file: a trainer.pt made of it shows whether anything unpickled it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def checkpoint(run_dir, step: int, history: HistoryStore | None, marker):
    ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text(json.dumps({"step": step}))
    (ckpt / "trainer.pt").write_bytes(pickle.dumps(Payload(str(marker))))
    if history is not None:
        history.save(ckpt / "history.json")
    return ckpt


def test_the_history_comes_with_its_rewards_and_nothing_is_unpickled(tmp_path):
    store = HistoryStore()
    store.record_rollout([1, 2, 3], [[4, 5], [4, 6]], [0.0, 1.0])
    marker = tmp_path / "unpickled"
    checkpoint(tmp_path, 1, HistoryStore(), marker)
    ckpt = checkpoint(tmp_path, 2, store, marker)
    history, found = history_of_run(tmp_path)
    assert found == ckpt  # the latest
    assert [r.rewards for r in history.rollouts([1, 2, 3])] == [[0.0, 1.0]]
    assert not marker.exists()


def test_missing_or_bad_history_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        history_of_run(tmp_path)
    ckpt = checkpoint(tmp_path, 1, None, tmp_path / "unpickled")
    with pytest.raises(FileNotFoundError, match="has no history.json"):
        history_of_run(tmp_path)
    (ckpt / "history.json").write_text('{"truncated": ')
    with pytest.raises(ValueError, match=r"history.json is not a history store \(JSONDecodeError"):
        history_of_run(tmp_path)


def test_prompts_of_a_builtin_task_or_a_prompt_file(smollm2_dir, tmp_path):
    """--data: arithmetic by default, countdown by name, or a JSONL file's first n prompts (held-out text the
    cost model was never tuned on, for the never-slower floor)."""
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    text = [tok.decode(p) for p in load_prompts(tok, "countdown", 3, seed=0)]
    assert len(text) == 3 and all("write an equation that equals" in t for t in text)
    assert load_prompts(tok, None, 4, 0) == load_prompts(tok, "arithmetic", 4, 0) != load_prompts(tok, "countdown", 4, 0)
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "Why is the sea salty?"}\n{"question": "Name a prime above 100."}\n'
                    '{"prompt": "unused"}\n')
    assert [tok.decode(p).count("Why is the sea salty?") for p in load_prompts(tok, str(path), 2, 0)] == [1, 0]
