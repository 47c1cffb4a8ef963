"""One manager over both fault-tolerance tiers: the in-memory copy and the persistent backup.

Under ``jaxdist launch`` a job keeps two copies of its state: recent steps in host memory
(:class:`~jaxdist.checkpoint.InMemoryTier`: cheap, every few steps, gone with the host) and
a persistent Orbax backup (:class:`~jaxdist.checkpoint.manager.CheckpointManager`: durable, as
often as its save policy says). :class:`TieredCheckpointManager` holds both and makes every
choice between them, so that ``fit`` (its ``BackupAndRestore`` callback asks this manager) and a
custom loop (which calls it directly) get the same:

* ``save`` after each step: each tier decides by its own policy (the memory tier's measured
  cadence, :class:`~jaxdist.checkpoint.MemoryTierPolicy`; the backup's
  :class:`~jaxdist.checkpoint.save_policy.SavePolicy`, by default every N steps and at epoch ends);
* ``restore_latest`` at the start: the newer of the memory copy and the backup, said in one log
  line with the reason. The memory copy counts only when it is this job's: a run that starts
  from nothing records a new identity (a random token) in the backup folder, a resumed run keeps
  the folder's, and the memory tier records it beside its snapshots; a copy whose identity the
  folder does not hold (the folder was removed, or another training started there since) is
  not resumed, and the tier is off for that run so that the copy stays intact;
* ``should_stop`` after each step: a preemption notice (SIGTERM) or the stop step the elastic
  launcher's agents agreed on; ``stop`` then saves that step in both tiers and waits until both
  are written, so the process may exit having lost nothing;
* ``finish`` when training completes (removing both tiers' copies with ``delete=True``) and
  ``close``.

One vocabulary for both tiers, ``CheckpointManager``'s: ``save``, ``restore_latest``,
``wait_until_finished`` (the memory tier's newest copy written, the backup's saves durable).

Multi-process contract: every process makes the manager with the same directory and calls each
method for the same steps in the same order; ``restore_latest``, ``save``, ``stop`` and ``finish``
synchronise internally (the backup's saves, the memory tier's resume), and ``should_stop`` gives
every process the same answer.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

import jax

from jaxdist.checkpoint._assemble import allgather_json
from jaxdist.checkpoint.backup import (
    finish_saves,
    read_job,
    refuse_shared_folder,
    remove_backup,
    write_job,
)
from jaxdist.checkpoint.evaluator import mark_final
from jaxdist.checkpoint.manager import CheckpointManager
from jaxdist.checkpoint.memstate import InMemoryTier
from jaxdist.checkpoint.preemption import PreemptionNotice
from jaxdist.checkpoint.save_policy import AnyOf, EveryNEpochs, EveryNSteps, SaveCandidate, SavePolicy
from jaxdist.checkpoint.tier_policy import MemoryTierPolicy
from jaxdist.core import PyTree
from jaxdist.launch import heartbeat

if TYPE_CHECKING:
    from jaxdist.strategy.base import Strategy

logger = logging.getLogger(__name__)

TIERS = ("memory", "backup")
"""The tiers' names, as ``save`` reports them and ``TieredRestored.source`` gives them."""


class TieredRestored(NamedTuple):
    """What :meth:`TieredCheckpointManager.restore_latest` returns.

    Attributes:
      step: the completed step the state belongs to.
      state: the train state, placed like the target (or the strategy's way).
      position: the input position after that step, as ``save`` got it (``iterator.state()``:
        ``{"epoch": E, "position": P}``), or None.
      source: ``"memory"`` or ``"backup"``: the tier it came from.
    """

    step: int
    state: PyTree
    position: dict | None
    source: str


