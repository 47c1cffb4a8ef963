"""Every ```python block of the documentation site's pages runs as written, pasted in order.

One fresh Python process per page, in a temporary folder, blocks in page order (as a user pastes
them: a block that starts JAX before one that calls ``jaxdist.initialize()`` fails here), with 8
simulated CPU devices; a block whose first line is ``# fragment: <why>`` is skipped (tests/test_docs.py
checks that it says why): keep those to blocks that need several processes or hosts. The same
shortening as README's test keeps it fast: one epoch instead of five. Paths are not rewritten: a
block that writes outside its folder (``/shared/backup``) fails. README's own blocks run in
tests/test_readme.py.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

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
    return block


# Runs the blocks of one page in order in one namespace, each under its own name in tracebacks.
_RUNNER = """
import json, sys
blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__docs__"}
for name, code in blocks:
    exec(compile(code, name, "exec"), namespace)
"""
# A string that names a directory outside the block's folder ("/shared/backup"; not "/gpu:0").
_ABSOLUTE = re.compile(r"""["']/(?!tmp/)(?![a-z]+:\d)[\w.-]+/""")


def test_the_site_has_pages_with_code():
    assert sum(bool(python_blocks(open(os.path.join(REPO, p)).read())) for p in PAGES) >= 5, PAGES


@pytest.mark.parametrize("page", PAGES)
def test_page_python_blocks_run(page, tmp_path):
    blocks = python_blocks(open(os.path.join(REPO, page), encoding="utf-8").read())
    if not blocks:
        pytest.skip(f"{page} has no Python block to run")
    outside = [m.group(0) for b in blocks for m in _ABSOLUTE.finditer(b)]
    assert not outside, f"{page} writes outside the folder it runs in: {outside}"
    named = [(f"{page} (block {i + 1})", shorten(b, tmp_path)) for i, b in enumerate(blocks)]
    (tmp_path / "blocks.json").write_text(json.dumps(named))
    (tmp_path / "run_blocks.py").write_text(_RUNNER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXDIST_", "TF_CONFIG"))}
    env.update(PYTHONPATH=REPO, PYTHONUNBUFFERED="1", JAX_NUM_CPU_DEVICES="8", MPLBACKEND="Agg")
    try:
        proc = subprocess.run([sys.executable, "run_blocks.py", "blocks.json"], capture_output=True,
                              text=True, timeout=600, env=env, cwd=tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{page}: its blocks did not finish within 600 s (a hang or deadlock)")
    assert proc.returncode == 0, f"{page}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
