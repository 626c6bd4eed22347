"""Every Python block in README.md and docs/*.md runs, so an example that rots fails the suite.

The blocks of one page run in order in one namespace, as a reader would paste them. Markers in
an HTML comment (invisible on the rendered page):

* ``<!-- docs-test: skip: REASON -->`` on the line before a block: the block is reported as
  skipped with REASON (say what it needs that the suite's CPU lacks), never left out silently;
* ``<!-- docs-test: setup`` ... ``-->``: Python run before the page's first block (tiny shapes
  for the names a page's API tour uses, such as ``params`` or ``loss``);
* ``<!-- docs-test: devices=N -->`` anywhere on a page: its blocks run in a subprocess with N
  CPU devices.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

from tests.conftest import REPO

PAGES = ["README.md"] + sorted(
    os.path.join("docs", name) for name in os.listdir(os.path.join(REPO, "docs")) if name.endswith(".md")
)
_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)
_SKIP = re.compile(r"<!-- docs-test: skip: (.+?) -->\s*$")
_SETUP = re.compile(r"<!-- docs-test: setup\n(.*?)-->", re.S)
_DEVICES = re.compile(r"<!-- docs-test: devices=(\d+) -->")


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    code: str
    skip_reason: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


@functools.cache
def _page_text(page: str) -> str:
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
        return f.read()


def page_blocks(page: str) -> list[Block]:
    """The page's Python blocks in order, each with the skip reason written before it."""
    text = _page_text(page)
    blocks = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rpartition("\n")[2]
        skip = _SKIP.search(before)
        blocks.append(Block(page, line, match.group(1), skip.group(1) if skip else None))
    return blocks


def _setup(page: str) -> str:
    return "\n".join(m.group(1) for m in _SETUP.finditer(_page_text(page)))


ALL_BLOCKS = [block for page in PAGES for block in page_blocks(page)]


def _devices(page: str) -> int | None:
    found = _DEVICES.search(_page_text(page))
    return int(found.group(1)) if found else None


@functools.cache
def _namespace(page: str, upto: int) -> dict:
    """The namespace after the page's setup and its runnable blocks up to index ``upto`` (cached per process)."""
    if upto < 0:
        namespace: dict = {"__name__": f"docs_{os.path.basename(page)}"}
        exec(compile(_setup(page), f"{page}:setup", "exec"), namespace)
        return namespace
    namespace = dict(_namespace(page, upto - 1))
    block = page_blocks(page)[upto]
    if block.skip_reason is None:
        exec(compile(block.code, block.id, "exec"), namespace)
    return namespace


def test_every_page_is_read():
    assert "README.md" in PAGES and "docs/policies.md" in PAGES
    assert [b.line for b in page_blocks("README.md")], "README.md has a Python example"


def test_markers_are_read():
    assert _SKIP.search("<!-- docs-test: skip: needs a GPU -->").group(1) == "needs a GPU"
    assert _FENCE.findall("```bash\nls\n```\n```python\nx = 1\n```\n") == ["x = 1\n"]
    assert _SETUP.search("<!-- docs-test: setup\nx = 1\n-->").group(1) == "x = 1\n"


IN_PROCESS = [b for b in ALL_BLOCKS if _devices(b.page) is None or b.skip_reason]


@pytest.mark.parametrize("block", IN_PROCESS, ids=[b.id for b in IN_PROCESS])
def test_doc_block_runs(block):
    if block.skip_reason is not None:
        pytest.skip(f"{block.id}: {block.skip_reason}")
    _namespace(block.page, page_blocks(block.page).index(block))


DEVICE_PAGES = [page for page in PAGES if _devices(page) and any(b.skip_reason is None for b in page_blocks(page))]


@pytest.mark.parametrize("page", DEVICE_PAGES)
def test_doc_page_runs_on_several_devices(page):
    """A page that needs several devices: its setup and runnable blocks in one subprocess."""
    runnable = [b for b in page_blocks(page) if b.skip_reason is None]
    code = "\n".join([_setup(page), *(b.code for b in runnable)])
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={_devices(page)}"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=dict(os.environ, XLA_FLAGS=flags.strip()),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"{page} (blocks at lines {[b.line for b in runnable]}):\n{done.stderr[-3000:]}"
