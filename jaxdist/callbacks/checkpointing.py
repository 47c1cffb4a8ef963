"""Callbacks that write checkpoints: ``ModelCheckpoint`` (when its save policy says) and
``BackupAndRestore`` (resume an interrupted run exactly; save on a preemption notice)."""

from __future__ import annotations

import logging

import jax

from jaxdist.callbacks.core import Callback, Resume, TrainInfo
from jaxdist.checkpoint.backup import finish_saves, refuse_shared_folder
from jaxdist.checkpoint.backup import remove_backup as remove_backup
from jaxdist.checkpoint.manager import CheckpointManager
from jaxdist.checkpoint.save_policy import (
    AnyOf,
    BestMetric,
    EveryNEpochs,
    EveryNSteps,
    SaveCandidate,
    SavePolicy,
    resolve_mode,
)
from jaxdist.checkpoint.tier_policy import MemoryTierPolicy
from jaxdist.checkpoint.tiered import TieredCheckpointManager
from jaxdist.launch import heartbeat

logger = logging.getLogger(__name__)


class TrainingPreempted(SystemExit):
    """Raised (after a checkpoint is durable) when training stops for a preemption notice (SIGTERM).

    It is a ``SystemExit``: uncaught, the process exits with ``code`` (0 by default, a clean exit);
    rerunning the same command resumes from the checkpoint.
    """


