"""Every fenced code block of README.md and docs/ runs, as a reader would run it.

A block's language says what it is:

- ``python``: a program, run in a fresh interpreter (top-level ``await`` allowed, as in
  a notebook cell: then the cell runs under ``asyncio.run``);
- ``bash``: commands, run by ``bash -euo pipefail`` with the venv's ``amesh`` on PATH;
- ``text``, ``yaml``, ``toml``, ``json``, ``ini``: not code, never run.

An HTML comment on the line before a block changes that:

- ``<!-- docs-test: skip REASON -->``: the block cannot run here (another machine, a
  cluster manager, the test suite itself); the reason is required;
- ``<!-- docs-test: continue -->``: the block goes on from the previous block of its
  file in the same language that is not skipped, as the next cell of a notebook does:
  the chain runs in one interpreter, cell after cell.

Each program runs in its own temporary directory (also its ``HOME``, ``TMPDIR`` and
``AMESH_STATE_DIR``) under a wrapper that is a child subreaper: whatever the program
leaves running is an orphan of the wrapper, reported and killed, and fails the test.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUNNABLE = {"python", "bash"}
NOT_CODE = {"text", "yaml", "toml", "json", "ini"}
#: seconds one block (or chain) may run, and the seconds its leftovers get to exit
BLOCK_TIMEOUT = 90
EXIT_GRACE = 10

_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<verb>skip|continue)\b(?P<rest>.*?)-->\s*$")


@dataclass
class Block:
    """One fenced block, or a chain of blocks joined by ``continue`` markers."""

    path: Path
    line: int
    lang: str
    cells: list[str]
    skip: str | None = None
    lines: list[int] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _blocks_of(path: Path) -> list[tuple[int, str, str, str | None, str | None]]:
    """(line, language, code, marker verb, marker text) of each fenced block."""
    lines = path.read_text().splitlines()
    out = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, start = m["indent"], i
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        marker = _MARKER.match(lines[start - 1]) if start > 0 else None
        verb = marker["verb"] if marker else None
        text = marker["rest"].strip() if marker else None
        out.append((start + 1, m["lang"], "\n".join(body) + "\n", verb, text))
        i += 1
    return out


def collect() -> list[Block]:
    """Every block of the docs, chains joined."""
    blocks: list[Block] = []
    for path in DOC_FILES:
        previous: dict[str, Block] = {}  # the last block run, per language
        for line, lang, code, verb, text in _blocks_of(path):
            if verb == "continue":
                assert lang in previous, f"{path}:{line}: 'continue' needs a previous {lang} block"
                previous[lang].cells.append(code)
                previous[lang].lines.append(line)
                continue
            block = Block(path, line, lang, [code], text if verb == "skip" else None, [line])
            blocks.append(block)
            if block.skip is None:
                previous[lang] = block
    return blocks


BLOCKS = collect()

#: the wrapper: a child subreaper that runs one program and then waits (EXIT_GRACE
#: at most) for whatever it left behind to exit, kills and names what did not
WRAPPER = """
import ctypes, os, signal, subprocess, sys, time
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
rc = subprocess.call(sys.argv[2:])
def children():
    kids = set()
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/children") as f:
            kids.update(int(p) for p in f.read().split())
    return kids
deadline = time.monotonic() + float(sys.argv[1])
while children() and time.monotonic() < deadline:
    try:
        os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        break
    time.sleep(0.05)
left = children()
for pid in left:
    cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
    print(f"LEFT RUNNING: pid {pid}: {cmd}", file=sys.stderr)
    os.kill(pid, signal.SIGKILL)
sys.exit(rc if not left else 99)
"""

#: runs the cells of a python block, in order, as __main__ (so its classes travel by
#: value); a cell with top-level await runs under asyncio.run
RUNNER = """
import ast as _ast, asyncio as _asyncio, sys as _sys
for _cell in _sys.argv[1:]:
    __file__ = _cell
    with open(_cell) as _f:
        _code = compile(_f.read(), _cell, "exec", flags=_ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    _result = eval(_code, globals())
    if _asyncio.iscoroutine(_result):
        _asyncio.run(_result)
"""


def _command(block: Block, tmp: Path) -> list[str]:
    if block.lang == "python":
        cells = []
        for line, code in zip(block.lines, block.cells):
            cell = tmp / f"{block.path.stem}_{line}.py"
            cell.write_text(code)
            cells.append(str(cell))
        return [sys.executable, "-c", RUNNER, *cells]
    return ["bash", "-euo", "pipefail", "-c", "".join(block.cells)]


def _environment(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)
    env.update(
        HOME=str(tmp),
        TMPDIR=str(tmp),
        AMESH_STATE_DIR=str(tmp / "amesh-state"),
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
    )
    return env


@pytest.mark.parametrize(
    "block", [b for b in BLOCKS if b.lang in RUNNABLE and b.skip is None], ids=lambda b: b.id
)
@pytest.mark.timeout(BLOCK_TIMEOUT + EXIT_GRACE + 20)
def test_block_runs(block: Block, tmp_path: Path) -> None:
    wrapped = [sys.executable, "-c", WRAPPER, str(EXIT_GRACE), *_command(block, tmp_path)]
    proc = subprocess.Popen(
        wrapped,
        cwd=tmp_path,
        env=_environment(tmp_path),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=BLOCK_TIMEOUT + EXIT_GRACE)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{block.id} ran past {BLOCK_TIMEOUT} s:\n{out}")
    assert "LEFT RUNNING" not in out, f"{block.id} left processes running:\n{out}"
    assert proc.returncode == 0, f"{block.id} failed (exit {proc.returncode}):\n{out}"


def test_every_block_declares_what_it_is() -> None:
    unknown = [b.id for b in BLOCKS if b.lang not in RUNNABLE | NOT_CODE]
    assert not unknown, f"blocks without a known language: {unknown}"
    reasonless = [b.id for b in BLOCKS if b.skip == ""]
    assert not reasonless, f"skip markers without a reason: {reasonless}"


def test_markers_are_well_formed() -> None:
    for path in DOC_FILES:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "docs-test" in line:
                assert _MARKER.match(line), f"{path.relative_to(ROOT)}:{n}: bad marker {line!r}"
