"""A torchrun or Keras user's first day (issue 36): one job under `jaxdist launch`, a line for every
recovery, Keras's habits (validation_data, a backup deleted after success), errors that point to
the fix."""

from __future__ import annotations

import logging
import os

import jax
import numpy as np
import pytest

import jaxdist
from jaxdist import launch, models
from jaxdist.checkpoint import CheckpointManager
from tests.conftest import REPO, run_python

ENV = {"PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1"}


def _data(n=80):
    x, y = jaxdist.datasets.synthetic(n, shape=(6,))
    return x, y


def _state(x):
    return models.create_train_state(models.MLP(hidden=(16,)), x[:1], seed=0)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_readme_common_path_under_launch_is_one_job(tmp_path):
    script = os.path.join(REPO, "tests", "_scripts", "readme_mirrored.py")
    res = launch.run([script, str(tmp_path / "two")], num_processes=2, devices_per_process=2,
                     timeout_s=300, grace_period_s=10, env=ENV, cwd=REPO)
    assert res.returncode == 0, res.output[-3000:]
    alone = run_python([script, str(tmp_path / "one")], timeout=240, devices=4)
    assert alone.returncode == 0, alone.stderr[-3000:]
    a, b, one = (np.load(tmp_path / n) for n in ("two0.npz", "two1.npz", "one0.npz"))
    assert (int(a["process_index"]), int(b["process_index"])) == (0, 1)
    assert int(a["process_count"]) == 2 and int(a["replicas"]) == 4
    for k in one.files:
        if k.startswith("["):  # the parameters: same global batch, same numbers as one process
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
            np.testing.assert_allclose(a[k], one[k], rtol=1e-5, atol=1e-6, err_msg=k)


class _StopAt(jaxdist.callbacks.Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, info):
        if info.step == self.step:
            raise KeyboardInterrupt(f"killed at step {info.step}")


