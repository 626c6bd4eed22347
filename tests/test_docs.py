"""Every Python block in README.md and docs/*.md runs as a reader would paste it.

A block indented under a list item counts too: its lines lose the fence's indentation, as a
reader's paste does. Each page runs as one fresh ``python`` process, in an empty folder (the installed ``jremat`` is
importable, the checkout's folders are not): its blocks in order, one script, nothing else. So
whatever a block uses is defined on the page, in a block a reader sees; there is no hidden setup.
The one marker, an HTML comment on the line before a block, is
``<!-- docs-test: skip: REASON -->``: the block is left out of the page's script and reported as
skipped by name with REASON (say what it needs that the suite's CPU lacks).
"""

from __future__ import annotations

import builtins
import functools
import os
import posixpath
import re
import subprocess
import symtable
import sys
from dataclasses import dataclass

import pytest

from tests.conftest import REPO

PAGES = ["README.md"] + sorted(
    os.path.join("docs", name) for name in os.listdir(os.path.join(REPO, "docs")) if name.endswith(".md")
)
#: A Python block: its fence's indentation (a block in a list item is indented) and its code.
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[^\n]*\n(?P<code>.*?)^(?P=indent)```", re.S | re.M)
#: The info string of every fence line, opening or closing (a closing fence has none).
_FENCE_INFO = re.compile(r"^[ \t]*```(.*)$", re.M)
#: The blocks a page may hold: Python (run), shell commands and printed output (read only).
_FENCE_LANGUAGES = frozenset({"python", "bash", "text", ""})
_SKIP = re.compile(r"<!-- docs-test: skip: (.+?) -->\s*$")
_COMMENT = re.compile(r"<!--(.*?)-->", re.S)
#: Any fenced block, Python or not, and an inline code span: no link is read inside either.
_ANY_BLOCK = re.compile(r"^(?P<indent>[ \t]*)```.*?^(?P=indent)```", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
#: A Markdown link or image: ``[text](target)`` or ``![text](target)``.
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)
#: How README.md links a file of the repository (the page is also the wheel's description, shown
#: away from the checkout); docs/ pages link each other relatively.
REPO_URL = "https://github.com/jremat/jremat/blob/main/"
#: What the page's script writes to stderr before each block, so a failure names its block.
_RUNNING = "docs-test: running "
#: Names every module has without defining them.
_MODULE_NAMES = frozenset(dir(builtins)) | {"__name__", "__file__", "__doc__", "__builtins__"}


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


def _dedented(code: str, indent: str, where: str) -> str:
    """``code`` without its fence's ``indent`` on each line, as a reader pastes it."""
    lines = code.splitlines(keepends=True)
    if short := [n for n, text in enumerate(lines) if text.strip() and not text.startswith(indent)]:
        raise ValueError(f"{where}: line {short[0] + 1} of the block is indented less than its fence")
    return "".join(text[len(indent) :] if text.strip() else "\n" for text in lines)


def _blocks(page: str, text: str) -> list[Block]:
    blocks = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rpartition("\n")[2]
        skip = _SKIP.search(before)
        code = _dedented(match.group("code"), match.group("indent"), f"{page}:{line}")
        blocks.append(Block(page, line, code, skip.group(1) if skip else None))
    return blocks


def page_blocks(page: str) -> list[Block]:
    """The page's Python blocks in order, each with the skip reason written before it."""
    return _blocks(page, _page_text(page))


def page_script(blocks: list[Block]) -> str:
    """The page's runnable blocks as one script, in order, as pasted.

    Before each block, a line that binds no name writes the block's id to stderr.
    """
    parts = []
    for block in blocks:
        if block.skip_reason is None:
            parts.append(f"__import__('sys').stderr.write({_RUNNING + block.id + chr(10)!r})\n{block.code}")
    return "\n".join(parts)


def run_page(blocks: list[Block], folder: str) -> subprocess.CompletedProcess:
    """Run ``page_script(blocks)`` as ``python SCRIPT`` in ``folder``, with no PYTHONPATH."""
    script = os.path.join(folder, "page.py")
    with open(script, "w", encoding="utf-8") as f:
        f.write(page_script(blocks))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, script], cwd=folder, env=env, capture_output=True, text=True, timeout=300, check=False
    )


def failure_message(page: str, done: subprocess.CompletedProcess) -> str:
    """Which block of ``page`` failed (the last one started), and the end of its traceback."""
    started = [line[len(_RUNNING) :] for line in done.stderr.splitlines() if line.startswith(_RUNNING)]
    where = f"the block at {started[-1]}" if started else "before its first block"
    return (
        f"{page}: {where} failed (exit {done.returncode}); the page's blocks run in order, as pasted, "
        f"in one fresh python:\n{done.stderr[-3000:]}"
    )


