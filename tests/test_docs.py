"""Docs that hold: files the docs name exist, links resolve, fragments are marked, help is complete."""

from __future__ import annotations

import argparse
import glob
import json
import os
import re

import pytest

from tests.conftest import REPO

DOCS = ["README.md", "examples/README.md", "examples/deploy/README.md"]
# Repository paths the docs may name: under these directories, or a Markdown file at the root.
PATH = re.compile(r"(?<![\w/.-])((?:examples|notebooks|tests|benchmarks|jaxdist)/[\w./-]*"
                  r"\.(?:py|md|ipynb|sh|sbatch|yaml|json|txt)|[A-Za-z_][\w-]*\.md)(?![\w/-])")
# Names that are not repository files (examples of user paths in prose).
NOT_REPO_FILES = {"benchmarks/NAME.py"}  # a placeholder in `jaxdist bench` help
# Known stale references (none left; an entry is (file, name)).
KNOWN_STALE: set[tuple[str, str]] = set()


def _sources():
    files = [os.path.join(REPO, d) for d in DOCS]
    files += glob.glob(os.path.join(REPO, "examples", "**", "*.*"), recursive=True)
    files += glob.glob(os.path.join(REPO, "jaxdist", "**", "*.py"), recursive=True)
    files += glob.glob(os.path.join(REPO, "notebooks", "*.ipynb"))
    return sorted(f for f in files if os.path.isfile(f) and "__pycache__" not in f)


def _text(path):
    text = open(path, encoding="utf-8").read()
    if path.endswith(".ipynb"):  # the notebook's own words and code, not its JSON
        text = "\n".join("".join(c["source"]) for c in json.loads(text)["cells"])
    return text


def _exists(name, source):
    candidates = [os.path.join(REPO, name), os.path.join(os.path.dirname(source), name)]
    return any(os.path.exists(c.split("#")[0]) for c in candidates)


def test_every_file_the_docs_and_docstrings_name_exists():
    missing = []
    for source in _sources():
        rel = os.path.relpath(source, REPO)
        for name in set(PATH.findall(_text(source))):
            name = name.rstrip(".")
            if name in NOT_REPO_FILES or (rel, name) in KNOWN_STALE or _exists(name, source):
                continue
            missing.append(f"{rel} names {name}")
    assert not missing, "references to files that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("doc", DOCS)
def test_markdown_links_resolve(doc):
    path = os.path.join(REPO, doc)
    for target in re.findall(r"\]\(([^)\s]+)\)", open(path).read()):
        if target.startswith(("http://", "https://", "#")):
            continue
        assert os.path.exists(os.path.join(os.path.dirname(path), target.split("#")[0])), \
            f"{doc} links to {target}, which does not exist"


@pytest.mark.parametrize("doc", DOCS)
def test_python_blocks_run_or_are_marked_fragments(doc):
    """README's blocks run in tests/test_readme.py; a block that cannot says so on its first line."""
    blocks = re.findall(r"```python\n(.*?)```", open(os.path.join(REPO, doc)).read(), re.S)
    if doc != "README.md":  # only README's blocks are executed
        assert all(b.startswith("# fragment: ") for b in blocks), doc
    for block in blocks:
        if block.startswith("# fragment"):
            assert re.match(r"# fragment: \S", block), "say why it is a fragment"


def test_readme_says_how_to_run_on_gpu_and_tpu():
    readme = open(os.path.join(REPO, "README.md")).read()
    section = readme.split("## Running on GPUs and TPUs", 1)[1].split("\n## ", 1)[0]
    for needed in ('pip install -e ".[cuda12]"', 'pip install -e ".[tpu]"', "TPUStrategy",
                   "examples/deploy/gpu/train_gpu.sh", "examples/deploy/tpu/tpu_vm.sh",
                   "examples/deploy/README.md", "notebook"):
        assert needed in section, needed
    assert "(examples/README.md)" in readme


def _parsers(monkeypatch, argvs):
    """The argparse parsers `jaxdist ps` builds for each argv (parsing stops before running)."""
    from jaxdist.ps import cli as ps_cli

    parsers = []

    def capture(self, *args, **kwargs):
        parsers.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    for argv in argvs:
        with pytest.raises(SystemExit):
            ps_cli.main(argv)
    return parsers


def test_jaxdist_ps_help_lists_its_subcommands_and_documents_every_option(monkeypatch, capsys):
    task, launch = _parsers(monkeypatch, [["--role", "ps"], ["launch", "x.py"]])
    assert "launch" in task.format_help() and "jaxdist ps launch" in task.format_help()
    for parser in (task, launch):
        undocumented = [a.dest for a in parser._actions if not a.help]
        assert not undocumented, f"{parser.prog}: options without help text: {undocumented}"
