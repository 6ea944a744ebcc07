"""The command line: input errors name file, line and field; generate runs on the real model."""

import json

import pytest

from rhymerl.bench import spec_bench
from rhymerl.cli import main
from rhymerl.tasks.prompt_file import PromptFileError, read_prompt_file


def test_prompt_file_errors_name_file_and_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n\n{"prompt": 3}\n')
    with pytest.raises(PromptFileError, match=r"p.jsonl:3: field 'prompt'"):
        read_prompt_file(f)
    f.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(PromptFileError, match=r"p.jsonl:2: not valid JSON"):
        read_prompt_file(f)
    f.write_text('{"prompt": "a"}\n{"prompt": [{"role": "user", "content": "b"}]}\n')
    assert [r.prompt for r in read_prompt_file(f)] == ["a", [{"role": "user", "content": "b"}]]


def test_unknown_model_is_a_clear_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("RHYMERL_CACHE", str(tmp_path))
    assert main(["generate", "--model", "no-such-model", "hi"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "built-in" in err


def test_invalid_sampling_value_is_a_clear_error(capsys):
    assert main(["generate", "--top-p", "1.5", "hi"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_bench_table_is_whole_when_piped(capsys):
    """capsys is not a terminal, like `rhymerl bench spec | tee log`: no header may be cut to 'tok…'."""
    row = dict(entropy=0.14, plain_tok_s=215.2, spec_tok_s=306.2, speedup=1.423, tail_speedup=1.853,
               accept_rate=0.584, tokens_per_forward=2.17, identity_rate_bf16=0.34)
    summary = dict(model="smollm2-135m", dtype="bf16", num_prompts=16, num_generations=8, slots=8, max_tokens=256,
                   temperatures={"0.3": row}, ceiling={"full": {"speedup": 1.436, "tokens_per_seq": 33}})
    spec_bench.print_table(summary)
    out = capsys.readouterr().out
    assert "…" not in out
    assert "plain tok/s" in out and "1.423x" in out
    assert "ceiling (full)" in out and "33 tokens per forward, would be 1.436x plain" in out


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "spec", "--help"])
    text = capsys.readouterr().out
    assert "(default: 32)" in text  # --slots
    assert "(default: None)" not in text


def test_generate_on_the_real_model(smollm2_dir, capsys, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "Say hello."}) + "\n" +
                 json.dumps({"prompt": [{"role": "user", "content": "Count to three."}]}) + "\n")
    assert main(["generate", "--file", str(f), "--max-tokens", "6", "--temperature", "0", "--json",
                 "--dtype", "fp32"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(rows) == 2
    assert all(r["finish_reason"] in ("stop", "length") and 1 <= len(r["token_ids"]) <= 6 for r in rows)
