"""fit(steps_per_execution=K): K steps per compiled call, the numbers of K=1.

Parameters, per-epoch metrics, the uneven last batch (an epoch's last group of fewer than K
batches runs only those, so Adam's count never advances on padding), the callbacks' step numbers
(once per call, as Keras), resume and preemption at a K boundary, one compilation, evaluate and
predict, and `jaxdist train --steps-per-execution`.
"""

from __future__ import annotations

import os
import signal
import textwrap

import jax
import numpy as np
import pytest

import jaxdist
from jaxdist import models
from jaxdist.callbacks import BackupAndRestore, Callback, ModelCheckpoint, TrainInfo
from jaxdist.callbacks.checkpointing import TrainingPreempted
from jaxdist.callbacks.save_policy import EveryNSteps, SaveCandidate
from jaxdist.checkpoint import CheckpointManager
from tests.conftest import run_python


def _data(digits, n=300):
    (x, y), (xt, yt) = digits
    return (x[:n], y[:n]), (xt[:100], yt[:100])  # 300 / 64: 5 batches, the last has 44 rows


def _state():
    x = np.zeros((1, 8, 8, 1), np.float32)
    return models.create_train_state(models.MLP(hidden=(32,)), x)


class Record(Callback):
    """What each on_train_batch_end call saw."""

    def __init__(self):
        self.calls = []

    def on_train_batch_end(self, info):
        self.calls.append((info.epoch, info.step, info.epoch_steps, info.call_steps,
                           info.iterator.state()["position"], info.steps_per_execution))


def _fit(strategy, data, k, *, epochs=3, callbacks=(), **kw):
    (x, y), (xt, yt) = data
    return jaxdist.fit(strategy.step(models.classifier_train_step), _state(),
                       strategy.distribute((x, y), 64, shuffle=True, seed=3), epochs=epochs,
                       eval_step=models.classifier_eval_step,
                       eval_data=strategy.distribute((xt, yt), 64), callbacks=list(callbacks),
                       verbose=0, steps_per_execution=k, **kw)


def _close(a, b, rtol=1e-6, atol=1e-7):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=atol)


@pytest.mark.parametrize("devices", [1, 4])
def test_k_steps_per_call_give_the_parameters_and_history_of_one(digits, devices):
    s = jaxdist.MirroredStrategy(jax.devices()[:devices])
    data = _data(digits)
    one = _fit(s, data, 1)
    for k in (2, 3, 9):  # 9 > the epoch's 5 batches: one group of 5 an epoch
        many = _fit(s, data, k)
        assert many.epochs == one.epochs == [0, 1, 2]
        # The same optimizer steps, Adam's count included: the last group (fewer than k batches,
        # padded to k) runs only its real batches.
        assert int(many.state.step) == int(one.state.step) == 15
        count = [x for x in jax.tree.leaves(many.state.opt_state)
                 if np.ndim(x) == 0 and np.issubdtype(np.asarray(x).dtype, np.integer)]
        assert count and all(int(c) == 15 for c in count)
        _close(many.state.params, one.state.params)
        assert set(many.history) == set(one.history) == {"loss", "accuracy", "val_loss",
                                                         "val_accuracy"}
        for name in one.history:
            np.testing.assert_allclose(many.history[name], one.history[name], rtol=1e-6)


@pytest.mark.parametrize("make", [
    lambda: jaxdist.MirroredStrategy(jax.devices()[:4], zero_stage=3),
    lambda: jaxdist.CentralStorageStrategy(jax.devices()[:4]),
    lambda: jaxdist.OneDeviceStrategy(jax.devices()[1]),
    jaxdist.DefaultStrategy,
], ids=["zero_stage_3", "central_storage", "one_device", "default"])
def test_every_strategy_groups_steps_with_the_same_numbers(digits, make):
    data = _data(digits)
    one, three = _fit(make(), data, 1, epochs=2), _fit(make(), data, 3, epochs=2)
    _close(three.state.params, one.state.params)
    np.testing.assert_allclose(three.history["loss"], one.history["loss"], rtol=1e-6)