def test_a_resume_prints_one_line_and_the_epoch_says_it_is_partial(tmp_path, caplog, monkeypatch):
    x, y = _data()
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    data = s.distribute((x, y), 10)  # 8 batches an epoch
    backup = str(tmp_path / "b")
    first = jaxdist.callbacks.BackupAndRestore(backup, every_n_steps=3)
    with pytest.raises(KeyboardInterrupt):
        jaxdist.fit(s.step(models.classifier_train_step), _state(x), data, epochs=2, verbose=0,
                    callbacks=[first, _StopAt(11)])
    first.manager.wait_until_finished()  # the crash came after step 9's (asynchronous) save began
    # As the launcher tells a restarted process what failed and the newest step it reached.
    monkeypatch.setenv("JAXDIST_LAST_FAILURE", "rank 1 killed by SIGKILL")
    monkeypatch.setenv("JAXDIST_LAST_FAILURE_STEP", "11")
    caplog.set_level(logging.WARNING, logger="jaxdist")
    h = jaxdist.fit(s.step(models.classifier_train_step), _state(x), data, epochs=2, verbose=0,
                    callbacks=[jaxdist.callbacks.BackupAndRestore(backup, every_n_steps=3)])
    lines = [r.getMessage() for r in caplog.records if "resumed" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    assert ("resumed after rank 1 killed by SIGKILL: from backup step 9 (epoch 2, after batch 1 of 8); "
            "2 step(s) computed again") in lines[0]
    assert "epoch 2's metrics cover its batches 2-8 only" in lines[0]
    assert h.epochs == [1] and h.partial == {1: (1, 7)}


def test_the_progress_bar_of_a_resumed_epoch_starts_at_its_position():
    from jaxdist.callbacks import ProgressBar, TrainInfo

    bar = ProgressBar()
    info = TrainInfo(epoch=1, epochs=2, steps_per_epoch=8, position=5, epoch_steps=5)
    bar.on_epoch_begin(info)
    try:
        assert bar._bar.n == 5 and bar._bar.total == 8
        info.epoch_steps, info.call_steps = 8, 3
        bar.on_train_batch_end(info)
        assert bar._bar.n == 8  # 100%, not 3/8
    finally:
        bar.close()


def test_a_backup_is_deleted_after_success_and_a_kept_final_state_says_so(tmp_path, caplog):
    x, y = _data()
    s = jaxdist.MirroredStrategy(jax.devices()[:2])

    def run(**kw):
        return jaxdist.fit(s.step(models.classifier_train_step), _state(x),
                           s.distribute((x, y), 10), epochs=1, verbose=0,
                           callbacks=[jaxdist.callbacks.BackupAndRestore(str(tmp_path / "b"), **kw)])

    first = run()
    assert not (tmp_path / "b").exists()  # Keras's delete_checkpoint=True
    again = run()  # a rerun trains again
    assert again.history["loss"] == first.history["loss"]
    run(delete_checkpoint=False)
    caplog.set_level(logging.WARNING, logger="jaxdist")
    final = run(delete_checkpoint=False)
    assert "restored the final state (step 8) from backup: nothing left to train" in caplog.text
    assert final.epochs == [] and int(final.state.step) == 8
    with pytest.raises(KeyError, match="fit trained no epoch.*restored the final state"):
        final.history["loss"]


def test_a_successful_run_removes_only_what_the_backup_wrote(tmp_path, caplog):
    x, y = _data()
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "labels").mkdir()
    (out / "labels" / "a.csv").write_text("1,2")
    # checkpoints the user keeps there, written by another callback
    with CheckpointManager(out / "best", async_save=False) as mgr:
        mgr.save(100, _state(x))
    caplog.set_level(logging.INFO, logger="jaxdist")
    first = jaxdist.fit(s.step(models.classifier_train_step), _state(x), s.distribute((x, y), 10),
                        epochs=1, verbose=0, callbacks=[jaxdist.callbacks.BackupAndRestore(
                            str(out), every_n_steps=3)])
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "labels" / "a.csv").read_text() == "1,2"
    assert sorted(p.name for p in out.iterdir()) == ["best", "labels", "notes.txt"]
    assert (out / "best" / "100" / "state").is_dir()
    assert "the folder stays: it holds 3 thing(s) the backup did not write" in caplog.text
    assert int(first.state.step) == 8


def test_a_finished_job_leaves_no_memory_copy_for_the_next_run(tmp_path, monkeypatch):
    # A kept JAXDIST_STATE_DIR (the launcher tells users to set it to resume) outlives the job:
    # delete_checkpoint=True clears the tier's copy too, so the next training starts afresh.
    from jaxdist.launch import heartbeat
    from jaxdist.memstate import InMemoryTier

    state_dir = tmp_path / "state"
    monkeypatch.setenv("JAXDIST_STATE_DIR", str(state_dir))
    monkeypatch.setattr(heartbeat, "_current", None)  # this test's heartbeat, not the process's
    x, y = _data()
    s = jaxdist.MirroredStrategy(jax.devices()[:2])

    def run(**kw):
        backup = jaxdist.callbacks.BackupAndRestore(
            str(tmp_path / "b"), memory_tier=jaxdist.checkpoint.MemoryTierPolicy(every=1), **kw)
        history = jaxdist.fit(s.step(models.classifier_train_step), _state(x),
                              s.distribute((x, y), 10), epochs=1, verbose=0, callbacks=[backup])
        return history, backup

    _, kept = run(delete_checkpoint=False)
    assert InMemoryTier(str(state_dir), rank=0).newest_local() is not None  # the tier held steps
    first, _ = run(delete_checkpoint=False)  # resumes the kept final state: nothing to train
    assert first.epochs == []
    _, done = run()  # the same, deleting both tiers after success
    assert done.restored_from == "memory"
    assert InMemoryTier(str(state_dir), rank=0).newest_local() is None
    again, fresh = run()
    assert fresh.restored_from is None and again.epochs == [0]


