"""`training_process.train_in_process`: a run in a child process, and a failed one's error quoting its stderr."""

import pytest

from rhymerl.bench.training_process import train_in_process


def test_a_failed_run_raises_with_the_end_of_its_stderr(tmp_path):
    with pytest.raises(RuntimeError) as e:
        train_in_process(["rollout.no_such_key=1"], tmp_path / "side")
    message = str(e.value)
    assert "exited with 2" in message and "rollout.no_such_key" in message  # the child's one-line error, quoted
    assert (tmp_path / "side.log").exists() and not (tmp_path / "side").exists()
