"""Ending every process a job started, including daemons that left its process groups.

A rank's child that calls ``setsid`` (a daemon, a server it started) leaves the rank's session, so
killing the rank's process group misses it; it is reparented to PID 1 (or to the nearest
*subreaper*) and may keep the launcher's output pipes open. Two mechanisms close that gap:

* every process of a job carries ``JAXDIST_LAUNCH_ID=<token>`` in its environment, which its
  descendants inherit; :func:`kill_tagged` finds them all in ``/proc`` and kills them;
* the command-line launcher marks itself a child subreaper (``PR_SET_CHILD_SUBREAPER``, Linux), so
  orphaned descendants become its children; :func:`kill_children` kills and reaps them when a
  group ends (those that cleared their environment too), rather than leaving them to PID 1.

A descendant that clears its environment *and* is still parented under a live process of another
tree, or one left when the launcher itself is SIGKILLed, is out of reach short of cgroups; that is
documented, not handled. Linux only (``/proc``); elsewhere these are no-ops.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

logger = logging.getLogger(__name__)

ENV_LAUNCH_ID = "JAXDIST_LAUNCH_ID"
"""The environment variable that tags every process of one launch (inherited by descendants)."""


def become_subreaper() -> bool:
    """Makes orphaned descendants of this process its children (Linux); returns whether it did.

    >>> isinstance(become_subreaper(), bool)
    True
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER


def tagged_pids(token: str) -> list[int]:
    """The processes (other than this one) whose environment has ``JAXDIST_LAUNCH_ID=token``.

    >>> tagged_pids("no-such-token")
    []
    """
    if not os.path.isdir("/proc"):
        return []
    needle = f"{ENV_LAUNCH_ID}={token}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:
            continue  # gone, or not ours to read
    return found


def _kill_in_rounds(find, rounds: int) -> list[int]:
    """SIGKILLs what ``find()`` lists, up to ``rounds`` times, reaping those that are our children.

    A reparented orphan is our child once we are a subreaper: unreaped, it would stay a zombie.
    """
    killed: list[int] = []
    for _ in range(rounds):
        pids = [p for p in find() if p not in killed]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in set(pids) & set(killed):
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass  # not ours: its own parent reaps it
    return killed


def kill_tagged(token: str, rounds: int = 3) -> list[int]:
    """SIGKILLs every process tagged with ``token`` and reaps the ones that are our children.

    A few rounds catch a process forked while the previous round ran.

    Returns:
      The pids killed.
    """
    killed = _kill_in_rounds(lambda: tagged_pids(token), rounds)
    if killed:
        logger.info("killed %d leftover process(es) of the job: %s", len(killed), killed)
    return killed


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first, then the parent's
    pid, ...); None when the process is gone or there is no ``/proc``.

    The name is cut at its last ``)``: it may itself hold spaces and parentheses.

    >>> import os, sys
    >>> sys.platform != "linux" or stat_fields(os.getpid())[1] == str(os.getppid())
    True
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _children() -> list[int]:
    me = str(os.getpid())
    return [int(name) for name in os.listdir("/proc")
            if name.isdigit() and (fields := stat_fields(name)) and fields[1:2] == [me]]


def kill_children(rounds: int = 3) -> list[int]:
    """SIGKILLs and reaps every remaining child of this process.

    For a subreaper whose own children have all ended: what is left are orphans it adopted
    (daemons of the job, whatever their environment). A few rounds catch the orphans of a
    killed orphan, which are adopted in turn.

    Returns:
      The pids killed.
    """
    if not os.path.isdir("/proc"):
        return []
    killed = _kill_in_rounds(_children, rounds)
    if killed:
        logger.info("killed %d leftover child process(es) of the launcher: %s", len(killed),
                    killed)
    return killed
