"""Multi-process jobs, from describing one to keeping it alive.

* ``cluster`` describes a job (``ClusterSpec``: TF_CONFIG, JAXDIST_* variables, SLURM, K8s) and
  ``runtime`` joins it (``jaxdist.initialize``, ``jaxdist.barrier``);
* ``launcher`` is ``jaxdist launch`` (``run``, ``main``): ``group`` runs one host's processes
  (output, restarts, hangs), ``elastic`` and ``rendezvous`` re-form a job over hosts that come and
  go, ``hang`` and ``reaper`` find stuck ranks and clean up after them;
* ``heartbeat`` and ``statedir`` are the state directory's files: heartbeats, and what the
  in-memory tier (``jaxdist.checkpoint.memstate``) and the launcher tell each other, the tier's
  slot files by name and whether one holds a snapshot. What a slot holds (its format, checksums
  and writer) is the tier's, in ``jaxdist.checkpoint``.

The launcher's names are available here (``from jaxdist import launch; launch.run(...)``), loaded
on first use so that importing ``jaxdist.launch.cluster`` stays cheap. So are the state
directory's files that the in-memory tier (``jaxdist.checkpoint``) shares with the launcher, by
name, and the module ``statedir`` (these import the standard library and ``heartbeat`` only).
``jaxdist.launch.slot_files``, the tier's slot files, moved to ``jaxdist.checkpoint._slots``: the
old name imports with a ``DeprecationWarning`` until jaxdist 0.5.0.
"""

from __future__ import annotations

import importlib

from jaxdist.launch import compile_cache as compile_cache
from jaxdist.launch import statedir as statedir
from jaxdist.launch.statedir import DEFAULT_BUDGET as DEFAULT_BUDGET
from jaxdist.launch.statedir import ENV_TIER as ENV_TIER
from jaxdist.launch.statedir import describe_tier as describe_tier
from jaxdist.launch.statedir import flush_path as flush_path
from jaxdist.launch.statedir import flushed as flushed
from jaxdist.launch.statedir import format_bytes as format_bytes
from jaxdist.launch.statedir import outcome_path as outcome_path
from jaxdist.launch.statedir import read_outcome as read_outcome
from jaxdist.launch.statedir import read_tier as read_tier
from jaxdist.launch.statedir import read_token as read_token
from jaxdist.launch.statedir import request_flush as request_flush
from jaxdist.launch.statedir import stop_path as stop_path
from jaxdist.launch.statedir import tier_on as tier_on
from jaxdist.launch.statedir import tier_path as tier_path
from jaxdist.launch.statedir import watches_flush as watches_flush
from jaxdist.launch.statedir import write_stop as write_stop

_LAUNCHER = ("run", "main", "free_ports", "EXIT_HUNG", "EXIT_TIMEOUT", "ENV_INIT_TIMEOUT")
_MOVED = ("slot_files",)  # stubs in this package (jaxdist._compat.DEPRECATED): removed in 0.5.0
__all__ = [*_LAUNCHER, "DEFAULT_BUDGET", "ENV_TIER", "compile_cache", "describe_tier", "flush_path",
           "flushed", "format_bytes", "outcome_path", "read_outcome", "read_tier", "read_token",
           "request_flush", "statedir",
           "stop_path", "tier_on", "tier_path", "watches_flush", "write_stop"]


def __getattr__(name: str):
    if name in _LAUNCHER:
        return getattr(importlib.import_module("jaxdist.launch.launcher"), name)
    if name in _MOVED:  # the stub warns and names the new path
        return importlib.import_module(f"jaxdist.launch.{name}")
    raise AttributeError(f"module 'jaxdist.launch' has no attribute {name!r}")
