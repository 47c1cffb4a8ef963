"""Whether every process has agreed to stop at a step after a preemption notice (SIGTERM).

Across processes, JAX's preemption sync manager (started by ``jax.distributed.initialize``)
catches SIGTERM and picks a step that every process reaches; on one process a SIGTERM handler
sets a flag that the next step boundary reads. ``TieredCheckpointManager.should_stop`` asks it
after each step (``fit``'s ``BackupAndRestore`` through that manager); the elastic launcher's own
agreed stop step is the in-memory tier's (``InMemoryTier.stop_step``).
"""

from __future__ import annotations

import logging
import signal
import threading

import jax

logger = logging.getLogger(__name__)


class PreemptionNotice:
    """Whether every process has agreed to stop at this step (see the module's docstring).

    Multi-process contract: every process asks :meth:`reached` for the same steps, in order.

    >>> notice = PreemptionNotice()
    >>> notice.reached(3)
    False
    """

    def __init__(self):
        self._flag = False
        self._previous = None
        self._installed = False

    def install(self) -> None:
        """Catches SIGTERM on one process (from the main thread; once: a second call does nothing)."""
        if self._installed or jax.process_count() > 1 or (
                threading.current_thread() is not threading.main_thread()):
            return
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True

    def _on_sigterm(self, signum, frame) -> None:
        logger.warning("SIGTERM received: saving a checkpoint at the next step boundary")
        self._flag = True

    def uninstall(self) -> None:
        """Gives SIGTERM back to the handler it had before :meth:`install`."""
        if self._installed:
            # None: the handler before was not set from Python; the default is the nearest to it
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)
            self._previous = None
            self._installed = False

    def reached(self, step: int) -> bool:
        """Whether training stops after ``step`` (every process gets the same answer)."""
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self._flag
