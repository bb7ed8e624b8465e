"""Every ```python block in README.md and docs/*.md runs, so the docs cannot drift from the code: the blocks that
run in this process, the marker syntax, and the troubleshooting messages (``tests/doc_blocks.py`` finds the blocks and
says what the markers mean; the blocks marked ``ranks N`` run in tests/ranks/test_docs.py)."""
from __future__ import annotations

import ast
import re

import pytest
from doc_blocks import BLOCKS, ROOT, doc_blocks, in_tmp, run_block


_LOCAL = [b for b in BLOCKS if b.skip is None and b.ranks == 0]


@pytest.mark.parametrize("block", _LOCAL, ids=[b.where for b in _LOCAL])
def test_doc_block_runs(block, in_tmp):
    run_block(block)


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
