"""Dataset files in GSM8K, verl and simple layouts; built-in examples; malformed rows named by file:row:field."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rhymerl.data.dataset import DatasetError, Example, builtin_examples, read_dataset
from rhymerl.tasks import arithmetic
from rhymerl.tasks.countdown import read_ground_truth


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_builtin_examples():
    examples = builtin_examples("arithmetic", 5, seed=3)
    problems = arithmetic.make_problems(5, seed=3)
    assert [e.ground_truth for e in examples] == [str(p.answer) for p in problems]
    assert examples[0].prompt == arithmetic.prompt_text(problems[0])
    assert examples[2].source == "arithmetic#2" and examples[2].data_source == "arithmetic"
    assert builtin_examples("arithmetic", 5, seed=3) == examples

    countdown = builtin_examples("countdown", 4, seed=0)
    assert all(e.data_source == "countdown" for e in countdown)
    numbers, target = read_ground_truth(countdown[0].ground_truth)
    assert str(target) in countdown[0].prompt and len(numbers) in (3, 4)
    assert len(set(examples + countdown)) == 9  # examples are hashable

    with pytest.raises(ValueError, match="arithmetic, countdown"):
        builtin_examples("chess", 3, seed=0)


def test_gsm8k_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", [
        {"question": "Natalia sold 48 clips. How many?", "answer": "She sold 48+24 = <<48+24=72>>72\n#### 72"},
        "",
        {"question": "How much?", "answer": "Lots.\n#### 1,000"},
    ])
    data = read_dataset(path)
    assert [e.ground_truth for e in data.examples] == ["72", "1000"]
    first = data.examples[0]
    assert first.prompt == f"Natalia sold 48 clips. How many?\n{arithmetic.INSTRUCTION}"
    assert first.data_source == "gsm8k" and first.source == f"{path}:1"
    assert data.examples[1].source == f"{path}:3"  # blank lines keep line numbering
    assert data.skipped == []


def test_verl_jsonl_and_messages(tmp_path):
    path = write_jsonl(tmp_path / "verl.jsonl", [
        {"data_source": "openai/gsm8k", "prompt": [{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": "2+2?"}],
         "reward_model": {"style": "rule", "ground_truth": "4"}, "extra_info": {"index": 0}},
        {"prompt": [{"role": "user", "content": "3*3?"}], "reward_model": {"ground_truth": 9}},
        {"prompt": [{"role": "user", "content": "half?"}], "reward_model": {"ground_truth": 0.5}},
        {"data_source": "countdown", "prompt": [{"role": "user", "content": "24 from 3 8?"}],
         "reward_model": {"ground_truth": {"target": 24, "numbers": [3, 8]}}},
    ])
    examples = read_dataset(path).examples
    first = examples[0]
    assert first.prompt == (("system", "Be brief."), ("user", "2+2?"))
    assert first.messages() == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert (first.ground_truth, first.data_source) == ("4", "openai/gsm8k")
    assert (examples[1].ground_truth, examples[1].data_source) == ("9", "verl")
    assert examples[2].ground_truth == "0.5"
    assert read_ground_truth(examples[3].ground_truth) == ((3, 8), 24)
    hash(first)


def test_verl_parquet(tmp_path):
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    table = pa.table({
        "data_source": ["openai/gsm8k", "openai/gsm8k"],
        "prompt": pa.array([[{"role": "user", "content": "1+1?"}],
                            [{"role": "system", "content": "s"}, {"role": "user", "content": "2+5?"}]],
                           type=pa.list_(message)),
        "ability": ["math", "math"],
        "reward_model": pa.array([{"style": "rule", "ground_truth": "2"}, {"style": "rule", "ground_truth": "7"}]),
    })
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)
    examples = read_dataset(path).examples
    assert [e.ground_truth for e in examples] == ["2", "7"]
    assert examples[1].prompt == (("system", "s"), ("user", "2+5?"))
    assert examples[1].source == f"{path}:2" and examples[1].data_source == "openai/gsm8k"


def test_parquet_malformed_row(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["ok?", "fine?"], "answer": ["3", None]}), path)
    with pytest.raises(DatasetError, match=r"bad\.parquet:2: field 'answer'"):
        read_dataset(path)


def test_simple_layout_and_json_array(tmp_path):
    path = write_jsonl(tmp_path / "simple.jsonl", [
        {"prompt": "What is 6*7?", "answer": "42"},
        {"prompt": "What is 6*8?", "ground_truth": 48, "data_source": "mine"},
        {"prompt": "Worked?", "answer": "6*9 = 54\n#### 54"},
    ])
    examples = read_dataset(path).examples
    assert [(e.prompt, e.ground_truth, e.data_source) for e in examples] == [
        ("What is 6*7?", "42", "math"), ("What is 6*8?", "48", "mine"), ("Worked?", "54", "math")]
    assert examples[0].messages() == [{"role": "user", "content": "What is 6*7?"}]

    array = tmp_path / "rows.json"
    array.write_text(json.dumps([{"prompt": "a?", "answer": "1"}, {"question": "b?", "answer": "#### 2"}]))
    assert [e.ground_truth for e in read_dataset(array).examples] == ["1", "2"]


@pytest.mark.parametrize("row, line, field", [
    ('{"question": "q", "answer": "72"}', 2, "answer"),              # GSM8K answer without ####
    ('{"question": 5, "answer": "#### 5"}', 2, "question"),
    ('{"question": "q"}', 2, "answer"),
    ('{"prompt": "p"}', 2, "reward_model"),                         # no ground truth at all
    ('{"prompt": [{"role": "user"}], "answer": "1"}', 2, "prompt"),  # message without content
    ('{"prompt": [], "answer": "1"}', 2, "prompt"),
    ('{"prompt": "p", "reward_model": {"style": "rule"}}', 2, "reward_model"),
    ('{"prompt": "p", "answer": ""}', 2, "answer"),
    ('{"prompt": "p", "answer": "1", "data_source": 3}', 2, "data_source"),
    ('{"text": "p"}', 2, "prompt"),
])
def test_malformed_row_names_file_row_and_field(tmp_path, row, line, field):
    path = write_jsonl(tmp_path / "data.jsonl", ['{"prompt": "fine", "answer": "1"}', row])
    with pytest.raises(DatasetError) as info:
        read_dataset(path)
    assert f"data.jsonl:{line}: field '{field}'" in str(info.value)


def test_bad_json_and_non_object_rows(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", ['{"prompt": "fine", "answer": "1"}', '{"prompt": ', "[1, 2]"])
    with pytest.raises(DatasetError, match=r"data\.jsonl:2: not valid JSON"):
        read_dataset(path)
    data = read_dataset(path, skip_malformed=True)
    assert len(data.examples) == 1 and len(data.skipped) == 2
    assert "data.jsonl:2:" in data.skipped[0] and "data.jsonl:3: expected an object" in data.skipped[1]


def test_skip_malformed_counts_rows(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", [
        {"question": "a", "answer": "#### 1"}, {"question": "b", "answer": "no marker"},
        {"question": "c", "answer": "#### 3"}, {"question": "d"}])
    data = read_dataset(path, skip_malformed=True)
    assert [e.ground_truth for e in data.examples] == ["1", "3"]
    assert len(data.skipped) == 2
    assert "gsm8k.jsonl:2: field 'answer'" in data.skipped[0] and "gsm8k.jsonl:4: field 'answer'" in data.skipped[1]


def test_file_level_errors(tmp_path):
    with pytest.raises(DatasetError, match="nowhere.jsonl: dataset file not found"):
        read_dataset(tmp_path / "nowhere.jsonl")
    csv = tmp_path / "data.csv"
    csv.write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match=r"data\.csv.*\.jsonl, \.json, \.parquet"):
        read_dataset(csv)
    empty = write_jsonl(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(DatasetError, match="empty.jsonl: no examples"):
        read_dataset(empty)
    bad = write_jsonl(tmp_path / "bad.jsonl", ['{"question": "q"}'])
    with pytest.raises(DatasetError, match="1 malformed rows skipped"):
        read_dataset(bad, skip_malformed=True)
    not_parquet = tmp_path / "junk.parquet"
    not_parquet.write_text("not parquet")
    with pytest.raises(DatasetError, match="junk.parquet: not a readable Parquet file"):
        read_dataset(not_parquet)


def test_example_rejects_list_prompt():
    with pytest.raises(TypeError, match="tuple of"):
        Example([{"role": "user", "content": "x"}], "1", "math", "here")
