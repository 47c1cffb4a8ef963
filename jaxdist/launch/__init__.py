"""Multi-process jobs, from describing one to keeping it alive.

* ``cluster`` describes a job (``ClusterSpec``: TF_CONFIG, JAXDIST_* variables, SLURM, K8s) and
  ``runtime`` joins it (``jaxdist.initialize``, ``jaxdist.barrier``);
* ``launcher`` is ``jaxdist launch`` (``run``, ``main``): ``group`` runs one host's processes
  (output, restarts, hangs), ``elastic`` and ``rendezvous`` re-form a job over hosts that come and
  go, ``hang`` and ``reaper`` find stuck ranks and clean up after them;
* ``heartbeat``, ``_tierfiles`` and ``_slots`` are the state directory's files: heartbeats, and what
  the in-memory tier (``jaxdist.checkpoint.memstate``) and the launcher tell each other.

The launcher's names are available here (``from jaxdist import launch; launch.run(...)``), loaded
on first use so that importing ``jaxdist.launch.cluster`` stays cheap. So are the state
directory's files that the in-memory tier (``jaxdist.checkpoint``) shares with the launcher: the
tier's files by name, and its slot files as the module ``slot_files`` (these import the standard
library, numpy and ``heartbeat`` only).
"""

from __future__ import annotations

import importlib

from jaxdist.launch import _slots as slot_files
from jaxdist.launch._tierfiles import DEFAULT_BUDGET as DEFAULT_BUDGET
from jaxdist.launch._tierfiles import ENV_TIER as ENV_TIER
from jaxdist.launch._tierfiles import describe_tier as describe_tier
from jaxdist.launch._tierfiles import flush_path as flush_path
from jaxdist.launch._tierfiles import flushed as flushed
from jaxdist.launch._tierfiles import format_bytes as format_bytes
from jaxdist.launch._tierfiles import outcome_path as outcome_path
from jaxdist.launch._tierfiles import read_outcome as read_outcome
from jaxdist.launch._tierfiles import read_tier as read_tier
from jaxdist.launch._tierfiles import read_token as read_token
from jaxdist.launch._tierfiles import request_flush as request_flush
from jaxdist.launch._tierfiles import stop_path as stop_path
from jaxdist.launch._tierfiles import tier_on as tier_on
from jaxdist.launch._tierfiles import tier_path as tier_path
from jaxdist.launch._tierfiles import watches_flush as watches_flush
from jaxdist.launch._tierfiles import write_stop as write_stop

_LAUNCHER = ("run", "main", "free_ports", "EXIT_HUNG", "EXIT_TIMEOUT", "ENV_INIT_TIMEOUT")
__all__ = [*_LAUNCHER, "DEFAULT_BUDGET", "ENV_TIER", "describe_tier", "flush_path", "flushed", "format_bytes",
           "outcome_path", "read_outcome", "read_tier", "read_token", "request_flush", "slot_files",
           "stop_path", "tier_on", "tier_path", "watches_flush", "write_stop"]


def __getattr__(name: str):
    if name in _LAUNCHER:
        return getattr(importlib.import_module("jaxdist.launch.launcher"), name)
    raise AttributeError(f"module 'jaxdist.launch' has no attribute {name!r}")