def test_callbacks_run_once_per_call_with_the_step_it_ended_on(digits):
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    data = _data(digits)
    ones, threes = Record(), Record()
    _fit(s, data, 1, epochs=2, callbacks=[ones])
    _fit(s, data, 3, epochs=2, callbacks=[threes])
    assert [c[1] for c in ones.calls] == list(range(1, 11))
    # epoch 0: steps 1-3 then 4-5 (the last group: 2 batches); epoch 1: 6-8, 9-10
    assert [(e, step, es, n) for e, step, es, n, _, _ in threes.calls] == [
        (0, 3, 3, 3), (0, 5, 5, 2), (1, 8, 3, 3), (1, 10, 5, 2)]
    # The input position a checkpoint would record is the batches the calls consumed.
    assert [c[4] for c in threes.calls] == [3, 5, 3, 5]
    assert {c[5] for c in threes.calls} == {3} and {c[5] for c in ones.calls} == {1}


def test_the_launchers_progress_counts_every_step_of_a_call(digits):
    # The heartbeat that hang detection reads under jaxdist launch listens to these reports.
    from jaxdist.core import progress

    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    seen = []
    stop = progress.listen(lambda steps, marker: seen.append(steps))
    try:
        _fit(s, _data(digits), 3, epochs=2)
    finally:
        stop()
    assert seen == [3, 2, 3, 2]  # evaluation reports nothing: it trains nothing


def test_steps_per_epoch_caps_the_last_group(digits):
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    data = _data(digits)
    one, four = Record(), Record()
    a = _fit(s, data, 1, epochs=2, steps_per_epoch=4, callbacks=[one])
    b = _fit(s, data, 3, epochs=2, steps_per_epoch=4, callbacks=[four])
    assert [(c[1], c[3], c[4]) for c in four.calls] == [(3, 3, 3), (4, 1, 4), (7, 3, 3), (8, 1, 4)]
    assert int(a.state.step) == int(b.state.step) == 8
    _close(b.state.params, a.state.params)
    np.testing.assert_allclose(b.history["loss"], a.history["loss"], rtol=1e-6)


def test_one_compilation_for_the_groups_and_the_shorter_last_one(digits, count_compiles):
    s = jaxdist.MirroredStrategy(jax.devices()[:4])
    (x, y), _ = _data(digits)
    step = s.step(models.classifier_train_step)
    dist = s.distribute((x, y), 64, shuffle=True)
    state = jaxdist.fit(step, _state(), dist, verbose=0, steps_per_execution=3).state  # compiles
    with count_compiles() as compiles:
        jaxdist.fit(step, state, dist, epochs=3, verbose=0, steps_per_execution=3)
    assert compiles() == 0
    assert [k[0] for k in step._compiled] == ["steps"]


def test_evaluate_and_predict_group_batches_with_the_same_results(digits):
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    (_, _), (xt, yt) = digits
    state = s.put(_state())
    data = s.distribute((xt, yt), 64)  # 360 / 64: 6 batches, the last has 40 rows
    one = jaxdist.evaluate(models.classifier_eval_step, state, data)
    for k in (4, 6, 10):
        got = jaxdist.evaluate(models.classifier_eval_step, state, data, steps_per_execution=k)
        assert got == pytest.approx(one, rel=1e-6)

    def logits(st, batch):
        return st.apply_fn({"params": st.params}, batch.data[0])

    ref = jaxdist.predict(logits, state, data)
    assert ref.shape == (len(xt), 10)
    got = jaxdist.predict(logits, state, data, steps_per_execution=4)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    got = jaxdist.predict(logits, state, data, steps_per_execution=4, steps=5)
    np.testing.assert_allclose(got, ref[:5 * 64], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "3"])
