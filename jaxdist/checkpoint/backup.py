"""What a run does with its backup folder: refuse a folder that holds the user's work, record the
job's identity there, wait for the saves in flight at the end, and remove what it wrote when it
completes.

``TieredCheckpointManager`` (and through it ``BackupAndRestore``) uses these; ``ModelCheckpoint``
waits for its saves with :func:`finish_saves` too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import threading
from collections.abc import Collection

import jax

from jaxdist.checkpoint.evaluator import FINAL_MARKER
from jaxdist.checkpoint.manager import OWNER_FILE, CheckpointManager

logger = logging.getLogger(__name__)

FINISH_S = 120.0
"""How long an ending run waits for a save in flight (its peers may be gone)."""

JOB_FILE = ".jaxdist-job.json"
"""The job's identity in its backup folder (``{"job": token}``): the in-memory tier's copy is
resumed only by a run whose folder holds the token recorded beside that copy."""


def read_job(directory: str | os.PathLike) -> str | None:
    """The job identity recorded in the backup folder ``directory``, or None (none recorded, or
    unreadable: either way no memory copy is provably this folder's).

    >>> import tempfile
    >>> d = tempfile.mkdtemp(); write_job(d, "3f2a"); read_job(d)
    '3f2a'
    """
    try:
        with open(os.path.join(os.fspath(directory), JOB_FILE), "rb") as f:
            job = json.loads(f.read())["job"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return job if isinstance(job, str) else None


def write_job(directory: str | os.PathLike, job: str) -> None:
    """Records ``job`` as the identity of the job backing up to ``directory`` (process 0, before
    the first step, so that a job failing before its first backup has it too). A folder that
    cannot be written is one warning: its memory copies are then not resumed, nothing else."""
    path = os.path.join(os.fspath(directory), JOB_FILE)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        os.makedirs(os.fspath(directory), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump({"job": job}, f)
        os.replace(tmp, path)  # atomic: a reader never sees half a token
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        logger.warning("could not record the job's identity in %s (%s): a restart resumes from "
                       "the backup, not from the in-memory copy; make the folder writable",
                       directory, e.strerror or e)


def refuse_shared_folder(directory: str | os.PathLike, who: str = "BackupAndRestore") -> None:
    """Raises when ``directory`` is a folder a backup must not own (its cleanup would sit among
    the user's own files): the working directory, the home directory, or any folder holding the
    working directory or the running script.

    Args:
      directory: the backup folder asked for (a URL, ``gs://...``, is not checked).
      who: the class to name in the message.

    Raises:
      ValueError: naming the folder, what it holds, and a folder of its own to use instead.

    >>> refuse_shared_folder(".")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: BackupAndRestore('.'): that folder (...) is the working directory; a backup needs ...
    """
    if "://" in str(directory):
        return
    path = os.path.realpath(os.fspath(directory) or ".")
    cwd = os.path.realpath(os.getcwd())
    script = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-m") else None
    places = [("the working directory", cwd), ("the home directory",
                                               os.path.realpath(os.path.expanduser("~")))]
    if script and os.path.exists(script):
        places.append(("the folder of the running script", os.path.dirname(os.path.realpath(script))))
    for what, place in places:
        if place == path or place.startswith(path.rstrip(os.sep) + os.sep):
            how = "is" if place == path else "holds"
            raise ValueError(
                f"{who}({os.fspath(directory)!r}): that folder ({path}) {how} {what}; "
                f"a backup needs a folder of its own, e.g. {who}('backup') or "
                "os.path.join(out_dir, 'backup')")


def remove_backup(manager: CheckpointManager, ours: Collection, *,
                  writer: str = "BackupAndRestore") -> None:
    """Removes what a backup's writer wrote to ``manager.directory``, and nothing else.

    Removed: complete step folders whose metadata names ``writer`` as their writer or whose step
    is in ``ours`` (saved or restored by this run), Orbax's temporary folders, the owner lock, the
    job's identity (:data:`JOB_FILE`) and the final-step marker. Anything else (the user's files,
    a step another callback wrote, a damaged step moved aside) stays, and so does the folder then,
    in one log line naming what is left.

    Every process calls it, with the same ``ours``: reading a step's metadata is a collective in
    Orbax (a barrier after each read), so process 0 alone would wait there for ever; process 0
    removes, once every process has read.
    """
    directory = manager.directory
    doomed = []
    for step in manager.all_steps():
        try:
            wrote = (manager.metadata(step).get("user") or {}).get("writer")
        except Exception:  # noqa: BLE001 - unreadable: not provably ours, kept
            wrote = None
        if wrote == writer or step in ours:
            doomed.append(step)
    if jax.process_index() != 0:
        return
    for step in doomed:
        shutil.rmtree(os.path.join(directory, manager.step_name(step)), ignore_errors=True)
    names = os.listdir(directory) if os.path.isdir(directory) else []
    for name in names:
        if ".orbax-checkpoint-tmp" in name:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
        elif name in (OWNER_FILE, FINAL_MARKER, JOB_FILE):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(directory, name))
    left = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    if left:
        logger.info("backup removed from %s; the folder stays: it holds %d thing(s) the backup did "
                    "not write (%s)", directory, len(left), ", ".join(left[:5]))
    else:
        with contextlib.suppress(OSError):
            os.rmdir(directory)


def finish_saves(manager: CheckpointManager, timeout_s: float | None = None) -> None:
    """Waits (at most ``timeout_s``, default :data:`FINISH_S`) for ``manager``'s saves in flight;
    a save that fails or does not finish is reported in one warning line, never raised (over the
    error that ended training, say)."""
    failed: list[BaseException] = []

    def wait() -> None:
        try:
            manager.wait_until_finished()
        except BaseException as e:  # noqa: BLE001 - reported below, in one line
            failed.append(e)
    waiter = threading.Thread(target=wait, name="jaxdist-finish-saves", daemon=True)
    waiter.start()
    limit = FINISH_S if timeout_s is None else timeout_s
    waiter.join(limit)
    if waiter.is_alive():
        logger.warning("a checkpoint save in %s did not finish within %g s (a peer process "
                       "gone?); that step is lost, the rerun resumes from an older one",
                       manager.directory, limit)
    elif failed:
        logger.warning("%s", str(failed[0]).splitlines()[0] if str(failed[0]) else failed[0])
