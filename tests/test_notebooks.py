"""Every notebook in notebooks/ runs top to bottom on CPU (8 simulated devices) and its checks hold.

Each notebook asserts the figures it shows (accuracy reached, same loss on 1 and 8 devices, ...)
in its own cells, so a failing figure fails its cell; the cell tagged ``results`` shows them as a
dict, which is checked here too. The install cell (tagged ``install``) is for a fresh Colab runtime
and is skipped. Committed notebooks carry no outputs.
"""

from __future__ import annotations

import ast
import glob
import os
import re
import time

import pytest

from tests.conftest import REPO

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK_DIR = os.path.join(REPO, "notebooks")
NOTEBOOKS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(NOTEBOOK_DIR, "*.ipynb")))
CELL_TIMEOUT_S = 300
COLAB = "https://colab.research.google.com/github/jaxdist/jaxdist/blob/main/notebooks/{}"

# What each notebook's results cell must show (the figures its text and asserts talk about).
EXPECTED = {
    "01_mirrored_fit.ipynb": lambda r: r["replicas"] == 8 and r["test_accuracy"] >= 0.93
    and r["max_loss_difference_1_vs_all"] < 1e-4,
    "02_custom_loop.ipynb": lambda r: r["replicas"] == 8 and r["test_accuracy"] >= 0.93
    and r["max_param_difference"] < 1e-4,
    "03_checkpoint_resume.ipynb": lambda r: r["replicas"] == 8 and r["crash_resume_exact"]
    and r["preempt_resume_exact"] and r["final_step"] == 24,
    "04_parameter_server.ipynb": lambda r: r["async_accuracy"] >= 0.9
    and r["stale_accuracy"] >= 0.9 and r["max_staleness"] <= 1,
}


def _read(name):
    return nbformat.read(os.path.join(NOTEBOOK_DIR, name), as_version=4)


def test_there_are_at_least_four_notebooks_and_each_is_checked():
    assert len(NOTEBOOKS) >= 4, NOTEBOOKS
    assert sorted(EXPECTED) == NOTEBOOKS


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_committed_clean_with_badge_and_install_cell(name):
    nb = _read(name)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), \
        f"{name} has outputs; strip them (clear all outputs) before committing"
    assert COLAB.format(name) in nb.cells[0].source, "the first cell needs the Open in Colab badge"
    install = [c for c in code if "install" in c.metadata.get("tags", [])]
    assert len(install) == 1 and install[0] is code[0], "the first code cell installs, tagged 'install'"
    assert 'if "google.colab" in sys.modules' in install[0].source
    assert sum("results" in c.metadata.get("tags", []) for c in code) == 1


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_readme_links_the_notebook(name):
    readme = open(os.path.join(REPO, "README.md")).read()
    assert COLAB.format(name) in readme, f"README.md has no Open-in-Colab link to {name}"


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_top_to_bottom(name, tmp_path, monkeypatch):
    nb = _read(name)
    nb.cells = [c for c in nb.cells if "install" not in c.metadata.get("tags", [])]
    # The kernel is a fresh process: it imports this checkout and sees only CPU devices.
    monkeypatch.setenv("PYTHONPATH", REPO)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    start = time.monotonic()
    client.execute()
    print(f"{name}: executed in {time.monotonic() - start:.1f} s")
    (cell,) = [c for c in nb.cells if "results" in c.metadata.get("tags", [])]
    (out,) = [o for o in cell.outputs if o.output_type == "execute_result"]
    results = ast.literal_eval(out.data["text/plain"])
    assert EXPECTED[name](results), results
