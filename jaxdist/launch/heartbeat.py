"""Heartbeats: each process under ``jaxdist launch`` tells the launcher how far it has got.

Every training step a process dispatches (``@jaxdist.mirrored``, ``strategy.run``, ``fit``: see
``jaxdist.core.progress``) is counted on the loop's thread (an addition); a daemon thread writes
``<state dir>/<rank>/heartbeat`` a few times a second when it changed: the steps *dispatched*, the
time, and the steps *completed* on the devices (read from a step output's ``is_ready()``, never
waited for). The launcher reads these files to find hung ranks (``jaxdist.launch.hang``). This
does not depend on the in-memory tier, the state's layout, or the loop: any process that trains
under the launcher beats.

A rank that stops dispatching while its peers have dispatched further is the one they wait for
(they are blocked inside a collective it never entered): the hang detector names it. Each beating
process also registers ``faulthandler`` on ``SIGUSR1``, so that the launcher can have every rank
print its Python stack (all threads, to its stderr) when it declares a hang; the rank's pid in
``<state dir>/<rank>/stacks`` says it may be asked.
"""

from __future__ import annotations

import atexit
import collections
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, NamedTuple

from jaxdist.core import progress

ENV_STATE_DIR = "JAXDIST_STATE_DIR"
"""The environment variable naming this host's state directory (set by ``jaxdist launch``)."""

PERIOD_S = 0.1
_PENDING_MAX = 64  # steps whose completion is still watched (bounded: a loop may run far ahead)


class Beat(NamedTuple):
    """One rank's last report.

    Attributes:
      dispatched: training steps dispatched (the global step count once a run has resumed).
      time: the Unix time of the report.
      completed: steps known to have completed on the devices (None: not known yet).
    """

    dispatched: int
    time: float
    completed: int | None = None


def heartbeat_path(directory: str, rank: int | str) -> str:
    """Where process ``rank`` reports its progress."""
    return os.path.join(directory, str(rank), "heartbeat")


def stacks_path(directory: str, rank: int | str) -> str:
    """Where process ``rank`` says which pid dumps its Python stacks on ``SIGUSR1``."""
    return os.path.join(directory, str(rank), "stacks")


def read_heartbeat(directory: str, rank: int | str) -> Beat | None:
    """``rank``'s last report, or None if it made none.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> read_heartbeat(d, 0) is None
    True
    >>> write_atomic(heartbeat_path(d, 0), b"7 0 5")
    >>> read_heartbeat(d, 0)
    Beat(dispatched=7, time=0.0, completed=5)
    """
    try:
        with open(heartbeat_path(directory, rank), "rb") as f:
            fields = f.read().split()
        completed = int(fields[2]) if len(fields) > 2 and fields[2] != b"-" else None
        return Beat(int(fields[0]), float(fields[1]) if len(fields) > 1 else 0.0, completed)
    except (OSError, ValueError, IndexError):
        return None


