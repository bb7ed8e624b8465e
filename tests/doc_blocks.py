"""Every ```python block in README.md and docs/*.md runs, so the docs cannot drift from the code.

A block runs in a fresh namespace, in a temporary folder, with the repository root importable
(``examples.*``). A marker on the line before a block changes that:

- ``<!-- doc-test: setup NAME -->``: the namespace starts as ``examples/doc_setup.py``'s ``NAME()``
  (a small GPT, its batch, a one-device mesh; ``trained`` adds ``pmodel`` and ``opt``);
- ``<!-- doc-test: ranks N setup NAME -->``: the block runs on N ranks (slow suite);
- ``<!-- doc-test: skip (reason) -->``: the block is not run; the reason is listed
  (``tests/unit/test_docs_blocks.py::test_skipped_blocks_say_why``).

An unmarked block that fails fails the test. Every message ``docs/troubleshooting.md`` quotes is
checked against the string literals of autopar's source (``tests/unit/test_docs_blocks.py``).
"""
from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
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


BLOCKS = doc_blocks()


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    return tmp_path