class ModelCheckpoint(Callback):
    """Saves the state (and the input position) when its save policy says so (Keras semantics).

    By default a checkpoint is written at every epoch end. ``save_best_only=True`` saves only when
    ``monitor`` improves (``mode``: ``"min"``, ``"max"`` or ``"auto"``); ``save_freq=N`` (or
    ``every_n_steps=N``) also saves every N steps; ``policy=`` takes any
    ``jaxdist.callbacks.SavePolicy`` (``EveryNSteps``, ``EveryNEpochs``, ``BestMetric``,
    ``AnyOf``, or your own ``should_save(candidate, previous)``) instead. ``max_to_keep`` bounds
    the checkpoints on disk: the newest ones, or with ``keep="best"`` those with the best
    ``monitor`` (steps saved without it are kept too). A checkpoint restores for inference without a
    template: ``CheckpointManager(directory).restore()["params"]``.

    Checkpoints are named by the state's own step (``state.step``, read once when training
    begins), so a second ``fit`` that continues a state at step 12 writes 24, 36, ..., never over
    the first fit's; step periods (``save_freq=N``) count that step too. A state without an
    integer ``step`` attribute (a ``(model, optimizer)`` tuple, say) is named by ``fit``'s count.

    Args:
      directory: checkpoint directory (shared by all processes).
      monitor, mode, save_best_only: as Keras's ``ModelCheckpoint``.
      save_freq: ``"epoch"`` or an int: steps between saves (Keras's meaning).
      every_n_steps: the same as an int ``save_freq`` (kept for older code).
      save_at_epoch_end: with a step period, also save at epoch ends.
      policy: a ``SavePolicy`` overriding the options above.
      max_to_keep: checkpoints kept on disk (None: all).
      keep: ``"latest"`` or ``"best"`` (by ``monitor``).
      async_save: write in the background.

    Raises:
      ValueError: conflicting or bad options.

    >>> import tempfile
    >>> mc = ModelCheckpoint(tempfile.mkdtemp(), monitor="val_accuracy", save_best_only=True,
    ...                      max_to_keep=2, keep="best")
    >>> mc.policy
    BestMetric(monitor='val_accuracy', mode='max', min_delta=0.0, at_epoch_end=True)
    """

    def __init__(self, directory: str, *, monitor: str = "val_loss", mode: str = "auto",
                 save_best_only: bool = False, save_freq: str | int = "epoch",
                 every_n_steps: int | None = None, save_at_epoch_end: bool = True,
                 policy: SavePolicy | None = None, max_to_keep: int | None = 3,
                 keep: str = "latest", async_save: bool = True):
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1 or None, got {every_n_steps}")
        if save_freq != "epoch" and not (isinstance(save_freq, int) and save_freq >= 1):
            raise ValueError(f"save_freq={save_freq!r}; expected 'epoch' or an int >= 1 (steps)")
        if keep not in ("latest", "best"):
            raise ValueError(f"keep={keep!r}; expected 'latest' or 'best'")
        if policy is not None and save_best_only:
            raise ValueError("pass either policy= or save_best_only=True, not both (use "
                             "AnyOf(BestMetric(...), ...) to combine)")
        self.monitor = monitor
        self.mode = resolve_mode(mode, monitor)
        every = every_n_steps if every_n_steps is not None else (
            None if save_freq == "epoch" else int(save_freq))
        if policy is None:
            if save_best_only:
                policy = BestMetric(monitor, self.mode, at_epoch_end=every is None)
            else:
                parts = ([EveryNSteps(every)] if every else []) + (
                    [EveryNEpochs()] if save_at_epoch_end or every is None else [])
                policy = parts[0] if len(parts) == 1 else AnyOf(*parts)
        if not isinstance(policy, SavePolicy):
            raise TypeError(f"policy={policy!r} has no should_save(candidate, previous)")
        self.policy = policy
        self._keep_best = keep == "best"
        self.manager = CheckpointManager(directory, max_to_keep=max_to_keep, async_save=async_save,
                                         best_metric=monitor if self._keep_best else None,
                                         best_mode=self.mode)
        self._last_saved: int | None = self.manager.latest_step()
        self.saved: list[SaveCandidate] = []
        # state.step - fit's step count, read once at train begin (see on_train_begin).
        self._step_offset = 0

    @property
    def best(self) -> float | None:
        """The best ``monitor`` value among the checkpoints this callback saved (None if none)."""
        seen = [c.logs[self.monitor] for c in self.saved if self.monitor in c.logs]
        if not seen:
            return None
        return min(seen) if self.mode == "min" else max(seen)

    def on_train_begin(self, info: TrainInfo) -> None:
        # Checkpoints are named by the state's own step (the API's promise), not this fit's count: a
        # second fit continuing from a state at step 12 writes 24, not 12 over the first fit's.
        # Read once here (a host sync); a state without an integer ``step`` keeps fit's count.
        self._step_offset = _state_step(info.state, info.step) - info.step
        # A resumed run compares against what the earlier run saved (its logs are in the metadata).
        self.saved = []
        for step in self.manager.all_steps():
            try:
                user = self.manager.metadata(step).get("user") or {}
            except Exception:  # noqa: BLE001 - an unreadable old step just does not count
                continue
            self.saved.append(SaveCandidate(step=step, epoch=int(user.get("epoch", 0)),
                                            epoch_end=bool(user.get("epoch_end", False)),
                                            logs=dict(user.get("logs") or {})))

    def _candidate(self, info: TrainInfo, epoch_done: bool) -> SaveCandidate:
        return SaveCandidate(step=info.step + self._step_offset, epoch=info.epoch,
                             epoch_end=epoch_done, logs={k: float(v) for k, v in info.logs.items()},
                             steps=info.call_steps)

    def _save(self, info: TrainInfo, *, epoch_done: bool = False) -> None:
        step = info.step + self._step_offset
        if step == self._last_saved:
            return
        cand = self._candidate(info, epoch_done)
        # After an epoch ends, the next batch to train on is the first of the next epoch.
        data = ({"epoch": info.epoch + 1, "position": 0} if epoch_done
                else info.iterator.state() if info.iterator is not None else None)
        metrics = ({self.monitor: cand.logs[self.monitor]}
                   if self._keep_best and self.monitor in cand.logs else None)
        self.manager.save(step, info.state, data_state=data, metrics=metrics,
                          metadata={"logs": dict(cand.logs), "epoch": info.epoch,
                                    "epoch_end": epoch_done, "writer": type(self).__name__})
        self._last_saved = step
        self.saved.append(cand)

    def _consider(self, info: TrainInfo, epoch_done: bool) -> None:
        if info.step + self._step_offset != self._last_saved and self.policy.should_save(
                self._candidate(info, epoch_done), tuple(self.saved)):
            self._save(info, epoch_done=epoch_done)

    def on_train_batch_end(self, info: TrainInfo) -> None:
        self._consider(info, False)

    def on_epoch_end(self, info: TrainInfo) -> None:
        self._consider(info, True)

    def close(self) -> None:
        # fit calls it last, also after an error: a save still in flight then finishes (the rerun
        # resumes from it) or is reported lost in one line, rather than dying with the
        # interpreter and leaving only its temporary directory.
        finish_saves(self.manager)

    def on_train_end(self, info: TrainInfo) -> None:
        self.manager.wait_until_finished()
        if self._last_saved is not None and jax.process_index() == 0:
            from jaxdist.checkpoint.evaluator import mark_final

            # A side-car evaluator (jaxdist evaluate --watch) stops after this step.
            mark_final(self.manager.directory, self._last_saved)


