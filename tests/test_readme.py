"""The README's Python examples run as written."""

from __future__ import annotations

import os
import re

from tests.conftest import REPO, run_python


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


def test_readme_says_how_to_simulate_devices_in_ones_own_script():
    # Copied into a script, README's snippets run on one CPU device unless the script asks for
    # more: README says how, and its line, first in a fresh process, gives 8 devices.
    text = open(os.path.join(REPO, "README.md")).read()
    found = re.search(r'`(jax\.config\.update\("jax_num_cpu_devices", 8\))`', text)
    assert found, "README must say how to get 8 simulated devices in one's own script"
    proc = run_python(f"import jax; {found.group(1)}; print(len(jax.devices()))", timeout=120,
                      env={"JAX_NUM_CPU_DEVICES": "1", "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "8", proc.stderr[-2000:]
