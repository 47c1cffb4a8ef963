"""Orbax glue for checkpoint integrity: which step directories count, and the digests item.

Private to ``jaxdist.checkpoint``; kept apart so that the manager reads as the policy (what is
saved, verified, skipped) and this as the mechanism (Orbax's name-format and handler protocols).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import threading
from typing import Any

import orbax.checkpoint as ocp

from jaxdist.checkpoint._digest import materialize

logger = logging.getLogger("jaxdist.checkpoint")  # warnings read as the manager's


STEP_FILE = "_CHECKPOINT_METADATA"  # Orbax writes it into every step it commits


class CompleteSteps:
    """Orbax's standard step naming, listing only step directories that a save completed.

    Orbax counts any directory named by an integer as a committed step, so a stray empty ``99/``
    (a half-copied backup, an operator's ``mkdir``) would become the "latest" step and, with
    ``max_to_keep``, even make Orbax delete good steps to keep it.
    """

    def __init__(self, directory: str):
        self._std = ocp.step.standard_name_format()
        self._directory = directory
        self._warned: set[str] = set()

    def build_name(self, step: int) -> str:
        return self._std.build_name(step)

    def find_step(self, base_path, step: int):
        return self._std.find_step(base_path, step)

    def find_all(self, base_path):
        for m in self._std.find_all(base_path):
            missing = [n for n in (STEP_FILE, "state", "meta") if not (m.path / n).exists()]
            if not missing:
                yield m
            elif str(m.path) not in self._warned:
                self._warned.add(str(m.path))
                logger.warning("ignoring %s: not a complete checkpoint (no %s); remove it if it "
                               "is not yours", m.path, ", ".join(missing))


class Pending:
    """Digests that ``save`` dispatches once Orbax has copied the arrays off the devices: queued
    before that copy, their computation would delay it (and the caller) on the same devices."""

    def __init__(self):
        self._ready = threading.Event()
        self._value: Any = None

    def set(self, value: Any) -> None:
        self._value = value
        self._ready.set()

    def result(self) -> dict:
        if not self._ready.wait(timeout=600):
            raise TimeoutError("the state's digests were never dispatched (save() was interrupted)")
        if isinstance(self._value, BaseException):
            raise self._value
        return materialize(self._value)


class DigestsHandler(ocp.handlers.JsonCheckpointHandler):
    """Writes the state's digests (``{"digests", "checksum"}`` JSON) once the devices have
    computed them, in Orbax's background commit: an async ``save`` never waits for them."""

    async def _save_fn(self, x, directory):
        digests = await asyncio.to_thread(x.result)
        body = {"digests": digests}
        await super()._save_fn({**body, "checksum": meta_checksum(body)}, directory)


@ocp.args.register_with_handler(DigestsHandler, for_save=True)
@dataclasses.dataclass
class DigestsSave(ocp.args.CheckpointArgs):
    item: Any  # dispatch_digests' pending device results


@ocp.args.register_with_handler(DigestsHandler, for_restore=True)
@dataclasses.dataclass
class DigestsRestore(ocp.args.CheckpointArgs):
    item: Any = None


def meta_checksum(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