def _state_step(state, default: int) -> int:
    """``state.step`` as an int (flax's ``TrainState`` and its kind), else ``default``."""
    import numpy as np

    step = getattr(state, "step", None)
    try:
        value = np.asarray(jax.device_get(step))
    except Exception:  # noqa: BLE001 - not an array (a method, None): no step of its own
        return default
    return int(value) if value.ndim == 0 and value.dtype.kind in "iu" else default


class BackupAndRestore(Callback):
    """Resumes an interrupted ``fit`` exactly where its last backup left it; saves on SIGTERM.

    At the start of training, if ``directory`` holds a backup, the state, the step counter and the
    input position (epoch and batch) are restored from the newest backup that restores intact
    (newer ones that are corrupt or incomplete are skipped with a warning), so the resumed run sees
    exactly the batches the uninterrupted one would have, and ends with the same parameters.

    Under ``jaxdist launch`` (or with ``JAXDIST_STATE_DIR`` set) there is also an in-memory tier
    (``jaxdist.checkpoint.InMemoryTier``): every few steps (as often as its cost budget allows: every
    step for small states) the state and input position are copied to host shared memory in the
    background, and a restarted job resumes from the newest step the job's processes hold (put
    together over the network when hosts changed), so a failure costs at most the few steps the
    tier announces; the backups in ``directory`` are used when they are newer or the memory tier is
    gone. A memory copy is resumed only by a run of the job that made it: a run starting from
    nothing records a new identity in ``directory`` (``.jaxdist-job.json``, removed with the
    backups) and beside its copies, so that a kept ``JAXDIST_STATE_DIR`` is not resumed once
    ``directory`` was removed or another training started there (one warning; the tier is off for
    that run, leaving the copy intact). On a preemption notice (SIGTERM; agreed across processes),
    or a stop the elastic agents agreed on, the tier and a backup are written at the next step
    boundary, made durable, and ``TrainingPreempted`` ends the process cleanly.

    A thin callback over :class:`jaxdist.checkpoint.TieredCheckpointManager` (``tiered``): every
    choice between the two tiers is that manager's, and a custom loop gets the same by calling it
    (``docs/guides/fault_tolerance.md``, "Custom loops").

    Args:
      directory: backup directory (shared by all processes).
      every_n_steps: backup period in steps (None: epoch ends only).
      delete_checkpoint: remove the backups when ``fit`` completes (Keras's name and default), so
        that running the same script again trains again; ``False`` keeps them (a rerun then
        restores the final state and says there is nothing left to train). Only what the
        callback wrote is removed (its step folders, Orbax's temporary folders, its marker
        files, the job's identity); the folder itself goes only when nothing else is left in it.
      delete_on_success: the older name of ``delete_checkpoint`` (it wins when given).
      preemption_exit_code: exit status after a preemption save.
      memory_tier: how often the in-memory tier copies (``jaxdist.checkpoint.MemoryTierPolicy``:
        ``every``, ``budget``, ``enabled``); None: as the environment says
        (``JAXDIST_MEMORY_TIER``, ``..._EVERY``, ``..._BUDGET``; by default measured, 5%).

    Raises:
      ValueError: ``directory`` is the working directory, the home directory, or a folder that
        holds the working directory or the running script (a backup needs a folder of its own).

    >>> import tempfile
    >>> b = BackupAndRestore(tempfile.mkdtemp(), memory_tier=MemoryTierPolicy(every=2))
    >>> b.memory_tier
    MemoryTierPolicy(every=2, budget=0.05, enabled=True)
    """

    def __init__(self, directory: str, *, every_n_steps: int | None = None,
                 delete_checkpoint: bool = True, delete_on_success: bool | None = None,
                 preemption_exit_code: int = 0, memory_tier: MemoryTierPolicy | None = None):
        refuse_shared_folder(directory, type(self).__name__)
        self.tiered = TieredCheckpointManager(directory, every_n_steps=every_n_steps,
                                              memory_tier=memory_tier, writer=type(self).__name__)
        self._delete = delete_checkpoint if delete_on_success is None else delete_on_success
        self._exit_code = preemption_exit_code
        self.restored_step: int | None = None
        self.restored_from: str | None = None  # "memory" or "backup"

    # The callback's attributes are the manager's own (one state, read and set through either).
    manager = property(lambda self: self.tiered.backup, doc="The backup's ``CheckpointManager``.")
    memory_tier = property(lambda self: self.tiered.memory_tier,
                           doc="The in-memory tier's policy (``MemoryTierPolicy``).")
    memory_step = property(lambda self: self.tiered.memory_step,
                           doc="The in-memory tier's newest step at the start (None: it held none).")

    @property
    def memory(self):
        """The in-memory tier (``jaxdist.checkpoint.InMemoryTier``)."""
        return self.tiered.memory

    @memory.setter
    def memory(self, tier) -> None:
        self.tiered.memory = tier

    @property
    def policy(self) -> SavePolicy:
        """When the backup saves (``AnyOf(EveryNSteps(every_n_steps), EveryNEpochs())``)."""
        return self.tiered.policy

    @policy.setter
    def policy(self, policy: SavePolicy) -> None:
        self.tiered.policy = policy

    @property
    def saved(self) -> list[SaveCandidate]:
        """The backups this ``fit`` saved, oldest first."""
        return self.tiered.saved

    @saved.setter
    def saved(self, saved: list[SaveCandidate]) -> None:
        self.tiered.saved = saved

    def on_train_begin(self, info: TrainInfo) -> Resume | None:
        found = self.tiered.restore_latest(info.state, info.strategy)
        if found is None:
            beat = heartbeat.current()
            if beat is not None:  # the launcher counts steps from where this run starts
                beat.set_step(info.step)
            return None
        self.restored_step, self.restored_from = found.step, found.source
        data = found.position or {}
        return Resume(state=found.state, step=found.step, epoch=data.get("epoch", info.epoch),
                      position=data.get("position", 0),
                      source=f"memory:{found.step}" if found.source == "memory" else found.step)

    def on_train_batch_end(self, info: TrainInfo) -> None:
        position = info.iterator.state() if info.iterator is not None else None
        if self.tiered.should_stop(info.step, steps=info.call_steps):
            self.tiered.stop(info.step, info.state, position, epoch=info.epoch, logs=info.logs)
            # A stop the elastic agents agreed on re-forms the job (status 0); a preemption
            # exits with the status asked for. fit's cleanup calls close().
            raise TrainingPreempted(0 if self.tiered.stop_reason == "reform" else self._exit_code)
        self.tiered.save(info.step, info.state, position, epoch=info.epoch, logs=info.logs,
                         steps=info.call_steps)

    def on_epoch_end(self, info: TrainInfo) -> None:
        # After an epoch ends, the next batch to train on is the first of the next epoch.
        self.tiered.save(info.step, info.state, {"epoch": info.epoch + 1, "position": 0},
                         epoch=info.epoch, epoch_end=True, logs=info.logs, steps=info.call_steps)

    def on_train_end(self, info: TrainInfo) -> None:
        # delete: Keras's default, the run is complete, so a rerun starts afresh rather than
        # restore a final state and train nothing; in both tiers (a kept state directory, too).
        # Unlike Keras, only what this callback wrote goes.
        self.tiered.finish(delete=self._delete)

    def close(self) -> None:
        # fit calls it last, also after an error: a save still in flight then finishes (the rerun
        # resumes from it) or is reported lost in one line.
        self.tiered.close()
