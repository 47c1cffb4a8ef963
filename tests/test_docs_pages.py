"""Every ```python block of the documentation site's pages runs as written.

One fresh namespace per page, blocks in page order, with the 8 simulated CPU devices of the test
session; a block whose first line is ``# fragment: <why>`` is skipped (tests/test_docs.py checks
that it says why). The same shortening as README's test keeps it fast: one epoch instead of five.
README's own blocks run in tests/test_readme.py.
"""

from __future__ import annotations

import glob
import os
import re

import pytest

from tests.conftest import REPO

PAGES = sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "**", "*.md"),
                                                          recursive=True)
               if os.sep + "_build" + os.sep not in p)
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(text: str) -> list[str]:
    """The ```python blocks of a Markdown page that are meant to run (fragments left out)."""
    return [b for b in BLOCK.findall(text) if not b.startswith("# fragment")]


def shorten(block: str, tmp_path) -> str:
    """What the tests run instead of the page's block: fewer epochs and steps, paths under tmp."""
    for long, short in (("range(5)", "range(1)"), ("epochs=5", "epochs=1"),
                        ("range(600)", "range(60)")):
        block = block.replace(long, short)
    return block.replace('"/shared/backup"', repr(str(tmp_path / "backup")))


def test_the_site_has_pages_with_code():
    assert sum(bool(python_blocks(open(os.path.join(REPO, p)).read())) for p in PAGES) >= 5, PAGES


@pytest.mark.parametrize("page", PAGES)
def test_page_python_blocks_run(page, tmp_path, monkeypatch):
    blocks = python_blocks(open(os.path.join(REPO, page), encoding="utf-8").read())
    if not blocks:
        pytest.skip(f"{page} has no Python block to run")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for i, block in enumerate(blocks):
        exec(compile(shorten(block, tmp_path), f"{page} (block {i + 1})", "exec"), namespace)