def test_a_state_directory_that_cannot_be_used_is_one_line(tmp_path, monkeypatch, caplog):
    from jaxdist.launch import heartbeat

    monkeypatch.setenv("JAXDIST_STATE_DIR", "/proc/nope")
    monkeypatch.setattr(heartbeat, "_current", None)
    monkeypatch.setattr(heartbeat, "_unusable", None)
    caplog.set_level(logging.WARNING, logger="jaxdist")
    x, y = _data()
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    jaxdist.fit(s.step(models.classifier_train_step), _state(x), s.distribute((x, y), 10),
                epochs=1, verbose=0,
                callbacks=[jaxdist.callbacks.BackupAndRestore(str(tmp_path / "b"))])
    said = [r.getMessage() for r in caplog.records if "/proc/nope" in r.getMessage()]
    assert said == ["JAXDIST_STATE_DIR=/proc/nope cannot be used (No such file or directory): this "
                    "process keeps no heartbeat and no in-memory state; set it to a writable "
                    "directory, or unset it"], said


@pytest.mark.parametrize("where", [".", "", "~", "..", "/"])
def test_a_backup_folder_that_holds_the_users_work_is_refused(where):
    with pytest.raises(ValueError, match="a backup needs a folder of its own"):
        jaxdist.callbacks.BackupAndRestore(os.path.expanduser(where))


def test_fit_takes_keras_validation_data(digits):
    (x, y), (xt, yt) = digits
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    state = models.create_train_state(models.MLP(hidden=(16,)), x[:1], seed=0)
    step = s.step(models.classifier_train_step)
    keras = jaxdist.fit(step, state, s.distribute((x[:200], y[:200]), 50), epochs=1, verbose=0,
                        validation_data=(xt[:100], yt[:100]))
    state = models.create_train_state(models.MLP(hidden=(16,)), x[:1], seed=0)
    ours = jaxdist.fit(step, state, s.distribute((x[:200], y[:200]), 50), epochs=1, verbose=0,
                       eval_step=models.classifier_eval_step,
                       eval_data=s.distribute((xt[:100], yt[:100]), 50))
    assert keras.history["val_loss"] == ours.history["val_loss"]
    assert "val_accuracy" in keras.history

    def own_step(state, batch):
        return models.classifier_train_step(state, batch)

    with pytest.raises(ValueError, match="validation_data=.*needs eval_step="):
        jaxdist.fit(own_step, state, s.distribute((x[:200], y[:200]), 50), verbose=0,
                    validation_data=(xt[:100], yt[:100]))


@pytest.mark.parametrize("bad, text", [
    (lambda xt, yt: (xt,), "got a 1-tuple; pass \\(x_val, y_val\\)"),
    (lambda xt, yt: xt, "got a ndarray; pass \\(x_val, y_val\\)"),
    (lambda xt, yt: {"x": xt, "y": yt}, "got a dict; pass \\(x_val, y_val\\).*eval_data="),
    (lambda xt, yt: (xt, yt, np.ones(len(yt))), "sample weights are not supported"),
])
def test_validation_data_of_another_shape_is_refused_before_training(bad, text):
    x, y = _data()
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    trained = []

    class Seen(jaxdist.callbacks.Callback):
        def on_train_batch_end(self, info):
            trained.append(info.step)

    with pytest.raises(ValueError, match=text):
        jaxdist.fit(s.step(models.classifier_train_step), _state(x), s.distribute((x, y), 10),
                    verbose=0, callbacks=[Seen()], validation_data=bad(x[:20], y[:20]))
    assert trained == []  # at the call, not after an epoch


