"""The README's Python examples run as written."""

from __future__ import annotations

import os
import re

from tests.conftest import REPO


def test_readme_python_blocks_run(tmp_path):
    text = open(os.path.join(REPO, "README.md")).read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    # A block that cannot run on its own says so on its first line (tests/test_docs.py checks).
    blocks = [b for b in blocks if not b.startswith("# fragment")]
    assert len(blocks) >= 3
    namespace: dict = {}
    for block in blocks:
        block = block.replace("range(5)", "range(1)").replace("epochs=5", "epochs=1")
        block = block.replace('"/shared/backup"', repr(str(tmp_path / "backup")))
        exec(compile(block, "README.md", "exec"), namespace)
    assert float(namespace["loss"]) > 0
    assert namespace["history"].history["loss"]