def test_a_bad_steps_per_execution_is_refused_naming_it(digits, bad):
    s = jaxdist.MirroredStrategy(jax.devices()[:1])
    with pytest.raises(ValueError, match=r"steps_per_execution=.*expected an int >= 1"):
        _fit(s, _data(digits), bad)


def test_a_static_leaf_state_runs_grouped_too():
    # A state holding a function (as an Equinox module does): only its arrays enter the loop.
    s = jaxdist.MirroredStrategy(jax.devices()[:2])

    def step(state, batch):
        w, act = state["w"], state["act"]
        loss, g = jax.value_and_grad(lambda w: jaxdist.compute_average_loss(
            (act(batch.data * w) - 0.5) ** 2, batch.mask))(w)
        return {"w": w - 0.1 * g, "act": act}, {"loss": loss}

    data = s.distribute(np.linspace(0.0, 1.0, 20, dtype=np.float32), 4)
    init = {"w": np.float32(0.3), "act": jax.numpy.tanh}
    one = jaxdist.fit(s.step(step), dict(init), data, epochs=2, verbose=0)
    many = jaxdist.fit(s.step(step), dict(init), data, epochs=2, verbose=0, steps_per_execution=3)
    assert many.state["act"] is jax.numpy.tanh
    np.testing.assert_allclose(float(many.state["w"]), float(one.state["w"]), rtol=1e-6)
    assert many.history["loss"] == pytest.approx(one.history["loss"], rel=1e-6)


# --- checkpoints, backups and preemption at K boundaries -------------------------------------

class StopAt(Callback):
    """Stands for a crash right after the call that ends on ``step``."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, info):
        if info.step == self.step:
            raise KeyboardInterrupt(f"killed at step {info.step}")


def test_resume_at_a_k_boundary_is_exact(digits, tmp_path):
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    data = _data(digits)
    whole = _fit(s, data, 3)
    backups = tmp_path / "b"
    first = BackupAndRestore(str(backups), every_n_steps=2)
    with pytest.raises(KeyboardInterrupt):
        # every_n_steps=2 with calls ending at 3, 5, 8, ...: backups at 3 (past 2), 5 (past 4), 8
        _fit(s, data, 3, callbacks=[first, StopAt(8)])
    first.manager.wait_until_finished()  # the crash came after step 8's (asynchronous) save began
    assert CheckpointManager(backups).latest_step() == 8
    seen = Record()
    resumed_by = BackupAndRestore(str(backups), every_n_steps=2)
    resumed = _fit(s, data, 3, callbacks=[resumed_by, seen])
    assert resumed_by.restored_step == 8
    # Step 8 is batch 3 of epoch 1: the resumed run continues with that epoch's last 2 batches.
    assert [(c[0], c[1], c[3]) for c in seen.calls] == [(1, 10, 2), (2, 13, 3), (2, 15, 2)]
    assert int(resumed.state.step) == 15
    _close(resumed.state.params, whole.state.params, rtol=0, atol=0)
    # Epoch 1's means cover the batches the resumed run trained on; epoch 2 is whole again.
    assert resumed.epochs == [1, 2] and resumed.history["loss"][1] == whole.history["loss"][2]
    one = _fit(s, data, 1)
    _close(resumed.state.params, one.state.params)


class TermAt(Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, info):
        if info.step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_preemption_notice_saves_at_the_end_of_the_call(digits, tmp_path):
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    data = _data(digits)
    backups = tmp_path / "b"
    with pytest.raises(TrainingPreempted):
        _fit(s, data, 3, callbacks=[TermAt(8), BackupAndRestore(str(backups))])
    assert CheckpointManager(backups).latest_step() == 8
    resumed = _fit(s, data, 3, callbacks=[BackupAndRestore(str(backups))])
    _close(resumed.state.params, _fit(s, data, 3).state.params, rtol=0, atol=0)


class _Tier:
    """The in-memory tier's face: the stop step the elastic launcher asks for, from ``seen_at``."""

    def __init__(self, stop, seen_at):
        self.stop, self.seen_at, self.step = stop, seen_at, 0

    def save(self, step, state, data, force=False):
        self.step = step

    def stop_step(self):
        return self.stop if self.step >= self.seen_at else None

    def flush(self):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("stop, seen_at, outcome", [
    (7, 0, "stops at 9"),  # the call running steps 7..9 ends on 9, on every process alike
    (6, 0, "stops at 6"),
    (4, 0, "stops at 6"),
    (2, 0, "stops at 3"),
    (2, 6, "late"),        # the call that ran step 2 had ended (on 3) before the ask was seen
    (6, 9, "late"),
])
def test_the_launchers_stop_step_is_honoured_at_the_first_call_end_past_it(tmp_path, stop,
                                                                          seen_at, outcome):
    cb = BackupAndRestore(str(tmp_path / "b"))
    cb.memory = _Tier(stop, seen_at)
    info = TrainInfo(state={"w": np.zeros(2, np.float32)}, steps_per_execution=3, call_steps=3)
    got = None
    for step in (3, 6, 9, 12):
        info.step = step
        try:
            cb.on_train_batch_end(info)
        except TrainingPreempted:
            got = f"stops at {step}"
            break
        except RuntimeError as e:
            assert f"asked to stop at step {stop}, seen only at step {step}" in str(e)
            got = "late"
            break
    cb.close()
    assert got == outcome


