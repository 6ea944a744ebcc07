"""Length traces: one line per step, trimmed to the checkpoint on resume, a torn last line skipped."""

from rhymerl.histopipe.trace import TRACE_FILE, TraceWriter, read_trace


def test_a_resumed_trace_has_every_step_once(tmp_path):
    trace = TraceWriter(tmp_path)
    for step in (1, 2, 3):
        trace.write(step, [("a", [step, 2 * step]), ("b", [7])])
    with open(tmp_path / TRACE_FILE, "a") as f:
        f.write('{"step": 4, "gro')  # killed while writing step 4
    assert [row["step"] for row in read_trace(tmp_path)] == [1, 2, 3]
    resumed = TraceWriter(tmp_path, resume_step=2)  # the checkpoint was taken after step 2
    resumed.write(3, [("a", [9])])
    rows = read_trace(tmp_path / TRACE_FILE)
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert rows[1]["groups"] == [{"prompt": "a", "lengths": [2, 4]}, {"prompt": "b", "lengths": [7]}]
    assert rows[2]["groups"] == [{"prompt": "a", "lengths": [9]}]
