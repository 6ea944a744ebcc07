"""What the README and docs/benchmarks.md claim, checked against each other and the repository (issue 37):
every figure the README quotes is on the benchmarks page, every test the README names exists, and the page's
stale marks follow its rule (`scripts/stale_tables.py`, which needs the git history)."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGE = ROOT / "docs" / "benchmarks.md"


def _prose(path: Path) -> str:
    """`path`'s text without fenced code blocks and inline code (commands and config values, not figures)."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def readme_figures(text: str) -> list[str]:
    """The measured figures a text quotes: a decimal number followed by x (a ratio), % or ' s' (seconds), or
    one of three decimals or more (a share, e.g. 0.789), arXiv ids aside."""
    text = re.sub(r"arXiv \d{4}\.\d{4,5}|arxiv\.org/abs/\d{4}\.\d{4,5}", "", text)
    pattern = r"(?<![\w.])[+-]?\d+\.\d+(?:[x%]| s\b)|(?<![\w.])\d+\.\d{3,}(?![\d.])"
    return [m.group().removesuffix(" s") for m in re.finditer(pattern, text)]


def test_the_figure_pattern_finds_figures_and_skips_settings():
    found = readme_figures(_prose_of("at batch 32: 5.60x, +4.4% a step, 8.85 s, 0.789 identical; `temperature=0.6`, "
                                     "arXiv 2508.18588, Python 3.10, (default 2.0)"))
    assert found == ["5.60x", "+4.4%", "8.85", "0.789"]


def _prose_of(text: str) -> str:
    return re.sub(r"`[^`\n]*`", "", text)


def test_every_figure_the_readme_quotes_is_on_the_benchmarks_page():
    figures = readme_figures(_prose(README))
    assert len(figures) >= 10  # the headline figures are there to check
    page = PAGE.read_text(encoding="utf-8")
    missing = [f for f in figures if not re.search(rf"(?<![\d.]){re.escape(f)}(?!\d)", page)]
    assert not missing, f"README figures not on docs/benchmarks.md: {missing}"


def test_every_test_the_readme_names_exists():
    text = README.read_text(encoding="utf-8")
    named = re.findall(r"(tests/[\w/]+\.py)((?:,? ?::\w+)*)", text)
    assert named
    for path, tests in named:
        source = (ROOT / path).read_text(encoding="utf-8")
        for name in re.findall(r"::(\w+)", tests):
            assert f"def {name}(" in source, f"README names {path}::{name}, which does not exist"


def _stale_tables():
    spec = importlib.util.spec_from_file_location("stale_tables", ROOT / "scripts" / "stale_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stale_marks_follow_the_rule():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git history")
    module = _stale_tables()
    tables = module.tables(PAGE.read_text(encoding="utf-8"))
    assert len(tables) >= 10  # every command's tables are found by their headings
    try:
        wrong = module.check()
    except subprocess.CalledProcessError as e:  # a shallow clone lacks the measured commits
        pytest.skip(f"the measured commits are not in this clone's history ({e.stderr.strip()[:100]})")
    assert not wrong, "\n".join(wrong) + "\nrun: python scripts/stale_tables.py --write"


def test_the_rule_follows_imports_and_leaves_out_the_other_devices_files():
    module = _stale_tables()
    cpu = module.command_files("rhymerl.bench.spec_bench", gpu=False)
    gpu = module.command_files("rhymerl.bench.spec_bench", gpu=True)
    for f in ("rhymerl/bench/spec_bench.py", "rhymerl/histospec/verify.py", "rhymerl/engine/engine.py"):
        assert f in cpu and f in gpu  # imported through others
    assert "rhymerl/engine/backends/kernels" in cpu and "rhymerl/engine/backends/kernels" not in gpu
    assert "rhymerl/engine/backends/cuda.py" in gpu and "rhymerl/engine/backends/cuda.py" not in cpu
    assert "rhymerl/rl/loop.py" not in cpu  # bench spec runs no training
    assert "rhymerl/rl/loop.py" in module.command_files("rhymerl.commands.train", gpu=False)
