"""Every documented example runs as written.

Each ```python block of README.md and docs/*.md is written to a file of its own
(blank lines in front, so that a traceback's line numbers are the document's) and
run standalone in a process of its own, in a fresh empty working directory, with
the ``sys.path`` of a fresh interpreter: nothing defined in an earlier block is
visible to a later one, as for a reader who copies one block into a new file. The
process is forked from an interpreter that has imported numpy, torch, zarr and
mmbuffer (``tests/warm.py``), so a block's ``import`` binds names without loading
them again; what it does not import is not defined. A block whose fence has
``<!-- illustration -->`` on the line just above it is not meant to run (a signature
listing, say) and is skipped; no README block may be one.

The test asserts the exit status is 0 and that the block ran to its last line (the
runner prints a marker after it returns); a failure shows the block's stderr. Blocks
that start servers (the S3 block's loopback moto server, the Ray block's cluster) or
train a model are marked slow; they still run in CI. The timeout is generous and
only reports a hang: it is not a speed requirement.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest
import warm

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ILLUSTRATION = "<!-- illustration -->"
HANG_S = 900  # only reports a hang; the slowest block takes well under a minute on an idle 2-core VM
MARKER = "__documented_example_ran_to_its_end__"
SLOW = ("ray", "moto", "torchrl.collectors")  # a block that imports one of these starts a server or trains
MAX_OUTPUT_LINES = 20  # a documented example does not flood the terminal (server logs, progress bars)


class Block(NamedTuple):
    doc: Path
    line: int  # 1-based line number of the opening fence
    source: str  # the block's code, preceded by blank lines up to its place in the document
    illustration: bool


def extract_blocks(doc: Path) -> list[Block]:
    """The ```python blocks of ``doc``, in order."""
    lines = doc.read_text().splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        if re.fullmatch(r"```(python|py)\s*", lines[i].strip()):
            start = i
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            if j == len(lines):
                raise AssertionError(f"{doc.name}:{start + 1}: a ```python fence is never closed")
            code = "\n" * (start + 1) + "\n".join(lines[start + 1 : j]) + "\n"
            illustration = start > 0 and lines[start - 1].strip() == ILLUSTRATION
            blocks.append(Block(doc, start + 1, code, illustration))
            i = j + 1
        else:
            i += 1
    return blocks


def _params():
    for doc in DOCUMENTS:
        for block in extract_blocks(doc):
            marks = []
            if any(re.search(rf"^\s*(import|from) {re.escape(m)}\b", block.source, re.MULTILINE) for m in SLOW):
                marks.append(pytest.mark.slow)
            yield pytest.param(block, id=f"{doc.relative_to(REPO)}:{block.line}", marks=marks)


def test_the_extractor_finds_the_blocks_and_their_lines():
    """The extraction itself: the blocks found are the ones in the documents, at their lines."""
    readme = extract_blocks(REPO / "README.md")
    assert len(readme) >= 7, [b.line for b in readme]
    text = (REPO / "README.md").read_text().splitlines()
    for b in readme:
        assert re.fullmatch(r"```(python|py)\s*", text[b.line - 1].strip())
        body = b.source.splitlines()
        assert len(body) > b.line and not any(body[: b.line])  # padding keeps the document's line numbers
        assert body[b.line] == text[b.line]  # the first line of code is the document's
    assert not [b.line for b in readme if b.illustration], "README blocks must all run"


def test_an_illustration_comment_marks_only_the_next_block(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("text\n<!-- illustration -->\n```python\nundefined_name\n```\n\n```python\nx = 1\n```\n")
    blocks = extract_blocks(doc)
    assert [(b.line, b.illustration) for b in blocks] == [(3, True), (7, False)]
    assert blocks[1].source.splitlines()[7] == "x = 1"


@pytest.mark.parametrize("block", list(_params()))
def test_documented_example_runs_as_written(block, tmp_path):
    if block.illustration:
        pytest.skip(f"{block.doc.name}:{block.line} is marked {ILLUSTRATION}")
    name = f"{block.doc.stem}_md_line{block.line}.py"
    script = tmp_path / name
    script.write_text(block.source)
    # run the file as __main__ (as `python file.py` would), then print the marker
    work = tmp_path / "cwd"
    work.mkdir()
    env = warm.repo_env()
    env.pop("PYTHONWARNINGS", None)
    try:
        proc = warm.run_file(script, cwd=work, env=env, timeout=HANG_S, then=f"print({MARKER!r})")
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{block.doc.name}:{block.line} hung: no exit after {HANG_S} s (a limit that only reports a "
                    f"hang, not a speed requirement)\nstdout:\n{e.stdout}\nstderr:\n{e.stderr}")
    where = f"{block.doc.relative_to(REPO)}, block at line {block.line} (run as {name}; its line numbers are the document's)"
    assert proc.returncode == 0, f"{where} exited with {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.stdout.rstrip().endswith(MARKER), f"{where} did not run to its end\nstdout:\n{proc.stdout}"
    output = (proc.stdout + proc.stderr).splitlines()
    assert len(output) <= MAX_OUTPUT_LINES, f"{where} printed {len(output)} lines:\n" + "\n".join(output[:60])
