"""Module paths that moved when jaxdist's flat modules were grouped into packages (0.4.0).

Two kinds of old path keep importing, as the same module object as the new one (so ``isinstance``
and monkeypatching see one module, never a copy):

* the public namespaces users are told to import (``jaxdist.models``, ``jaxdist.datasets``,
  ``jaxdist.precision``, ``jaxdist.schedules``, ``jaxdist.zero``, ``jaxdist.cluster``,
  ``jaxdist.memstate``, ``jaxdist.evaluator``) are permanent names for their new homes;
* the internal flat paths (``jaxdist.step``, ``jaxdist.launch_group``, ...) import for one more
  release with a ``DeprecationWarning`` that names the new path.

``jaxdist.fit`` is the function ``fit``; its module is ``jaxdist.training.fit``.

Each old path is a plain stub module that calls :func:`alias` with its own name: the top-level
ones live in ``jaxdist/_compat/paths/`` (which ``jaxdist/__init__.py`` adds to the package's search
path, ``jaxdist.__path__``, so that the top level stays small), ``jaxdist.launch.memstate`` and
``jaxdist.launch.slot_files`` in ``jaxdist/launch/``. No import hook: ``python -m`` and
``importlib`` see ordinary modules.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
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
    "jaxdist.launch.slot_files": "jaxdist.checkpoint._slots",  # was jaxdist.launch.__all__'s
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


__all__ = ["DEPRECATED", "MOVED", "PATHS", "PUBLIC", "alias"]

# Where the top-level stub modules are (jaxdist/__init__.py puts it on jaxdist.__path__).
PATHS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "paths")


def alias(old: str) -> types.ModuleType:
    """Makes the module at ``old`` (a stub being imported) the module at its new path.

    Called from the stub's body: imports the new module, puts it in ``sys.modules`` under the old
    name, which is what the import statement then returns (the same module object, so
    ``isinstance`` and monkeypatching see one module), and, for a deprecated path, warns naming
    the new one.
    """
    new = MOVED[old]
    if old in DEPRECATED:
        # stacklevel 3 is the importing line: alias, the stub, then (importlib's frames skipped)
        # the import statement
        warnings.warn(f"{old} moved to {new}; the old path is removed in jaxdist 0.5.0. "
                      f"Import {new} instead.", DeprecationWarning, stacklevel=3)
    module = importlib.import_module(new)
    sys.modules[old] = module
    return module


RENAMED = {  # removed in 0.5.0: an old public name -> its new one (the tier and its policy, 0.4)
    "jaxdist.checkpoint.memstate.StateTier": "jaxdist.checkpoint.InMemoryTier",
    "jaxdist.checkpoint.tier_policy.MemoryTier": "jaxdist.checkpoint.MemoryTierPolicy",
    "jaxdist.callbacks.MemoryTier": "jaxdist.checkpoint.MemoryTierPolicy",
}


def renamed(module: str):
    """A module ``__getattr__`` for ``module``'s names in :data:`RENAMED`: the new object, with a
    ``DeprecationWarning`` naming the new name (AttributeError for any other name)."""

    def __getattr__(name: str):
        new = RENAMED.get(f"{module}.{name}")
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{module}.{name} is {new} (renamed in 0.4.0: the in-memory tier is "
                      "InMemoryTier, its policy MemoryTierPolicy); the old name goes in 0.5.0",
                      DeprecationWarning, stacklevel=2)
        home, _, attr = new.rpartition(".")
        return getattr(importlib.import_module(home), attr)

    return __getattr__
