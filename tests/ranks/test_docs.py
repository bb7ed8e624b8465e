"""Every ```python block in README.md and docs/*.md runs, so the docs cannot drift from the code.

A block runs in a fresh namespace, in a temporary folder, with the repository root importable
(``examples.*``). A marker on the line before a block changes that:

- ``<!-- doc-test: setup NAME -->``: the namespace starts as ``examples/doc_setup.py``'s ``NAME()``
  (a small GPT, its batch, a one-device mesh; ``trained`` adds ``pmodel`` and ``opt``);
- ``<!-- doc-test: ranks N setup NAME -->``: the block runs on N ranks (slow suite);
- ``<!-- doc-test: skip (reason) -->``: the block is not run; the reason is listed
  (``test_skipped_blocks_say_why``).

An unmarked block that fails fails the test. Every message ``docs/troubleshooting.md`` quotes is
checked against the string literals of autopar's source (``test_troubleshooting_messages_exist``).
"""
from __future__ import annotations

import ast
import os
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import run_ranks

ROOT = Path(__file__).resolve().parents[2]
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```python\s*$")
_MARKER = re.compile(r"^\s*<!--\s*doc-test:\s*(?P<body>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class DocBlock:
    path: str          # relative to the repository root
    line: int          # 1-based line of the opening fence
    code: str
    setup: str | None  # a name in examples/doc_setup.SETUPS
    ranks: int         # 0: in this process, else that many ranks
    skip: str | None   # the reason, when not run

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def _parse_marker(body: str, where: str) -> dict:
    skip = re.fullmatch(r"skip\s*\((?P<why>.+)\)", body)
    if skip:
        return {"skip": skip.group("why")}
    m = re.fullmatch(r"(?:ranks\s+(?P<n>\d+)\s*)?(?:setup\s+(?P<setup>\w+))?", body)
    if not m or not body:
        raise ValueError(f"{where}: unknown doc-test marker {body!r}; write 'skip (reason)', "
                         f"'setup NAME' or 'ranks N setup NAME'")
    return {"setup": m.group("setup"), "ranks": int(m.group("n") or 0)}


def doc_blocks(root: Path = ROOT) -> list[DocBlock]:
    blocks = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        lines = path.read_text().splitlines()
        rel = str(path.relative_to(root))
        i = 0
        while i < len(lines):
            fence = _FENCE.match(lines[i])
            if not fence:
                i += 1
                continue
            start, indent = i, fence.group("indent")
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                i += 1
            code = textwrap.dedent("\n".join(lines[start + 1:i]))
            prev = start - 1
            while prev >= 0 and not lines[prev].strip():
                prev -= 1
            marker = _MARKER.match(lines[prev]) if prev >= 0 else None
            opts = _parse_marker(marker.group("body"), f"{rel}:{start + 1}") if marker else {}
            blocks.append(DocBlock(rel, start + 1, code, opts.get("setup"), opts.get("ranks", 0),
                                   opts.get("skip")))
            i += 1
    return blocks


def _namespace(setup: str | None) -> dict:
    if setup is None:
        return {"__name__": "__doc_block__"}
    from examples.doc_setup import SETUPS

    if setup not in SETUPS:
        raise ValueError(f"doc-test setup {setup!r} is not in examples/doc_setup.SETUPS ({sorted(SETUPS)})")
    return {"__name__": "__doc_block__", **SETUPS[setup]()}


def run_block(block: DocBlock) -> dict:
    ns = _namespace(block.setup)
    exec(compile(block.code, block.where, "exec"), ns)
    return ns


def _run_on_rank(rank: int, block: DocBlock, folder: str) -> None:
    os.chdir(folder)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    run_block(block)


BLOCKS = doc_blocks()
_LOCAL = [b for b in BLOCKS if b.skip is None and b.ranks == 0]
_RANKED = [b for b in BLOCKS if b.skip is None and b.ranks > 0]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    return tmp_path


@pytest.mark.parametrize("block", _LOCAL, ids=[b.where for b in _LOCAL])
def test_doc_block_runs(block, in_tmp):
    run_block(block)


@pytest.mark.slow
@pytest.mark.parametrize("block", _RANKED, ids=[b.where for b in _RANKED])
def test_doc_block_runs_on_ranks(block, in_tmp):
    run_ranks(block.ranks, _run_on_rank, block, str(in_tmp))


def test_skipped_blocks_say_why(capsys):
    skipped = [b for b in BLOCKS if b.skip is not None]
    assert all(b.skip.strip() for b in skipped)
    with capsys.disabled():
        for b in skipped:
            print(f"\ndoc block {b.where} not run: {b.skip}", end="")
    assert BLOCKS, "no ```python block found in README.md or docs/"


def test_markers_are_parsed(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("<!-- doc-test: skip (needs 8 GPUs) -->\n```python\na = 1\n```\n")
    (tmp_path / "docs" / "x.md").write_text("- item\n\n  <!-- doc-test: ranks 2 setup gpt -->\n  ```python\n"
                                           "  b = 2\n  ```\n\n```python\nc = 3\n```\n")
    got = doc_blocks(tmp_path)
    assert [(b.path, b.line, b.code, b.setup, b.ranks, b.skip) for b in got] == [
        ("README.md", 2, "a = 1", None, 0, "needs 8 GPUs"),
        ("docs/x.md", 4, "b = 2", "gpt", 2, None),
        ("docs/x.md", 8, "c = 3", None, 0, None)]


def test_unknown_marker_is_an_error_naming_the_block(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("<!-- doc-test: skipp -->\n```python\na = 1\n```\n")
    with pytest.raises(ValueError, match=r"README.md:2: unknown doc-test marker 'skipp'"):
        doc_blocks(tmp_path)


def _source_literals() -> list[str]:
    """Every string literal in autopar/, f-strings as their literal parts (implicit concatenation joined)."""
    out = []
    for path in (ROOT / "autopar").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append(node.value)
    return out


def troubleshooting_messages(text: str) -> list[tuple[int, list[str]]]:
    """(line, pieces) per table row of the page: the literal pieces of the backticked messages in its
    first cell (``…`` marks a part that varies; exception class names are not messages)."""
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.startswith("| `"):
            continue
        cell = line.split(" | ")[0]
        spans = [s for s in re.findall(r"`([^`]+)`", cell) if not re.fullmatch(r"\w+Error", s)]
        rows.append((i, [piece.strip() for s in spans for piece in s.split("…") if piece.strip()]))
    return rows


def test_troubleshooting_messages_exist():
    rows = troubleshooting_messages((ROOT / "docs" / "troubleshooting.md").read_text())
    assert len(rows) >= 40
    literals = _source_literals()
    stale = []
    for line, pieces in rows:
        assert pieces and max(map(len, pieces)) >= 8, f"docs/troubleshooting.md:{line}: quote more of the message"
        stale += [f"docs/troubleshooting.md:{line}: {p!r}" for p in pieces if not any(p in s for s in literals)]
    assert not stale, "messages no longer in autopar's source:\n" + "\n".join(stale)


def test_a_changed_message_is_caught():
    rows = troubleshooting_messages("| `no plan fits memory on …: the smallest plan` | x | y |\n")
    assert rows == [(1, ["no plan fits memory on", ": the smallest plan"])]
    assert not any(": the smallest plan" in s for s in _source_literals())
