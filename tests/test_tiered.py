"""TieredCheckpointManager: each tier saves by its own policy, a restart resumes from the newer
copy and says why in one line, a stop saves and waits for both tiers, a finished run leaves none."""

from __future__ import annotations

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
