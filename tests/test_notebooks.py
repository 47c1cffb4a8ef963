"""The notebooks in notebooks/: committed clean, open in Colab, and checked by the docs build.

The documentation build (``sphinx-build -W -b html docs docs/_build/html``, run by ``.ci/run``)
executes every notebook with myst-nb, and a cell that raises fails it; so the notebooks are not
executed a second time here. What each notebook claims (accuracy reached, the same loss on 1 and 8
devices, a resume that is bitwise exact, the staleness bound held) is asserted in its one cell
tagged ``checks``, which the site hides (``remove-cell``) and Colab folds. This file checks the
committed form, that those checks are there, and, after a docs build, that every notebook page
shows a figure. ``JAXDIST_NOTEBOOKS=1`` also executes them here (without building the site).
"""

from __future__ import annotations

import glob
import os
import re

import pytest

from tests.conftest import REPO

nbformat = pytest.importorskip("nbformat")

NOTEBOOK_DIR = os.path.join(REPO, "notebooks")
NOTEBOOKS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(NOTEBOOK_DIR, "*.ipynb")))
COLAB = "https://colab.research.google.com/github/jaxdist/jaxdist/blob/main/notebooks/{}"
HTML = os.path.join(REPO, "docs", "_build", "html", "notebooks")

# What each notebook's hidden checks cell must assert (the claims its text and figure make).
EXPECTED = {
    "01_mirrored_fit.ipynb": ["strategy.num_replicas_in_sync == 8", "test_accuracy >= 0.93",
                              "max_difference < 1e-4"],
    "02_custom_loop.ipynb": ["strategy.num_replicas_in_sync == 8", "test_accuracy >= 0.93",
                             "max_difference < 1e-4", "== len(x) % GLOBAL_BATCH"],
    "03_checkpoint_resume.ipynb": ["strategy.num_replicas_in_sync == 8", "crash_resume_exact",
                                   "preempt_resume_exact", "int(reference.state.step) == 24",
                                   "restored_exact"],
    "04_parameter_server.ipynb": ["async_accuracy >= 0.9", "stale_accuracy >= 0.9", "worst <= 1",
                                  "versions == [STEPS, STEPS]"],
    "05_planning.ipynb": ["all(h >= r", "0 < prediction.efficiency <= 1"],
}


def _read(name):
    return nbformat.read(os.path.join(NOTEBOOK_DIR, name), as_version=4)


def _tagged(nb, tag):
    return [c for c in nb.cells if c.cell_type == "code" and tag in c.metadata.get("tags", [])]


def test_every_notebook_is_checked():
    assert len(NOTEBOOKS) >= 5, NOTEBOOKS
    assert sorted(EXPECTED) == NOTEBOOKS


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_committed_clean_with_badge_and_install_cell(name):
    nb = _read(name)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), \
        f"{name} has outputs; strip them (clear all outputs) before committing"
    assert COLAB.format(name) in nb.cells[0].source, "the first cell needs the Open in Colab badge"
    install = _tagged(nb, "install")
    assert len(install) == 1 and install[0] is code[0], "the first code cell installs, tagged 'install'"
    assert 'if "google.colab" in sys.modules' in install[0].source


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_checks_are_hidden_and_readers_see_no_asserts(name):
    nb = _read(name)
    (checks,) = _tagged(nb, "checks")
    assert "remove-cell" in checks.metadata["tags"], "the site must not show the checks"
    assert checks.metadata.get("jupyter", {}).get("source_hidden"), "Colab/Jupyter fold the checks"
    assert checks is [c for c in nb.cells if c.cell_type == "code"][-1], "checks come last"
    for claim in EXPECTED[name]:
        assert claim in checks.source, f"{name}: the checks cell no longer asserts {claim!r}"
    for cell in nb.cells:
        if cell.cell_type == "code" and cell is not checks:
            assert not re.search(r"^\s*assert\b", cell.source, re.M), \
                f"{name}: an assert outside the checks cell:\n{cell.source}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_draws_a_figure(name):
    assert any("plt.show()" in c.source for c in _read(name).cells if c.cell_type == "code")


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_readme_links_the_notebook(name):
    readme = open(os.path.join(REPO, "README.md")).read()
    assert COLAB.format(name) in readme, f"README.md has no Open-in-Colab link to {name}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_built_site_shows_the_notebook_with_a_figure(name):
    """After ``sphinx-build`` (CI builds the site before the tests): the page has its figure."""
    page = os.path.join(HTML, name.replace(".ipynb", ".html"))
    if not os.path.isdir(HTML):
        pytest.skip("the docs are not built (sphinx-build -W -b html docs docs/_build/html)")
    html = open(page, encoding="utf-8").read()
    assert re.search(r"<img[^>]+src=\"\.\./_images/[^\"]+\.png\"", html), (
        f"{page} shows no figure (was the site built with the notebooks executed?)")
    assert "Traceback" not in html and "@title Checks" not in html
    for noise in ("[Gloo]", "WARNING", "absl::", "E0000 "):  # library logging stays out of the page
        assert noise not in html, f"{page} shows {noise!r} output"
    colab = set(re.findall(r'href="(https://colab\.research\.google\.com/[^"]+)"', html))
    assert colab == {COLAB.format(name)}, f"{page} links Colab to {sorted(colab)}, not to notebooks/{name}"


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("JAXDIST_NOTEBOOKS") != "1",
                    reason="the docs build executes the notebooks; JAXDIST_NOTEBOOKS=1 runs them here")
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_top_to_bottom(name, tmp_path, monkeypatch):
    nbclient = pytest.importorskip("nbclient")
    nb = _read(name)
    nb.cells = [c for c in nb.cells if "install" not in c.metadata.get("tags", [])]
    monkeypatch.setenv("PYTHONPATH", REPO)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
