"""The project speaks of itself: no tracker numbers, work-log entries, branch names or commit hashes.

Docs, docstrings and comments say what is true now and why; history belongs in commit messages. A
reader of a tracked file has no tracker or work log to look a reference up in, so none may appear.
"""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Each pattern names one kind of reference to the project's history.
FORBIDDEN = {
    "tracker number": re.compile(r"\b(issue|issues|session|sessions)\s+#?\d+", re.IGNORECASE),
    "work-log reference": re.compile(r"\bwork[- ]?log\b|\bthe task said\b", re.IGNORECASE),
    "branch name": re.compile(r"\b(this|on|from|of) branch\b|\bbranch `", re.IGNORECASE),
    "commit as a date": re.compile(r"\b(main at|commit|checked out at)\s+`?[0-9a-f]{7,40}\b"),
}
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", ".cfg", ".ini", ""}


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout")
    files = [ROOT / line for line in out.splitlines() if line]
    return [
        f
        for f in files
        if f.suffix in TEXT_SUFFIXES and f.is_file() and f.name != "constraints.txt"
    ]


def find_history_words(text: str) -> list[tuple[int, str, str]]:
    """(line number, kind, line) for every forbidden reference in `text`."""
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        for kind, pattern in FORBIDDEN.items():
            if pattern.search(line):
                hits.append((n, kind, line.strip()))
    return hits


def test_patterns_catch_what_they_name():
    caught = [
        "see issue 17 item 3",
        "Session 22: the sweep",
        "as the work log says",
        "since branch `zero1pad`",
        "measured on this branch",
        "main at 25520df",
    ]
    clean = [
        "a conditional as its larger branch",
        "the issue is memory",
        "DESIGN section 4",
        "sha256",
    ]
    assert all(find_history_words(s) for s in caught)
    assert not any(find_history_words(s) for s in clean)


def test_tracked_files_cite_no_history():
    me = Path(__file__).resolve()
    hits = [
        f"{f.relative_to(ROOT)}:{n}: {kind}: {line[:120]}"
        for f in tracked_files()
        if f.resolve() != me
        for n, kind, line in find_history_words(f.read_text(encoding="utf-8", errors="replace"))
    ]
    assert not hits, "history in tracked files (put it in commit messages):\n" + "\n".join(hits)