def test_validation_split_holds_out_the_last_fraction_as_keras_does():
    x, y = _data()
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    step = s.step(models.classifier_train_step)
    split = jaxdist.fit(step, _state(x), (x, y), batch_size=10, shuffle=False, verbose=0,
                        validation_split=0.25)
    by_hand = jaxdist.fit(step, _state(x), (x[:60], y[:60]), batch_size=10, shuffle=False,
                          verbose=0, validation_data=(x[60:], y[60:]))
    assert split.history["val_loss"] == by_hand.history["val_loss"]
    assert split.history["loss"] == by_hand.history["loss"]
    with pytest.raises(ValueError, match="validation_split= needs in-memory"):
        jaxdist.fit(step, _state(x), s.distribute((x, y), 10), verbose=0, validation_split=0.2)
    with pytest.raises(ValueError, match="expected a fraction"):
        jaxdist.fit(step, _state(x), (x, y), batch_size=10, verbose=0, validation_split=1.5)


def test_unpacking_a_batch_as_x_y_says_what_it_is_and_the_line_to_write():
    import optax

    x, y = _data(40)
    s = jaxdist.MirroredStrategy(jax.devices()[:2])

    @s.step
    def train_step(state, batch):
        xb, yb = batch  # the commonest JAX habit: batch is ((x, y), mask)

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, xb)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    with pytest.raises(Exception) as err:
        jaxdist.fit(train_step, _state(x), s.distribute((x, y), 10), verbose=0)
    said = "\n".join(getattr(err.value, "__notes__", []))
    assert "unpacks as ((x, y), mask)" in said and "(xb, yb), mask = batch" in said


@pytest.mark.multiprocess
def test_the_launcher_takes_torchruns_nproc_per_node_and_names_what_it_does_not():
    import subprocess
    import sys

    code = "import os, jax; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])"
    for spelling in (["--nproc-per-node", "2"], ["--nproc_per_node=2"]):
        proc = subprocess.run([sys.executable, "-m", "jaxdist.cli", "launch", *spelling,
                               "--devices-per-process", "1", "--", "-c", code],
                              capture_output=True, text=True, timeout=120, cwd=REPO,
                              env={**os.environ, **ENV})
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "rank 1 of 2" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "jaxdist.cli", "launch", "--standalone",
                           "--nproc-per-node", "2", "train.py"], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env={**os.environ, **ENV})
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == (
        "jaxdist launch: error: --standalone is torchrun's; leave it out: `jaxdist launch -n N "
        "script.py` is a one-host job with its own coordinator")


def test_the_tier_line_is_said_once_on_its_own_line_and_again_only_when_a_bound_moves(tmp_path):
    import io
    import json

    from jaxdist.launch import group, statedir

    shown = []
    launcher = group._Launcher(["train.py"], group._Options(num_processes=2),
                               lambda stream, data: shown.append(data), {"PATH": os.environ["PATH"]},
                               None)
    launcher._state_dir = str(tmp_path)
    os.makedirs(tmp_path / "0")
    info = {"bytes": 1e6, "copy_every": 1, "every": 4, "bound": 2, "bound_all": 9,
            "cost_s": 0.001, "step_s": 0.01, "budget": 0.05}
    # rank 0's progress bar is on the terminal: the last line shown ended with "\r"
    launcher._pump("0", "stderr", io.BufferedReader(io.BytesIO(b"1/7\r4/7\r")))
    assert launcher._open_line
    for step, (bound, bound_all) in enumerate([(2, 9), (3, 9), (2, 12), (3, 9), (2, 8), (6, 9)]):
        with open(statedir.tier_path(str(tmp_path), 0), "w") as f:
            json.dump({**info, "bound": bound, "bound_all": bound_all, "step": step}, f)
        os.utime(statedir.tier_path(str(tmp_path), 0), (step + 1, step + 1))
        launcher.announce_tier()
    said = [s for s in shown if b"in-memory tier" in s]
    assert len(said) == 2, said  # first known, then when the bound tripled (2 -> 6)
    assert said[0].startswith(b"\njaxdist launch: in-memory tier") and b"at most 2 step(s)" in said[0]
    assert said[1].startswith(b"jaxdist launch: in-memory tier") and b"at most 6 step(s)" in said[1]