class TieredCheckpointManager:
    """The in-memory tier and the persistent backup under one manager (see the module's docstring).

    Args:
      directory: the backup folder, shared by all processes (``backup`` is a
        ``CheckpointManager(directory, max_to_keep=max_to_keep)`` over it).
      every_n_steps: back up every N steps too (None: at epoch ends, ``save(..., epoch_end=True)``,
        and stops only).
      policy: a :class:`~jaxdist.checkpoint.save_policy.SavePolicy` for the backup instead
        (``EveryNSteps``, ``AnyOf``, your own ``should_save(candidate, previous)``).
      memory_tier: the memory tier's policy (``MemoryTierPolicy(every=, budget=, enabled=)``); None: as
        the environment says (``JAXDIST_MEMORY_TIER``, ``..._EVERY``, ``..._BUDGET``).
      memory: a :class:`~jaxdist.checkpoint.InMemoryTier` of your own instead (default: this
        host's state directory under ``jaxdist launch``; outside it the memory tier is off).
      max_to_keep: backups kept on disk.
      writer: the name each backup's metadata records as its writer; ``finish(delete=True)``
        removes the steps that name it (and those this run saved or restored).

    Raises:
      ValueError: ``every_n_steps`` below 1, both ``every_n_steps`` and ``policy``, both
        ``memory`` and ``memory_tier``, or ``directory`` is the working directory, the home
        directory or a folder that holds them (a backup needs a folder of its own).
      TypeError: ``policy`` has no ``should_save``, or ``memory_tier`` is not a ``MemoryTierPolicy``.

    >>> import os, tempfile, jax.numpy as jnp
    >>> from jaxdist.memstate import InMemoryTier
    >>> folder = tempfile.TemporaryDirectory()
    >>> def manager():  # under `jaxdist launch`: TieredCheckpointManager(backup_dir, ...)
    ...     return TieredCheckpointManager(
    ...         os.path.join(folder.name, "backup"), every_n_steps=2,
    ...         memory=InMemoryTier(os.path.join(folder.name, "state"), rank=0, every=1))
    >>> with manager() as ckpt:
    ...     state = {"w": jnp.zeros(2)}
    ...     for step in range(1, 4):
    ...         state = {"w": state["w"] + 1.0}
    ...         print(step, ckpt.save(step, state, {"epoch": 0, "position": step}))
    1 ('memory',)
    2 ('memory', 'backup')
    3 ('memory',)
    >>> with manager() as ckpt:  # a restart: memory holds step 3, the backup step 2
    ...     r = ckpt.restore_latest({"w": jnp.zeros(2)})
    ...     ckpt.finish(delete=True)  # completed: neither tier keeps a copy
    >>> r.step, r.source, r.position, r.state["w"].tolist()
    (3, 'memory', {'epoch': 0, 'position': 3}, [3.0, 3.0])
    >>> os.path.exists(os.path.join(folder.name, "backup"))
    False
    >>> folder.cleanup()
    """

    def __init__(self, directory: str | os.PathLike, *,
                 every_n_steps: int | None = None, policy: SavePolicy | None = None,
                 memory_tier: MemoryTierPolicy | None = None, memory: InMemoryTier | None = None,
                 max_to_keep: int | None = 2, writer: str = "TieredCheckpointManager"):
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1 or None, got {every_n_steps}")
        if policy is not None and every_n_steps is not None:
            raise ValueError("pass either every_n_steps= or policy= (AnyOf(EveryNSteps(n), ...) "
                             "combines them), not both")
        if policy is None:
            policy = AnyOf(*([EveryNSteps(every_n_steps)] if every_n_steps else []), EveryNEpochs())
        if not isinstance(policy, SavePolicy):
            raise TypeError(f"policy={policy!r} has no should_save(candidate, previous)")
        if memory is not None and memory_tier is not None:
            raise ValueError("pass either memory= (a InMemoryTier) or memory_tier= (its policy), not both")
        if memory_tier is not None and not isinstance(memory_tier, MemoryTierPolicy):
            raise TypeError(f"memory_tier={memory_tier!r}: expected jaxdist.checkpoint.MemoryTierPolicy("
                            "every=..., budget=..., enabled=...)")
        refuse_shared_folder(directory, type(self).__name__)
        self.backup = CheckpointManager(directory, max_to_keep=max_to_keep)
        self.policy: SavePolicy = policy
        self.writer = writer
        self.memory_tier = (None if memory is not None
                            else memory_tier if memory_tier is not None else MemoryTierPolicy.from_env())
        self.memory = memory if memory is not None else InMemoryTier(policy=self.memory_tier)
        # The tier's snapshots belong to this job, the one that backs up here: a kept state
        # directory of another training is refused rather than resumed from.
        where = os.fspath(directory)
        self.memory.owner = where if "://" in where else os.path.realpath(where)
        self.saved: list[SaveCandidate] = []  # the backups this run saved, oldest first
        self.last_saved: int | None = self.backup.latest_step()
        self.restored: TieredRestored | None = None
        self.memory_step: int | None = None  # the memory tier's newest step at restore_latest
        self.stop_reason: str | None = None  # "preemption" or "reform", once should_stop said so
        self._notice = PreemptionNotice()

    @property
    def directory(self) -> str:
        """The backup folder."""
        return self.backup.directory

    # --- saving --------------------------------------------------------------------------------

    def save(self, step: int, state: PyTree, position: Mapping | None = None, *, force: bool = False,
             epoch: int | None = None, epoch_end: bool = False, logs: Mapping | None = None,
             steps: int = 1) -> tuple[str, ...]:
        """Offers ``step`` to both tiers; each saves when its policy says so (both with ``force``).

        Call it on every process after each step. It returns at once: the memory tier's copy
        and the backup's write go on in the background (the next step may donate ``state``).

        Args:
          step: optimizer steps completed (the backup's name for this step).
          state: the train state after that step.
          position: the input position after that step, ``iterator.state()``
            (``{"epoch": E, "position": P}``): what ``restore_latest`` gives back.
          force: save in both tiers whatever their policies say.
          epoch: the epoch of the step, for the backup's policy and metadata (default: the
            position's epoch, else 0).
          epoch_end: the step ends an epoch (``EveryNEpochs`` saves there); offered to the backup
            only, the memory tier having had the step after its batch.
          logs: the metrics known at the step (``BestMetric`` reads them; saved with a backup).
          steps: the steps since the previous call (``fit``'s ``steps_per_execution=K``: ``K``).

        Returns:
          The tiers that saved, of ``("memory", "backup")``.
        """
        backup = self._offer_backup(step, state, position, force=force, epoch=epoch,
                                    epoch_end=epoch_end, logs=logs, steps=steps)
        memory = not epoch_end and bool(self.memory.save(step, state, position, force=force))
        return tuple(t for t, done in zip(TIERS, (memory, backup)) if done)

    def _offer_backup(self, step: int, state: PyTree, position: Mapping | None, *, force: bool,
                      epoch: int | None, epoch_end: bool, logs: Mapping | None,
                      steps: int) -> bool:
        if step == self.last_saved:
            return False
        if epoch is None:
            epoch = int((position or {}).get("epoch", 0))
        candidate = SaveCandidate(step=int(step), epoch=epoch, epoch_end=epoch_end,
                                  logs={k: float(v) for k, v in (logs or {}).items()}, steps=steps)
        if not force and not self.policy.should_save(candidate, tuple(self.saved)):
            return False
        self.backup.save(step, state, data_state=None if position is None else dict(position),
                         metadata={"logs": dict(candidate.logs), "epoch": epoch,
                                   "epoch_end": epoch_end, "writer": self.writer})
        self.last_saved = step
        self.saved.append(candidate)
        return True

    def wait_until_finished(self) -> None:
        """Writes the memory tier's newest copy and waits until the backup's saves are durable."""
        self.memory.flush()
        self.backup.wait_until_finished()

    # --- restoring -----------------------------------------------------------------------------

    def restore_latest(self, target: PyTree, strategy: "Strategy | None" = None
                       ) -> TieredRestored | None:
        """The newer of the memory tier's copy and the backup, with its input position; None if
        neither holds a step. One log line says which tier and why.

        Call it on every process at the start of training (a collective). It also starts
        listening for a preemption notice (SIGTERM) and, under ``jaxdist launch``, sets the
        launcher's step count to the step resumed from.

        Args:
          target: a state with the saved one's structure, shapes and dtypes (values unused),
            placed as the restored state should be.
          strategy: place the result the strategy's way (default: like ``target``).

        Raises:
          CheckpointMismatchError, StateMismatchError: ``target`` is another model's state.
          CheckpointError: the backup holds steps and none of them restores.
        """
        self._notice.install()
        self.saved, self.restored = [], None
        recorded, fresh = self._identities()
        self.memory.job = recorded  # the memory copy is resumed only when it records this one
        snap = self.memory.resume(target, strategy)
        disk = self.backup.latest_step()
        self.memory_step = snap.step if snap is not None else None
        if snap is not None and (disk is None or snap.step >= disk):
            why = f"the backup's newest step is {'none' if disk is None else disk}"
            restored = TieredRestored(snap.step, snap.state, snap.data_state, "memory")
        else:
            found = self.backup.restore_latest(target=target, strategy=strategy)
            if snap is not None and (found is None or found.step < snap.step):
                # newer backups did not restore intact: the memory copy is the newer one now
                why = f"the backup's newest intact step is {found.step if found else 'none'}"
                restored = TieredRestored(snap.step, snap.state, snap.data_state, "memory")
            elif found is None:
                self._adopt(fresh, recorded)  # a fresh start: a new job
                return None
            else:
                why = (f"newer than the in-memory tier's newest step ({snap.step})" if snap
                       else "the in-memory tier holds no step" if self.memory.enabled
                       else "no in-memory tier (outside `jaxdist launch`, or switched off)")
                restored = TieredRestored(found.step, found.state, found.metadata.get("data"),
                                          "backup")
        self._adopt(recorded or fresh, recorded)  # a resumed job keeps its identity
        data = restored.position or {}
        logger.info("restored step %d from %s (epoch %d, batch %d): %s", restored.step,
                    restored.source, data.get("epoch", 0), data.get("position", 0), why)
        beat = heartbeat.current()
        if beat is not None:  # the launcher counts steps from where this run starts
            beat.set_step(restored.step)
        self.restored = restored
        return restored

    def _identities(self) -> tuple[str | None, str]:
        """The job identity the backup folder records (None: none) and a new one, as process 0
        has them (one collective with several processes), so that every process decides alike
        whatever it sees of the folder."""
        mine = [read_job(self.directory) if jax.process_index() == 0 else None,
                secrets.token_hex(16)]
        recorded, fresh = allgather_json(mine)[0]
        return recorded, fresh

    def _adopt(self, job: str, recorded: str | None) -> None:
        """Makes ``job`` this run's identity: process 0 records it in the backup folder (before
        the first step, so that a job failing before its first backup has it too; ``remove_backup``
        removes it with the backups), the memory tier beside its snapshots at its first save."""
        if job != recorded and jax.process_index() == 0:
            write_job(self.directory, job)
        self.memory.job = job

    # --- stopping ------------------------------------------------------------------------------

    def should_stop(self, step: int, *, steps: int = 1) -> bool:
        """Whether training stops after ``step``: every process gets the same answer.

        True at the stop step the elastic launcher's agents agreed on (a host leaving or
        joining; ``stop_reason`` is then ``"reform"``), or when a preemption notice (SIGTERM) was
        agreed on for one of the ``steps`` steps up to ``step`` (``"preemption"``). Call it on
        every process after each step, then :meth:`stop` when it says so.

        Args:
          step: optimizer steps completed.
          steps: the steps since the previous call (``fit``'s ``steps_per_execution=K``: ``K``):
            each is offered to JAX's preemption sync point, and the launcher's stop step is
            honoured at the first call that reaches it.

        Raises:
          RuntimeError: the launcher's stop step was passed before this call: handled as a
            failure (the job resumes from memory).
        """
        self._notice.install()
        stop = self.memory.stop_step()
        if stop is not None and step >= stop:
            if step - steps >= stop:
                raise RuntimeError(f"the launcher asked to stop at step {stop}, seen only at step "
                                   f"{step}; handled as a failure (resumes from memory)")
            logger.info("stopping at step %d to re-form the job", stop)
            self.stop_reason = "reform"
            return True
        # Every step is offered, in order (a list, not a generator: none is skipped), since
        # JAX's preemption sync point is one step.
        if any([self._notice.reached(s) for s in range(step - steps + 1, step + 1)]):
            self.stop_reason = "preemption"
            return True
        return False

    def stop(self, step: int, state: PyTree, position: Mapping | None = None, *,
             epoch: int | None = None, logs: Mapping | None = None) -> tuple[str, ...]:
        """Saves ``step`` in both tiers and waits until both are written; the caller may then exit.

        The memory tier's copy is forced and written (a job re-formed at this step resumes from
        it), the backup is saved (unless this step already is) and made durable.

        Args:
          step, state, position, epoch, logs: as for :meth:`save`.

        Returns:
          The tiers that saved in this call.
        """
        memory = bool(self.memory.save(step, state, position, force=True))
        self.memory.flush()
        backup = self._offer_backup(step, state, position, force=True, epoch=epoch,
                                    epoch_end=False, logs=logs, steps=1)
        self.backup.wait_until_finished()
        return tuple(t for t, done in zip(TIERS, (memory, backup)) if done)

    # --- ending --------------------------------------------------------------------------------

    def finish(self, delete: bool = True) -> None:
        """Training completed: waits for the backup's saves, marks the final step for a side-car
        evaluator, and with ``delete`` removes both tiers' copies, so that running the same job
        again trains again (Keras's ``BackupAndRestore(delete_checkpoint=True)``).

        Only what this manager's writer wrote (or this run saved or restored) is removed from the
        backup folder, and the folder only when nothing else is left in it. Every process calls
        it (each discards its own memory copies and reads the backup's steps; process 0 removes
        them).
        """
        self.backup.wait_until_finished()
        if self.last_saved is not None and jax.process_index() == 0:
            mark_final(self.backup.directory, self.last_saved)  # a side-car evaluator stops here
        if delete:
            self.memory.discard()
            ours = {c.step for c in self.saved} | (
                {self.restored.step} if self.restored is not None else set())
            remove_backup(self.backup, ours, writer=self.writer)  # every process: it reads

    def close(self) -> None:
        """Waits for saves in flight (at most ``jaxdist.checkpoint.backup.FINISH_S``, reporting a
        failure in one line rather than raising it), writes the memory tier's newest copy and
        stops listening for SIGTERM. Call it also when training failed (``with
        TieredCheckpointManager(...) as ckpt:`` does). ``backup`` stays readable
        (``ckpt.backup.restore(...)``); its claim on the folder ends with the process."""
        try:
            finish_saves(self.backup)
        finally:
            self._notice.uninstall()
            self.memory.close()

    def __enter__(self) -> TieredCheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
