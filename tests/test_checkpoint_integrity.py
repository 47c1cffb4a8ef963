"""Checkpoint integrity: corruption is detected at restore, resume falls back to an intact step."""

from __future__ import annotations

import errno
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from orbax.checkpoint import handlers as ocp_handlers

import jaxdist
from jaxdist import models
from jaxdist.checkpoint import CheckpointError, CheckpointManager


def _state():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w": jax.random.normal(k1, (128, 64)), "b": jax.random.normal(k2, (64,)),
            "step": jnp.int32(7)}


def _zeros(state):
    return jax.tree.map(jnp.zeros_like, state)


def _largest_file(directory) -> str:
    """The file holding the arrays' bytes (Orbax's OCDBT data file; the rest is small metadata)."""
    files = [os.path.join(r, f) for r, _, fs in os.walk(directory) for f in fs]
    return max(files, key=os.path.getsize)


def _flip_bit(path: str, pos: int, bit: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(pos)
        byte = fh.read(1)[0]
        fh.seek(pos)
        fh.write(bytes([byte ^ (1 << bit)]))


def test_a_flipped_bit_in_an_array_file_raises_naming_the_step(tmp_path):
    state = _state()
    with CheckpointManager(tmp_path / "src", async_save=False) as mgr:
        mgr.save(4, state)
    data = _largest_file(tmp_path / "src" / "4" / "state")
    size = os.path.getsize(data)
    assert size > 16_000  # the 32 KB of float32 values (compressed little: they are random)
    rel = os.path.relpath(data, tmp_path / "src")
    # A deterministic sweep over 24 positions from the first byte on, every bit position. (The
    # very last byte is left out: flipping it was seen to leave every restored value unchanged.)
    positions = [size * k // 24 for k in range(24)]
    for k, pos in enumerate(positions):
        trial = tmp_path / f"trial{k}"
        shutil.copytree(tmp_path / "src", trial)
        _flip_bit(str(trial / rel), pos, k % 8)
        with CheckpointManager(trial, async_save=False) as mgr:
            with pytest.raises(CheckpointError, match=r"checkpoint step 4 .*(corrupt|cannot be "
                                                      r"restored)"):
                mgr.restore(4, target=_zeros(state))
        shutil.rmtree(trial)


def test_a_damaged_metadata_file_is_detected(tmp_path):
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, _state(), data_state={"epoch": 0, "position": 3})
    path = tmp_path / "1" / "meta" / "metadata"
    text = path.read_text()
    path.write_text(text.replace('"position": 3', '"position": 2'))  # one flipped bit: '3' -> '2'
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.raises(CheckpointError, match="step 1 .*fails its checksum"):
            mgr.metadata(1)


def test_a_damaged_or_missing_digest_file_is_detected(tmp_path):
    with CheckpointManager(tmp_path, async_save=True) as mgr:
        mgr.save(1, _state())
        mgr.save(2, _state())
    path = tmp_path / "1" / "digests" / "metadata"
    path.write_text(path.read_text().replace("1", "2", 1))
    shutil.rmtree(tmp_path / "2" / "digests")
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.raises(CheckpointError, match="step 1 .*digest file fails its checksum"):
            mgr.restore(1, target=_zeros(_state()))
        with pytest.raises(CheckpointError, match="step 2 .*digests cannot be read"):
            mgr.restore(2, target=_zeros(_state()))
        # Written with verify=False: restores without a check.
        mgr.verify = False
        mgr.save(3, _state())
        mgr.verify = True
        assert float(mgr.restore(3, target=_zeros(_state()))["step"]) == 7


def test_digests_verify_on_a_different_device_count(tmp_path):
    saved = jaxdist.MirroredStrategy().put(_state())
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(2, saved)
        data = _largest_file(tmp_path / "2" / "state")
        for strategy in (jaxdist.OneDeviceStrategy(jax.devices()[1]),
                         jaxdist.MirroredStrategy(jax.devices()[:4])):
            out = mgr.restore(2, target=_zeros(saved), strategy=strategy)
            np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(saved["w"]))
        _flip_bit(data, os.path.getsize(data) // 2, 3)
        with pytest.raises(CheckpointError, match="step 2"):
            mgr.restore(2, target=_zeros(saved), strategy=jaxdist.OneDeviceStrategy())


def test_latest_skips_a_stray_directory_and_restore_falls_back_past_a_corrupt_step(tmp_path,
                                                                                   caplog):
    state = _state()
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, state)
        mgr.save(2, jax.tree.map(lambda x: x + 1, state))
    data = _largest_file(tmp_path / "2" / "state")
    _flip_bit(data, os.path.getsize(data) // 2, 5)
    os.mkdir(tmp_path / "99")
    caplog.set_level(logging.WARNING, logger="jaxdist.checkpoint")
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        assert mgr.all_steps() == [1, 2]
        assert mgr.latest_step() == 2  # its metadata is intact; only a restore reads the arrays
        restored = mgr.restore_latest(target=_zeros(state))
        assert restored.step == 1 and restored.metadata["step"] == 1
        np.testing.assert_array_equal(np.asarray(restored.state["w"]), np.asarray(state["w"]))
        np.testing.assert_array_equal(np.asarray(mgr.restore(target=_zeros(state))["w"]),
                                      np.asarray(state["w"]))
        with pytest.raises(CheckpointError, match="step 2"):
            mgr.restore(2, target=_zeros(state))
    assert "99" in caplog.text and "skipping checkpoint step 2" in caplog.text


def test_backup_and_restore_resumes_from_the_newest_intact_backup(tmp_path, caplog):
    x, y = jaxdist.datasets.synthetic(40, shape=(6,))
    s = jaxdist.MirroredStrategy(jax.devices()[:2])

    def run(epochs):
        # Wide enough that the arrays go to a data file, not inline into Orbax's index.
        init = models.create_train_state(models.MLP(hidden=(512,)), x[:1], seed=0)
        cb = jaxdist.callbacks.BackupAndRestore(str(tmp_path / "b"), delete_checkpoint=False)
        h = jaxdist.fit(s.step(models.classifier_train_step), init, s.distribute((x, y), 10),
                        epochs=epochs, callbacks=[cb], verbose=0)
        return h, cb

    run(2)  # backups at steps 4 and 8 (epoch ends)
    data = _largest_file(tmp_path / "b" / "8" / "state")
    _flip_bit(data, os.path.getsize(data) // 3, 1)
    os.mkdir(tmp_path / "b" / "99")
    caplog.set_level(logging.WARNING, logger="jaxdist.checkpoint")
    history, cb = run(3)
    assert cb.restored_step == 4 and history.epochs == [1, 2]
    assert int(history.state.step) == 12
    assert "skipping checkpoint step 8" in caplog.text


def test_after_a_failed_async_save_the_steps_on_disk_stay_listed(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, max_to_keep=1, async_save=True)
    mgr.save(1, _state())
    mgr.wait_until_finished()

    async def disk_full(self, x, directory):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ocp_handlers.JsonCheckpointHandler, "_save_fn", disk_full)
    mgr.save(2, _state())
    with pytest.raises(CheckpointError, match=r"saving checkpoint step 2 failed.*No space left.*"
                                              r"still restorable: \[1\]"):
        mgr.wait_until_finished()
    assert mgr.all_steps() == [1] and mgr.latest_step() == 1
    np.testing.assert_array_equal(np.asarray(mgr.restore(target=_zeros(_state()))["w"]),
                                  np.asarray(_state()["w"]))
    monkeypatch.undo()
    mgr.save(3, _state())  # the manager keeps working once the disk has room again
    mgr.wait_until_finished()
    assert mgr.all_steps() == [3]
    mgr.close()


# --- issue 19 -----------------------------------------------------------------------------------

@pytest.mark.parametrize("change, words", [
    (lambda s: {**s, "w": s["w"].astype(jnp.bfloat16)}, "w: dtype float32 in the checkpoint, "
                                                         "bfloat16 in the target"),
    (lambda s: {**s, "w": s["w"].astype(jnp.int32)}, "w: dtype float32 in the checkpoint, int32"),
    (lambda s: {**s, "b": jnp.zeros(65)}, "b: shape (64,) in the checkpoint, (65,) in the target"),
    (lambda s: {"w": s["w"], "b": s["b"], "extra": jnp.zeros(2), "step": s["step"]},
     "structure: the checkpoint has leaves [] the target lacks, the target has ['extra']")])
def test_a_target_of_another_dtype_shape_or_structure_is_named_not_called_corrupt(tmp_path,
                                                                                   change, words):
    # before: "checkpoint step N ... is corrupt ... digest mismatch", and restore_latest then
    # skipped every (good) step as corrupt
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, _state())
        mgr.save(2, _state())
    target = change(_zeros(_state()))
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.raises(jaxdist.checkpoint.CheckpointMismatchError) as e:
            mgr.restore(2, target=target)
        assert words in str(e.value) and "corrupt" not in str(e.value), str(e.value)
        with pytest.raises(jaxdist.checkpoint.CheckpointMismatchError, match="step 2 .*intact"):
            mgr.restore_latest(target=target)
        # the steps are good: a matching target restores the newest
        assert mgr.restore_latest(target=_zeros(_state())).step == 2


def test_a_flipped_bit_in_the_checksum_key_does_not_switch_the_metadata_check_off(tmp_path):
    # before: metadata() verified the checksum only `if "checksum" in meta`
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, _state(), data_state={"epoch": 0, "position": 3})
    path = tmp_path / "1" / "meta" / "metadata"
    text = path.read_text()
    assert '"checksum"' in text
    path.write_text(text.replace('"checksum"', '"checksuM"').replace('"position": 3',
                                                                     '"position": 2'))
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.raises(CheckpointError, match="step 1 .*lacks its checksum"):
            mgr.metadata(1)
    # one flip in "digested" as well cannot help: the digests item is there on disk
    path.write_text(text.replace('"checksum"', '"checksuM"').replace('"digested"', '"digesteD"'))
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.raises(CheckpointError, match="lacks its checksum"):
            mgr.metadata(1)