def test_an_async_save_whose_peer_died_says_so_in_one_line(tmp_path, monkeypatch):
    from orbax.checkpoint import handlers as ocp_handlers

    from jaxdist.checkpoint import CheckpointError, CheckpointManager

    state = {"w": np.arange(4.0, dtype=np.float32)}
    mgr = CheckpointManager(tmp_path, max_to_keep=1, async_save=True)
    mgr.save(1, state)
    mgr.wait_until_finished()

    async def peer_gone(self, x, directory):  # what the survivors' save barrier raises
        raise RuntimeError("DEADLINE_EXCEEDED: Barrier timed out. Id: CheckpointManager:save:2. "
                           "The following tasks are unhealthy (stopped sending heartbeats):\n"
                           "/job:jax_worker/replica:0/task:1")

    monkeypatch.setattr(ocp_handlers.JsonCheckpointHandler, "_save_fn", peer_gone)
    mgr.save(2, state)
    with pytest.raises(CheckpointError) as err:
        mgr.wait_until_finished()
    text = str(err.value)
    assert "\n" not in text and "a peer process died" in text and "DEADLINE_EXCEEDED" in text
    assert "free space" not in text and err.value.__suppress_context__
    assert "restorable ([1])" in text
    monkeypatch.undo()
    mgr.close()


@pytest.mark.multiprocess
def test_a_torchrun_style_initialize_after_import_joins_the_same_job(tmp_path):
    # before: JAX raised "distributed.initialize should only be called once" in every process,
    # since importing jaxdist had joined the job already
    script = os.path.join(REPO, "tests", "_scripts", "torchrun_style_join.py")
    res = launch.run([script], num_processes=2, devices_per_process=1, timeout_s=180,
                     grace_period_s=5, env=ENV, cwd=REPO)
    assert res.returncode == 0, res.output[-3000:]
    assert "rank 0 of 2: sum 3" in res.output and "rank 1 of 2: sum 3" in res.output
    # another job than the one joined: one error naming it and the fix
    res = launch.run([script, "other"], num_processes=2, devices_per_process=1, timeout_s=180,
                     grace_period_s=5, env=ENV, cwd=REPO)
    assert res.returncode != 0
    assert "already joined the job at" in res.output and "JAXDIST_JOIN_ON_IMPORT=0" in res.output


@pytest.mark.parametrize("argv, says", [
    (["--nnodes", "1", "--nproc-per-node", "2"], "--nnodes 1 is torchrun's one-host job: leave "
                                                 "out --nnodes"),
    (["-n", "2", "--nnodes", "2:3"], "--nnodes 2:3 needs --rdzv-endpoint HOST:PORT"),
    (["-n", "2", "--tee", "3"], "--tee is torchrun's; leave it out"),
    (["-n", "2", "--log_dir=logs"], "--log_dir is torchrun's; leave it out"),
    (["-n", "2", "--monitor-interval", "5"], "--monitor-interval is torchrun's"),
    (["-n", "2", "--start-method", "spawn"], "--start-method is torchrun's"),
    (["-n", "2", "--rdzv-conf", "timeout=9"], "--rdzv-conf is torchrun's"),
    (["-n", "2", "--no-python"], "--no-python is torchrun's"),
])
def test_torchruns_other_options_are_one_usage_line_each(argv, says, capsys):
    # before: "rdzv_endpoint = None" for a one-host --nnodes 1, argparse's "unrecognized
    # arguments" for the others (in-process: the launcher's own argument checks)
    from jaxdist.launch import launcher

    with pytest.raises(SystemExit) as done:
        launcher.main([*argv, "train.py"])
    assert done.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("jaxdist launch: error: " + says), last
