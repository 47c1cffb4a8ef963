"""Directories a launcher owns while it lives, and the removal of those whose owner is gone.

A launcher's in-memory state (``/dev/shm/jaxdist-state-*``) and compile cache
(``jaxdist-xla-cache-*``) outlive a launcher killed with SIGKILL, so the next launcher removes
such leftovers. A name's pid proves nothing: seen from another PID namespace (containers that
share ``/dev/shm``, as NCCL's ``--ipc=host`` asks) every other job's pid looks dead. So each
directory is held by its launcher with an exclusive ``flock`` on the directory itself, which the
kernel drops when the process dies, in any namespace; a directory is stale only when that lock
can be taken, and one that was never marked as locked is left alone.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import tempfile

logger = logging.getLogger(__name__)

_MARK = ".jaxdist-owned"  # written once the owner holds the lock: only such are judged


def make(prefix: str, where: str | None) -> tuple[str, int]:
    """A new directory ``<where>/<prefix>*`` and the descriptor whose lock claims it.

    Keep the descriptor open for as long as the directory is in use (the launcher's life);
    closing it (or dying) gives the claim up.

    >>> path, fd = make("jaxdist-doc-", None)
    >>> os.path.exists(os.path.join(path, _MARK)), stale(path)
    (True, False)
    >>> os.close(fd); stale(path)
    True
    >>> shutil.rmtree(path)
    """
    path = tempfile.mkdtemp(prefix=prefix, dir=where)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new and private: never contended
    with open(os.path.join(path, _MARK), "w") as f:
        f.write(f"{os.getpid()}\n")
    return path, fd


def stale(path: str) -> bool:
    """Whether ``path`` is provably abandoned: marked as owned, and its owner's lock is free."""
    if not os.path.exists(os.path.join(path, _MARK)):
        return False  # not made this way (or its owner died before marking it): unprovable
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: a live job's, whatever its name says
    finally:
        os.close(fd)  # also releases the probe's lock
    return True


def remove_stale(where: str, pattern: str) -> None:
    """Removes the directories in ``where`` whose names match ``pattern`` and that are stale."""
    try:
        names = os.listdir(where)
    except OSError:
        return
    for name in names:
        path = os.path.join(where, name)
        if re.fullmatch(pattern, name) and stale(path):
            logger.info("removing %s, left by a launcher that is gone", path)
            shutil.rmtree(path, ignore_errors=True)