def test_every_n_steps_saves_at_the_first_call_end_past_each_multiple():
    policy = EveryNSteps(4)
    ends = [3, 6, 9, 12, 15]
    saved = [e for e in ends if policy.should_save(SaveCandidate(e, 0, False, steps=3), [])]
    assert saved == [6, 9, 12]  # past 4, 8, 12
    assert [e for e in range(1, 13) if policy.should_save(SaveCandidate(e, 0, False), [])] == [
        4, 8, 12]


def test_model_checkpoint_every_n_steps_with_k(digits, tmp_path):
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    mc = ModelCheckpoint(str(tmp_path / "c"), every_n_steps=4, save_at_epoch_end=False,
                         max_to_keep=None, async_save=False)
    _fit(s, _data(digits), 3, epochs=2, callbacks=[mc])
    # calls end at 3, 5, 8, 10: multiples of 4 reached at 5 (4) and 8 (8)
    assert mc.manager.all_steps() == [5, 8]


def test_tensorboard_writes_every_n_steps_at_call_ends(tmp_path):
    from jaxdist.callbacks import TensorBoard

    tb = TensorBoard(str(tmp_path), update_freq=4)
    written = []
    tb._write = lambda prefix, logs, step: written.append(step)
    info = TrainInfo(logs={"loss": 1.0}, call_steps=3)
    for step in (3, 6, 9, 12):
        info.step = step
        tb.on_train_batch_end(info)
    assert written == [6, 9, 12]


def test_the_cli_flag_runs_and_a_bad_value_is_one_line_exit_2(tmp_path):
    bad = run_python(["-m", "jaxdist.cli", "train", "--steps-per-execution", "0"], timeout=120)
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "--steps-per-execution" in lines[0], bad.stderr
    ok = run_python(["-m", "jaxdist.cli", "train", "--devices", "2", "--epochs", "1", "--quiet",
                     "--batch-size", "256", "--steps-per-execution", "4"], timeout=300)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "test accuracy" in ok.stdout


def test_a_step_that_trains_elsewhere_is_refused_with_k_above_1(digits):
    s = jaxdist.MirroredStrategy(jax.devices()[:1])

    class Servers:  # a parameter-server strategy, say: its steps run on other processes
        def step(self, fn, donate=True):
            return fn

    class Elsewhere:  # ... so there is no compiled program to loop in
        strategy = Servers()

        def __call__(self, state, batch):
            return state, {}

    with pytest.raises(ValueError, match=r"steps_per_execution=3\) needs a step compiled by"):
        jaxdist.fit(Elsewhere(), {"w": np.zeros(1)}, s.distribute(np.arange(8.0), 4), verbose=0,
                    steps_per_execution=3)


