"""Mark the stale tables of docs/benchmarks.md by rule, or check that they are marked.

The rule (written on the page too): a table is stale once a commit after the one it was measured at changes
code that its command runs. The code a command runs is the source files of its entry module (below) and of
every rhymerl module that imports, directly or through others (found from the `import` statements, those
inside functions included), plus the C++ kernels where the CPU backend's loader is among them; the files
only the other kind of device runs are left out (on a CPU machine the CUDA graph backend, on a GPU the CPU
kernels). "Later" is `git log MEASURED..HEAD`: a table measured at two commits counts from the older one of
those in HEAD's history (a heading may name a commit from before a rebase beside its rebased one).

    python scripts/stale_tables.py          # list each table, exit 1 where its mark disagrees with the rule
    python scripts/stale_tables.py --write  # put the marks right (then commit the page)

tests/test_docs_claims.py runs the check, so a commit that changes measured code without marking the page
fails the suite until this script is run with --write.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "benchmarks.md"
SRC = ROOT / "src"
MARK = " (stale)"

# The module each command's section of the page runs (or the modules, where its tables run several), by the
# command in its `## ` heading.
ENTRY = {
    "rhymerl bench engine": "rhymerl.bench.engine_bench",
    "rhymerl bench matmul": "rhymerl.bench.matmul_bench",
    "rhymerl bench spec": "rhymerl.bench.spec_bench",
    "rhymerl train": "rhymerl.commands.train",
    "rhymerl bench pipe": "rhymerl.bench.pipe_bench",
    "rhymerl bench workers": "rhymerl.bench.workers_bench",
    # with `--compare history|stream` the section's tables run history_bench instead (rhymerl.commands.bench)
    "rhymerl bench e2e": ("rhymerl.bench.e2e_bench", "rhymerl.bench.history_bench"),
    "rhymerl bench update": "rhymerl.bench.update_bench",
}
GPU_MACHINES = ("H100", "H200")
# Files only one kind of device runs (imported everywhere, executed only there).
GPU_ONLY = ("rhymerl/engine/backends/cuda.py", "rhymerl/engine/backends/static_step.py",
            "rhymerl/engine/device_verification.py")
CPU_ONLY = ("rhymerl/engine/backends/cpu.py", "rhymerl/engine/backends/cpu_attention.py",
            "rhymerl/engine/backends/cpu_weights.py", "rhymerl/engine/backends/native.py",
            "rhymerl/engine/backends/tile_cache.py", "rhymerl/engine/backends/kernels")

_HEADING = re.compile(r"^### (?P<machine>[^,]+),.*?\bcommits? (?P<commits>[0-9a-f]{7,40}(?:(?:,| and) [0-9a-f]{7,40})*)")


def _module_file(name: str) -> Path | None:
    base = SRC / Path(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imports(path: Path, name: str) -> set[str]:
    """The rhymerl modules `path` (module `name`) imports, anywhere in the file."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}  # `from pkg import module`
    return {m for m in out if m.split(".")[0] == "rhymerl"}


def command_files(entry: str | tuple[str, ...], gpu: bool) -> list[str]:
    """The source files (relative to src/) that command `entry` (its module, or the modules its section's
    tables run) runs, by the rule in the module doc."""
    seen, todo, files = set(), [entry] if isinstance(entry, str) else list(entry), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__ too
            path = _module_file(".".join(parts[:i]))
            if path is not None and path not in files:
                files.add(path)
                todo.extend(_imports(path, ".".join(parts[:i])))
    rel = {str(p.relative_to(SRC)) for p in files}
    if "rhymerl/engine/backends/native.py" in rel:
        rel.add("rhymerl/engine/backends/kernels")
    skip = CPU_ONLY if gpu else GPU_ONLY
    return sorted(f for f in rel if f not in skip)


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def _in_history(commit: str) -> bool:
    return subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=ROOT,
                          capture_output=True).returncode == 0


def later_commits(commits: list[str], files: list[str]) -> list[str]:
    """Commits after the oldest of `commits` (up to HEAD) that change any of `files` (relative to src/). A
    commit outside HEAD's history (a branch's before it was rebased, the heading naming both) is not counted
    from; where none of them is in it, the table cannot be shown current: the first of them stands for all."""
    known = [c for c in commits if _in_history(c)]
    if not known:
        return commits[:1]
    oldest = min(known, key=lambda c: int(_git("rev-list", "--count", c).strip()))
    return _git("log", "--format=%h", f"{oldest}..HEAD", "--", *(f"src/{f}" for f in files)).split()


def tables(text: str) -> list[tuple[int, str, str, list[str]]]:
    """(line index, command, machine, commits) of each table heading of the page that names a commit."""
    out, command = [], None
    for i, line in enumerate(text.splitlines()):
        if line.startswith("## "):
            command = next((c for c in ENTRY if f"`{c}`" in line), None)
        m = _HEADING.match(line)
        if m and command:
            # every hash from "commit" on: "commits A and B", "commit A (B after a rebase)"
            out.append((i, command, m["machine"].strip(), re.findall(r"\b[0-9a-f]{7,40}\b", line[m.start("commits"):])))
    return out


def check(write: bool = False) -> list[str]:
    """Each table whose mark disagrees with the rule, as a line; with `write`, the page put right."""
    lines = PAGE.read_text(encoding="utf-8").splitlines()
    wrong = []
    for i, command, machine, commits in tables("\n".join(lines)):
        files = command_files(ENTRY[command], gpu=machine.startswith(GPU_MACHINES))
        later = later_commits(commits, files)
        marked = lines[i].endswith(MARK)
        if bool(later) != marked:
            wrong.append(f"{PAGE.name}:{i + 1}: {lines[i]!r} " +
                         (f"is stale ({len(later)} later commits change code it ran, e.g. {later[-1]}) but not "
                          f"marked" if later else "is marked stale, but no later commit changes code it ran"))
            lines[i] = lines[i] + MARK if later else lines[i].removesuffix(MARK)
    if write and wrong:
        PAGE.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return wrong


if __name__ == "__main__":
    problems = check(write="--write" in sys.argv[1:])
    for line in problems:
        print(line)
    if problems and "--write" not in sys.argv[1:]:
        print("run: python scripts/stale_tables.py --write", file=sys.stderr)
        sys.exit(1)
