"""Multi-process jobs, from describing one to keeping it alive.

* ``cluster`` describes a job (``ClusterSpec``: TF_CONFIG, JAXDIST_* variables, SLURM, K8s) and
  ``runtime`` joins it (``jaxdist.initialize``, ``jaxdist.barrier``);
* ``launcher`` is ``jaxdist launch`` (``run``, ``main``): ``group`` runs one host's processes
  (output, restarts, hangs), ``elastic`` and ``rendezvous`` re-form a job over hosts that come and
  go, ``hang`` and ``reaper`` find stuck ranks and clean up after them;
* ``heartbeat``, ``_tierfiles`` and ``_slots`` are the state directory's files: heartbeats, and what
  the in-memory tier (``jaxdist.checkpoint.memstate``) and the launcher tell each other.

The launcher's names are available here (``from jaxdist import launch; launch.run(...)``), loaded
on first use so that importing ``jaxdist.launch.cluster`` stays cheap.
"""

from __future__ import annotations

import importlib

_LAUNCHER = ("run", "main", "free_ports", "EXIT_HUNG", "EXIT_TIMEOUT", "ENV_INIT_TIMEOUT")
__all__ = list(_LAUNCHER)


def __getattr__(name: str):
    if name in _LAUNCHER:
        return getattr(importlib.import_module("jaxdist.launch.launcher"), name)
    raise AttributeError(f"module 'jaxdist.launch' has no attribute {name!r}")
