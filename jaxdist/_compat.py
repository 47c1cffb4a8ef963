"""Module paths that moved when jaxdist's flat modules were grouped into packages (0.4.0).

Two kinds of old path keep importing, as the same module object as the new one (so ``isinstance``
and monkeypatching see one module, never a copy):

* the public namespaces users are told to import (``jaxdist.models``, ``jaxdist.datasets``,
  ``jaxdist.precision``, ``jaxdist.schedules``, ``jaxdist.zero``, ``jaxdist.cluster``,
  ``jaxdist.memstate``, ``jaxdist.evaluator``) are permanent names for their new homes;
* the internal flat paths (``jaxdist.step``, ``jaxdist.launch_group``, ...) import for one more
  release with a ``DeprecationWarning`` that names the new path.

``jaxdist.fit`` is the function ``fit``; its module is ``jaxdist.training.fit``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings

PUBLIC = {
    "jaxdist.cluster": "jaxdist.launch.cluster",
    "jaxdist.datasets": "jaxdist.input.datasets",
    "jaxdist.evaluator": "jaxdist.checkpoint.evaluator",
    "jaxdist.memstate": "jaxdist.checkpoint.memstate",
    "jaxdist.models": "jaxdist.training.models",
    "jaxdist.precision": "jaxdist.training.precision",
    "jaxdist.schedules": "jaxdist.training.schedules",
    "jaxdist.zero": "jaxdist.core.zero",
}

DEPRECATED = {  # removed in 0.5.0
    "jaxdist.accumulate": "jaxdist.training.accumulate",
    "jaxdist.collectives": "jaxdist.core.collectives",
    "jaxdist.elastic": "jaxdist.launch.elastic",
    "jaxdist.hang": "jaxdist.launch.hang",
    "jaxdist.input_context": "jaxdist.input.context",
    "jaxdist.input_local": "jaxdist.input.local",
    "jaxdist.launch_group": "jaxdist.launch.group",
    "jaxdist.launch.memstate": "jaxdist.checkpoint.memstate",
    "jaxdist.layout": "jaxdist.core.layout",
    "jaxdist.loss": "jaxdist.core.loss",
    "jaxdist.mesh": "jaxdist.core.mesh",
    "jaxdist.per_replica": "jaxdist.core.per_replica",
    "jaxdist.plan_measure": "jaxdist.plan.measure",
    "jaxdist.reaper": "jaxdist.launch.reaper",
    "jaxdist.rendezvous": "jaxdist.launch.rendezvous",
    "jaxdist.replica": "jaxdist.core.replica",
    "jaxdist.runtime": "jaxdist.launch.runtime",
    "jaxdist.step": "jaxdist.core.step",
    "jaxdist.train_cli": "jaxdist.training.cli",
    "jaxdist.values": "jaxdist.core.values",
}

MOVED = {**PUBLIC, **DEPRECATED}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path and loads it as the module at its new path."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=False)

    def create_module(self, spec):
        new = MOVED[spec.name]
        if spec.name in DEPRECATED:
            # stacklevel 2 is the importing line: warnings skips importlib's own frames
            warnings.warn(f"{spec.name} moved to {new}; the old path is removed in jaxdist 0.5.0. "
                          f"Import {new} instead.", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._specs = getattr(self, "_specs", {})
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        # The import system set __spec__ to the alias's; the module keeps its own.
        module.__spec__ = self._specs.pop(module.__spec__.name, module.__spec__)

    def get_code(self, fullname):  # ``python -m`` an old path (runpy asks the loader for code)
        new = MOVED[fullname]
        spec = importlib.util.find_spec(new)
        return spec.loader.get_code(new)


def install() -> None:
    """Puts the alias finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