def stack_pid(directory: str, rank: int | str) -> int | None:
    """The pid of ``rank`` that prints its stacks on ``SIGUSR1`` (None: it did not register)."""
    try:
        with open(stacks_path(directory, rank), "rb") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def write_atomic(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` through a temporary name, so a reader never sees half of it."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class Heartbeat:
    """This process's heartbeat (one per process: :func:`current`).

    Args:
      directory: the host's state directory.
      rank: this process's index in the job.

    >>> import tempfile
    >>> hb = Heartbeat(tempfile.mkdtemp(), 0)
    >>> hb.on_step(1, None); hb.on_step(1, None); hb.flush()
    >>> read_heartbeat(hb.directory, 0).dispatched
    2
    >>> hb.close()
    """

    def __init__(self, directory: str, rank: int):
        self.directory, self.rank = directory, int(rank)
        self._dispatched = 0
        self._steps_here = 0  # steps this process dispatched: nothing is reported before the first
        self._completed: int | None = None
        self._pending: collections.deque = collections.deque()
        self._written: tuple | None = None
        self._lock = threading.Lock()  # writes (the thread, flush at exit) never interleave
        self._stop = threading.Event()
        enable_stack_dumps(directory, self.rank)
        self._thread = threading.Thread(target=self._run, name="jaxdist-heartbeat", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    @property
    def dispatched(self) -> int:
        """Training steps dispatched so far (with the base set by :meth:`set_step`)."""
        return self._dispatched

    def on_step(self, steps: int, marker: Any) -> None:
        """Counts ``steps`` dispatched steps (the loop's thread: an addition and an append)."""
        self._dispatched += steps
        self._steps_here += steps
        if marker is not None:
            self._pending.append((self._dispatched, marker))
            if len(self._pending) > _PENDING_MAX:
                self._pending.popleft()

    def set_step(self, step: int) -> None:
        """Sets the step count (a resumed run starts at the step it resumed from)."""
        self._pending.clear()
        self._dispatched = self._completed = int(step)

    def _update_completed(self) -> None:
        while self._pending:
            step, marker = self._pending[0]
            try:
                ready = marker.is_ready()
            except Exception:  # noqa: BLE001 - deleted by the user: it completed or never will
                ready = True
            if not ready:
                return
            self._completed = step
            self._pending.popleft()

    def flush(self) -> None:
        """Writes the current progress now, if it changed."""
        if not self._steps_here:
            return  # the first report arms the hang detector: only once a step ran here
        with self._lock:
            self._update_completed()
            now = (self._dispatched, self._completed)
            if now == self._written:
                return
            completed = "-" if now[1] is None else str(now[1])
            write_atomic(heartbeat_path(self.directory, self.rank),
                         f"{now[0]} {time.time():.3f} {completed}".encode())
            self._written = now

    def _run(self) -> None:
        while not self._stop.wait(PERIOD_S):
            try:
                self.flush()
            except OSError:
                pass  # a full or removed directory: the launcher sees no progress and says so

    def close(self) -> None:
        """Writes the last progress and stops the thread (at exit, too)."""
        self._stop.set()
        try:
            self.flush()
        except OSError:
            pass


def enable_stack_dumps(directory: str, rank: int) -> None:
    """Makes ``SIGUSR1`` print every thread's Python stack to stderr, and says so for the launcher.

    Done only where ``SIGUSR1`` still has its default action (which would end the process), so a
    program's own handler is left alone.
    """
    try:
        if signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL:
            return
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
    except (AttributeError, ValueError, RuntimeError, OSError):
        return  # no SIGUSR1 (Windows), not the main interpreter, or stderr without a descriptor
    write_atomic(stacks_path(directory, rank), str(os.getpid()).encode())


_current: Heartbeat | None = None
_create_lock = threading.Lock()


def current() -> Heartbeat | None:
    """This process's heartbeat under ``jaxdist launch`` (created on first use), else None."""
    global _current, _unusable
    if _current is None:
        directory = os.environ.get(ENV_STATE_DIR)
        if not directory or directory == _unusable:
            return None
        with _create_lock:
            if _current is None:
                try:
                    _current = Heartbeat(directory, _rank())
                except OSError as e:
                    _unusable = directory  # said once, not at every step
                    logging.getLogger(__name__).warning(
                        "%s=%s cannot be used (%s): this process keeps no heartbeat and no "
                        "in-memory state; set it to a writable directory, or unset it",
                        ENV_STATE_DIR, directory, e.strerror or e)
                    return None
    return _current


_unusable: str | None = None  # a state directory that could not be used (warned once)


def unusable_dir() -> str | None:
    """The state directory this process found it cannot use (and said so), if any."""
    return _unusable


def _rank() -> int:
    rank = os.environ.get("JAXDIST_PROCESS_ID")
    if rank is not None and rank.isdigit():
        return int(rank)
    import jax

    return jax.process_index()


def _on_step(steps: int, marker: Any) -> None:
    beat = current()
    if beat is not None:
        beat.on_step(steps, marker)


_installed = False


def install() -> None:
    """Under ``jaxdist launch`` (``JAXDIST_STATE_DIR`` set), beats for every training step.

    The heartbeat starts with the first step, so a helper process the script starts (a data
    loader's workers) never beats in its place.
    """
    global _installed
    if not _installed and os.environ.get(ENV_STATE_DIR):
        progress.listen(_on_step)
        _installed = True