def test_an_iterable_and_an_input_function_group_alike(digits):
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    (x, y), _ = _data(digits)

    def batches():  # 5 batches of 64, the last one short: padded by distribute
        for i in range(0, len(x), 64):
            yield x[i:i + 64], y[i:i + 64]

    def per_replica(ctx):
        return [(x[i:i + 32], y[i:i + 32]) for i in range(0, len(x), 32)]

    for data in (s.distribute(batches, 64), s.distribute_datasets_from_function(per_replica)):
        one = jaxdist.fit(s.step(models.classifier_train_step), _state(), data, epochs=2,
                          verbose=0)
        three = jaxdist.fit(s.step(models.classifier_train_step), _state(), data, epochs=2,
                            verbose=0, steps_per_execution=3)
        assert int(three.state.step) == int(one.state.step) == 10
        _close(three.state.params, one.state.params)
        np.testing.assert_allclose(three.history["loss"], one.history["loss"], rtol=1e-6)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_2x2_processes_group_like_one_process_and_resume_at_a_k_boundary(tmp_path,
                                                                          train_resume_1x4):
    from jaxdist import launch
    from tests.conftest import REPO

    script = os.path.join(REPO, "tests", "_scripts", "train_resume.py")
    env = {"PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1"}

    def run(name, *extra, max_restarts=0):
        out = tmp_path / f"{name}.npz"
        res = launch.run([script, "--backup", str(tmp_path / f"{name}_b"), "--out", str(out),
                          "--spe", "3", *extra], num_processes=2, devices_per_process=2,
                         max_restarts=max_restarts, timeout_s=300, grace_period_s=10, env=env,
                         cwd=REPO)
        assert res.returncode == 0, res.output[-3000:]
        return res, np.load(out)

    # 8 batches an epoch (the last padded): calls end on steps 3, 6, 8, 11, 14, 16, ... 24.
    _, grouped = run("ref")
    single = np.load(train_resume_1x4)  # one process x 4 devices, K=1 (the session's run)
    assert int(grouped["step"]) == int(single["step"]) == 24
    for k in single.files:
        if k not in ("restored", "step"):
            np.testing.assert_allclose(grouped[k], single[k], rtol=1e-5, atol=1e-6, err_msg=k)
    # Rank 1 is killed after the call that ends on step 11: the job restarts and resumes at a K
    # boundary (from memory: 11, or 8 if the kill beat the tier's write), ending where it would.
    res, resumed = run("killed", "--kill-at", "11", "--signal", "KILL", "--rank", "1",
                       max_restarts=1)
    assert res.restarts == 1 and int(resumed["restored"]) in (8, 11)
    for k in grouped.files:
        if k != "restored":
            np.testing.assert_array_equal(grouped[k], resumed[k], err_msg=k)


@pytest.mark.slow
def test_many_steps_per_call_queued_on_8_devices_do_not_abort():
    """DESIGN.md's run-ahead bound counts compiled calls: 32 calls of 16 steps each (512 steps
    with collectives) may be queued, and XLA:CPU's rendezvous does not abort."""
    code = textwrap.dedent("""
        import jax, jaxdist
        from jaxdist import models
        x, y = jaxdist.datasets.synthetic(64 * 640, shape=(16,))
        s = jaxdist.MirroredStrategy()
        assert s.num_replicas_in_sync == 8
        state = models.create_train_state(models.MLP(hidden=(32,)), x[:1])
        hist = jaxdist.fit(s.step(models.classifier_train_step), state,
                           s.distribute((x, y), 64, shuffle=True), epochs=1, verbose=0,
                           steps_per_execution=16, max_in_flight=32)
        print("steps", int(hist.state.step), "loss", hist.history["loss"][0])
    """)
    proc = run_python(code, timeout=300, devices=8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps 640" in proc.stdout