def names_used_not_defined(blocks: list[Block]) -> dict[str, list[str]]:
    """For each block, the global names it uses that neither it nor an earlier block of the page defines.

    Names used inside functions and classes count too (a test function's body, a decorator).
    """
    defined: set[str] = set()
    missing = {}
    for block in blocks:
        table = symtable.symtable(block.code, block.id, "exec")
        used, stack = set(), [(table, True)]
        while stack:
            scope, top = stack.pop()
            for symbol in scope.get_symbols():
                if symbol.is_referenced() and (top or symbol.is_global()):
                    used.add(symbol.get_name())
            stack += [(child, False) for child in scope.get_children()]
        defined |= {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
        if unknown := sorted(used - defined - _MODULE_NAMES):
            missing[block.id] = unknown
    return missing


ALL_BLOCKS = [block for page in PAGES for block in page_blocks(page)]
RUN_PAGES = [page for page in PAGES if any(b.skip_reason is None for b in page_blocks(page))]
SKIPPED = [b for b in ALL_BLOCKS if b.skip_reason is not None]


def test_every_page_is_read():
    assert "README.md" in PAGES and "docs/policies.md" in PAGES and HEAVY_PAGES <= set(RUN_PAGES)
    assert [b.line for b in page_blocks("README.md")], "README.md has a Python example"


def test_markers_are_read():
    assert _SKIP.search("<!-- docs-test: skip: needs a GPU -->").group(1) == "needs a GPU"
    assert [m["code"] for m in _FENCE.finditer("```bash\nls\n```\n```python\nx = 1\n```\n")] == ["x = 1\n"]
    text = "<!-- docs-test: skip: needs a GPU -->\n```python\nx = 1\n```\n```python\ny = 2\n```\n"
    assert [b.skip_reason for b in _blocks("p.md", text)] == ["needs a GPU", None]
    assert "x = 1" not in page_script(_blocks("p.md", text))


def test_blocks_in_list_items_are_read_dedented():
    text = (
        "* item:\n\n  ```python\n  def f():\n      return 1\n\n  print(f())\n  ```\n\n"
        "* skipped:\n  <!-- docs-test: skip: needs a GPU -->\n  ```python\n  y = 2\n  ```\n"
    )
    blocks = _blocks("p.md", text)
    assert [(b.line, b.code, b.skip_reason) for b in blocks] == [
        (3, "def f():\n    return 1\n\nprint(f())\n", None),
        (12, "y = 2\n", "needs a GPU"),
    ]
    with pytest.raises(ValueError, match="p.md:1: line 2 of the block is indented less than its fence"):
        _blocks("p.md", "  ```python\n  x = 1\ny = 2\n  ```\n")


def test_every_block_is_python_or_read_only():
    """A block tagged ``py`` or ``python3`` would not run: every fence names python, bash or text, or nothing."""
    other = {}
    for page in PAGES:
        if languages := set(_FENCE_INFO.findall(_page_text(page))) - _FENCE_LANGUAGES:
            other[page] = sorted(languages)
    assert not other, f"blocks the docs test does not run: {other}"
    assert _FENCE_INFO.findall("```py\nx\n```\n  ```python\n  y\n  ```\n") == ["py", "", "python", ""]


def test_no_page_hides_code_or_setup_in_a_comment():
    """An HTML comment holds at most a skip marker: no setup, no code a reader cannot see."""
    hidden = []
    for page in PAGES:
        text = _page_text(page)
        for match in _COMMENT.finditer(text):
            comment = match.group(0)
            line = text.count("\n", 0, match.start()) + 1
            if ("docs-test" in comment and not _SKIP.fullmatch(comment)) or "```" in comment:
                hidden.append(f"{page}:{line}: {comment[:60]!r}")
    assert not hidden, f"setup or code hidden in a comment (put it in a visible block): {hidden}"


def test_no_block_uses_a_name_its_page_does_not_define():
    missing = {}
    for page in PAGES:
        missing |= names_used_not_defined(page_blocks(page))
    assert not missing, f"names used but defined nowhere above on the page: {missing}"


def test_the_name_check_sees_names_used_in_functions_and_decorators():
    blocks = _blocks(
        "p.md", "```python\nimport jax\n```\n```python\n@pytest.fixture\ndef f():\n    return jax, loss\n```\n"
    )
    assert names_used_not_defined(blocks) == {"p.md:4": ["loss", "pytest"]}


def test_a_failing_block_is_named(tmp_path):
    blocks = _blocks("p.md", "```python\nx = 1\n```\n\n```python\nprint(x)\nprint(y)\n```\n")
    done = run_page(blocks, str(tmp_path))
    assert done.returncode == 1 and done.stdout == "1\n"
    message = failure_message("p.md", done)
    assert message.startswith("p.md: the block at p.md:5 failed (exit 1)") and "NameError" in message


def test_pages_run_from_an_empty_folder_without_the_checkout(tmp_path):
    """The page's process imports the installed package; the checkout's folders are not on its path."""
    blocks = _blocks(
        "p.md",
        "```python\nimport importlib.util, os, jremat\nprint(os.listdir('.'))\n"
        "print(importlib.util.find_spec('tests'), importlib.util.find_spec('train'))\n```\n",
    )
    done = run_page(blocks, str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["['page.py']", "None None"]


#: Pages whose blocks compile and run for several seconds: CI runs them after the default suite (``-m heavy``).
HEAVY_PAGES = frozenset(
    {"docs/policies.md", "docs/moe.md", "docs/sharding.md", "docs/fit.md", "docs/check-your-model.md"}
)


@pytest.mark.parametrize(
    "page", [pytest.param(p, marks=pytest.mark.heavy) if p in HEAVY_PAGES else p for p in RUN_PAGES]
)
def test_doc_page_runs_as_pasted(page, tmp_path):
    done = run_page(page_blocks(page), str(tmp_path))
    assert done.returncode == 0, failure_message(page, done)


if SKIPPED:  # each marked block is reported as skipped, by name, with its reason

    @pytest.mark.parametrize("block", SKIPPED, ids=[b.id for b in SKIPPED])
    def test_doc_block_skipped(block):
        pytest.skip(f"{block.id}: {block.skip_reason}")


def _prose(text: str) -> str:
    """``text`` without its fenced blocks and inline code spans (what a reader sees as prose)."""
    return _CODE_SPAN.sub("", _ANY_BLOCK.sub("", text))


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown page: each heading's text, markup
    dropped, lower-cased, without punctuation but ``-`` and ``_``, spaces as ``-``; a repeated
    heading gets ``-1``, ``-2``, ... in order."""
    anchors: set[str] = set()
    for heading in _HEADING.findall(_ANY_BLOCK.sub("", text)):
        plain = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
        slug = re.sub(r"[^\w\- ]", "", plain.lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def link_targets(page: str, text: str) -> list[tuple[str, str]]:
    """Each link of ``page`` (a path from the repository root) that points into the repository,
    as (path from the repository root, anchor or ""): links to ``REPO_URL``, relative links and
    ``#anchor`` links; other addresses are left out."""
    targets = []
    for target in _LINK.findall(_prose(text)):
        path, _, anchor = target.partition("#")
        if path.startswith(REPO_URL):
            path = path[len(REPO_URL) :]
        elif "://" in path or path.startswith("mailto:"):
            continue
        elif path == "":
            path = page
        else:
            path = posixpath.normpath(posixpath.join(posixpath.dirname(page), path))
        targets.append((path, anchor))
    return targets


@functools.cache
def _tracked_files() -> frozenset[str]:
    done = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True)
    return frozenset(done.stdout.split("\0")) - {""}


def broken_links(page: str, text: str, tracked: frozenset[str], read) -> list[str]:
    """The links of ``page`` to a file that is not in ``tracked``, or to a heading its page lacks.

    ``read(path)`` gives the text of a tracked Markdown page.
    """
    broken = []
    for path, anchor in link_targets(page, text):
        if path not in tracked:
            broken.append(f"{page}: {path} is not a tracked file")
        elif anchor and path.endswith(".md") and anchor not in heading_anchors(read(path)):
            broken.append(f"{page}: {path} has no heading #{anchor}")
    return broken


def test_every_link_points_at_a_tracked_file_and_heading():
    tracked = _tracked_files()
    assert "README.md" in tracked and "tests/test_docs.py" in tracked
    broken = [line for page in PAGES for line in broken_links(page, _page_text(page), tracked, _page_text)]
    assert not broken, "\n".join(broken)


def test_the_link_check_sees_each_kind_of_link():
    pages = {
        "docs/a.md": "# A page\n\n## `jremat.jit` and *you*\n\n## Twice\n\n## Twice\n",
        "README.md": "# R\n",
    }
    text = (
        f"[a]({REPO_URL}docs/a.md#jremat.jit-and-you) [b](a.md#twice-1) [c](../README.md) ![d](fig.png)"
        f" [e](#here) [f]({REPO_URL}docs/gone.md) [g](a.md#gone) [h](https://example.com/x.md)\n"
        "`x[1](1.0)`\n```python\ny[0](gone.md)\n```\n## Here\n"
    )
    assert link_targets("docs/b.md", text) == [
        ("docs/a.md", "jremat.jit-and-you"),
        ("docs/a.md", "twice-1"),
        ("README.md", ""),
        ("docs/fig.png", ""),
        ("docs/b.md", "here"),
        ("docs/gone.md", ""),
        ("docs/a.md", "gone"),
    ]
    assert heading_anchors(pages["docs/a.md"]) == {"a-page", "jrematjit-and-you", "twice", "twice-1"}
    tracked = frozenset(pages) | {"docs/b.md", "docs/fig.png"}
    read = {**pages, "docs/b.md": text}.__getitem__
    assert broken_links("docs/b.md", text, tracked, read) == [
        "docs/b.md: docs/a.md has no heading #jremat.jit-and-you",
        "docs/b.md: docs/gone.md is not a tracked file",
        "docs/b.md: docs/a.md has no heading #gone",
    ]
