"""TieredCheckpointManager: each tier saves by its own policy, a restart resumes from the newer
copy and says why in one line, a stop saves and waits for both tiers, a finished run leaves none."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal

import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist.checkpoint import CheckpointManager, InMemoryTier, MemoryTierPolicy, TieredCheckpointManager
from jaxdist.launch import write_stop


def _manager(tmp_path, **kw):
    memory = None if "memory_tier" in kw else InMemoryTier(str(tmp_path / "state"), rank=0, every=1)
    return TieredCheckpointManager(str(tmp_path / "backup"), memory=memory, **kw)


def _train(ckpt, steps, start=0):
    state = {"w": jnp.full(2, float(start))}
    saved = {}
    for step in range(start + 1, start + steps + 1):
        state = {"w": state["w"] + 1.0}
        saved[step] = ckpt.save(step, state, {"epoch": 0, "position": step})
    return state, saved


def _like():
    return {"w": jnp.zeros(2)}


def _jobs(tmp_path):
    """The job identity the backup folder records and the one beside the memory copy."""
    def read(path):
        try:
            return json.loads(path.read_text()).get("job")
        except FileNotFoundError:
            return None
    return read(tmp_path / "backup" / ".jaxdist-job.json"), read(tmp_path / "state" / "owner.json")


def test_each_tier_saves_by_its_own_policy(tmp_path):
    with _manager(tmp_path, every_n_steps=2) as ckpt:
        _, saved = _train(ckpt, 4)
        # an epoch end is the backup's to take: the memory tier had the step after its batch
        at_end = ckpt.save(4, {"w": jnp.ones(2)}, {"epoch": 1, "position": 0}, epoch=0,
                           epoch_end=True)
        again = ckpt.save(5, {"w": jnp.ones(2)}, None, force=True)
    assert saved == {1: ("memory",), 2: ("memory", "backup"), 3: ("memory",),
                     4: ("memory", "backup")}
    assert at_end == () and again == ("memory", "backup")  # 4 is backed up already
    assert ckpt.backup.all_steps() == [4, 5] and [c.step for c in ckpt.saved] == [2, 4, 5]
    assert ckpt.backup.metadata(4)["user"]["writer"] == "TieredCheckpointManager"


def test_restore_latest_takes_the_newer_copy_and_says_which_and_why(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="jaxdist.checkpoint.tiered")
    with _manager(tmp_path, every_n_steps=2) as ckpt:
        assert ckpt.restore_latest(_like()) is None  # a fresh start
        _train(ckpt, 3)
    with _manager(tmp_path, every_n_steps=2) as ckpt:
        r = ckpt.restore_latest(_like())
    assert (r.step, r.source, r.position) == (3, "memory", {"epoch": 0, "position": 3})
    assert r.state["w"].tolist() == [3.0, 3.0] and ckpt.memory_step == 3
    assert "restored step 3 from memory (epoch 0, batch 3): the backup's newest step is 2" in \
        caplog.text
    # The backup moves ahead of the memory copy (a run without the tier, say): it wins.
    with _manager(tmp_path, memory_tier=MemoryTierPolicy(enabled=False)) as ckpt:
        ckpt.save(4, {"w": jnp.full(2, 4.0)}, {"epoch": 0, "position": 4}, force=True)
    caplog.clear()
    with _manager(tmp_path) as ckpt:
        r = ckpt.restore_latest(_like())
    assert (r.step, r.source, r.position) == (4, "backup", {"epoch": 0, "position": 4})
    assert r.state["w"].tolist() == [4.0, 4.0]
    lines = [m for m in caplog.messages if m.startswith("restored")]
    assert lines == ["restored step 4 from backup (epoch 0, batch 4): newer than the in-memory "
                     "tier's newest step (3)"]


def test_a_newer_backup_that_does_not_restore_leaves_the_memory_copy_the_newer(tmp_path, caplog):
    # before (in BackupAndRestore): the memory copy was passed over as soon as the backup's
    # newest step was newer, and the restore then fell back to an older backup than it
    with _manager(tmp_path, every_n_steps=2) as ckpt:
        _train(ckpt, 3)  # memory 3, backup 2
    with _manager(tmp_path, memory_tier=MemoryTierPolicy(enabled=False)) as ckpt:
        ckpt.save(4, {"w": jnp.full(2, 4.0)}, {"epoch": 0, "position": 4}, force=True)
    shutil.rmtree(tmp_path / "backup" / "4" / "digests")  # step 4 no longer restores
    caplog.set_level(logging.INFO, logger="jaxdist.checkpoint")
    with _manager(tmp_path) as ckpt:
        r = ckpt.restore_latest(_like())
    assert (r.step, r.source) == (3, "memory")
    assert "the backup's newest intact step is 2" in caplog.text


def test_the_launchers_stop_step_and_a_preemption_stop_with_both_tiers_written(tmp_path):
    with _manager(tmp_path, every_n_steps=100) as ckpt:
        ckpt.restore_latest(_like())
        state, _ = _train(ckpt, 2)
        assert not ckpt.should_stop(2)
        write_stop(str(tmp_path / "state"), 3)  # what the elastic agents agree on
        assert not ckpt.should_stop(2) and ckpt.should_stop(3) and ckpt.stop_reason == "reform"
        assert ckpt.stop(3, state, {"epoch": 0, "position": 3}) == ("memory", "backup")
        # written, not in flight: a new process finds both at once
        assert InMemoryTier(str(tmp_path / "state"), rank=0).newest_local()[0] == 3
        assert CheckpointManager(str(tmp_path / "backup")).all_steps() == [3]
        with pytest.raises(RuntimeError, match="asked to stop at step 3, seen only at step 5"):
            ckpt.should_stop(5, steps=2)  # the call that ran step 3 ended without seeing it
    os.remove(tmp_path / "state" / "stop")
    before = signal.getsignal(signal.SIGTERM)
    with _manager(tmp_path, every_n_steps=100) as ckpt:
        ckpt.restore_latest(_like())
        assert not ckpt.should_stop(4)
        os.kill(os.getpid(), signal.SIGTERM)  # caught: saved at the next step boundary
        assert ckpt.should_stop(5) and ckpt.stop_reason == "preemption"
    assert signal.getsignal(signal.SIGTERM) is before  # given back by close()


def test_finish_removes_both_tiers_copies_only_when_asked(tmp_path):
    with _manager(tmp_path, every_n_steps=2) as ckpt:
        _train(ckpt, 2)
        ckpt.finish(delete=False)
    assert os.path.isdir(tmp_path / "backup" / "2")
    (tmp_path / "backup" / "notes.txt").write_text("the user's")
    with _manager(tmp_path, every_n_steps=2) as ckpt:
        r = ckpt.restore_latest(_like())
        _train(ckpt, 2, start=r.step)
        ckpt.finish(delete=True)
    assert sorted(os.listdir(tmp_path / "backup")) == ["notes.txt"]  # the user's file stays
    assert InMemoryTier(str(tmp_path / "state"), rank=0).newest_local() is None
    np.testing.assert_array_equal(r.state["w"], [2.0, 2.0])


def test_bad_options_are_refused_before_anything_is_written(tmp_path):
    where = str(tmp_path / "b")
    with pytest.raises(ValueError, match="every_n_steps must be >= 1 or None, got 0"):
        TieredCheckpointManager(where, every_n_steps=0)
    with pytest.raises(ValueError, match="either every_n_steps= or policy="):
        from jaxdist.checkpoint.save_policy import EveryNSteps
        TieredCheckpointManager(where, every_n_steps=2, policy=EveryNSteps(2))
    with pytest.raises(TypeError, match="policy=3 has no should_save"):
        TieredCheckpointManager(where, policy=3)
    with pytest.raises(TypeError, match="memory_tier=2: expected jaxdist.checkpoint.MemoryTierPolicy"):
        TieredCheckpointManager(where, memory_tier=2)
    with pytest.raises(ValueError, match="either memory= .* or memory_tier="):
        TieredCheckpointManager(where, memory=InMemoryTier(None), memory_tier=MemoryTierPolicy())
    assert not os.path.exists(where)
    with pytest.raises(ValueError, match=r"TieredCheckpointManager\('.'\).*is the working "
                                         "directory; a backup needs a folder of its own"):
        TieredCheckpointManager(".")


def test_a_failed_runs_rerun_resumes_from_memory_even_before_its_first_backup(tmp_path):
    # before: the backup folder recorded no identity of the job (only the memory tier's owner
    # record named the folder's path); the resumes themselves were the same
    with _manager(tmp_path, every_n_steps=100) as ckpt:
        assert ckpt.restore_latest(_like()) is None  # a fresh start: a new identity
        _train(ckpt, 3)  # fails after step 3, before its first backup
    folder, memory = _jobs(tmp_path)
    assert folder is not None and memory == folder, (folder, memory)
    for fails_at in (5, 6):  # a rerun resumes from memory, and so does the rerun of the rerun
        with _manager(tmp_path, every_n_steps=100) as ckpt:
            r = ckpt.restore_latest(_like())
            assert (r.source, r.state["w"].tolist()) == ("memory", [r.step] * 2)
            _train(ckpt, fails_at - r.step, start=r.step)
        assert r.step == {5: 3, 6: 5}[fails_at]
        assert _jobs(tmp_path) == (folder, folder)  # a resumed run keeps the job's identity


def test_a_memory_copy_whose_backup_folder_was_removed_is_not_resumed(tmp_path, caplog):
    # before: the run after `rm -rf backup` said "restored step 3 from memory" and trained on
    # from the removed run's state: only the folder's path (the same) was compared
    with _manager(tmp_path, every_n_steps=2) as ckpt:
        ckpt.restore_latest(_like())
        _train(ckpt, 3)  # fails: memory 3, backup 2
    shutil.rmtree(tmp_path / "backup")  # starting over
    caplog.set_level(logging.WARNING, logger="jaxdist.checkpoint")
    with _manager(tmp_path, every_n_steps=2) as ckpt:
        assert ckpt.restore_latest(_like()) is None
        assert not ckpt.memory.enabled  # off for this run: the kept copy is not overwritten
        _train(ckpt, 4)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"the in-memory state in {tmp_path / 'state'} belongs to an "
                                  "earlier run"), warnings[0]
    assert "which now holds no job identity (removed, or a fresh folder)" in warnings[0]
    assert "Unset JAXDIST_STATE_DIR to start afresh, or remove" in warnings[0]
    assert InMemoryTier(str(tmp_path / "state"), rank=0).newest_local()[0] == 3  # left intact
    folder, memory = _jobs(tmp_path)
    assert folder is not None and memory not in (None, folder)  # the new run is another job


def test_a_memory_copy_of_a_run_before_another_training_in_the_folder_is_not_resumed(tmp_path,
                                                                                     caplog):
    # before: the third run resumed from memory at step 5, the first training's state, over the
    # second training's backup at step 2 in the same folder
    with _manager(tmp_path, every_n_steps=2) as ckpt:
        ckpt.restore_latest(_like())
        _train(ckpt, 5)  # fails: memory 5, backup 4
    shutil.rmtree(tmp_path / "backup")
    with _manager(tmp_path, every_n_steps=2, memory_tier=MemoryTierPolicy(enabled=False)) as ckpt:
        assert ckpt.restore_latest(_like()) is None  # another training (no memory tier)
        _train(ckpt, 3)  # fails: backup 2
    caplog.set_level(logging.INFO, logger="jaxdist.checkpoint")
    with _manager(tmp_path, every_n_steps=2) as ckpt:
        r = ckpt.restore_latest(_like())
    assert (r.step, r.source, r.state["w"].tolist()) == (2, "backup", [2.0, 2.0])
    assert "which now holds another run's identity (a training started there since)" in \
        caplog.text
    assert InMemoryTier(str(tmp_path / "state"), rank=0).newest_local()[0] == 5  # left intact


def test_an_owner_record_without_an_identity_is_compared_by_its_folder_as_before(tmp_path):
    # before (the resume itself was the same): the run recorded no identity, so a later run could
    # not tell this job's copy from a copy whose backup folder was removed since
    with _manager(tmp_path, every_n_steps=100) as ckpt:
        ckpt.restore_latest(_like())
        _train(ckpt, 3)
    owner = tmp_path / "state" / "owner.json"  # what an older version left: no identity
    owner.write_text(json.dumps({"owner": json.loads(owner.read_text())["owner"]}))
    (tmp_path / "backup" / ".jaxdist-job.json").unlink(missing_ok=True)
    with _manager(tmp_path, every_n_steps=100) as ckpt:
        r = ckpt.restore_latest(_like())
        assert (r.step, r.source) == (3, "memory")  # the same folder: resumed, as before
        _train(ckpt, 1, start=3)
    folder, memory = _jobs(tmp_path)
    assert folder is not None and memory == folder, (folder, memory)  # recorded from now on
