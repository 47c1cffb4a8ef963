"""EarlyStopping, LearningRateScheduler and TensorBoard, exercised by real ``jaxdist.fit`` runs."""

from __future__ import annotations

import glob
import struct

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import jaxdist
from jaxdist import models
from jaxdist.callbacks import (
    Callback,
    EarlyStopping,
    LearningRateScheduler,
    TensorBoard,
    TrainInfo,
    get_hyperparam,
)

STEPS = 2  # steps per epoch: enough to move the parameters, cheap on 2 cores


class _Snapshots(Callback):
    """Host copies of the state's parameters at each epoch end (and at the start)."""

    def __init__(self):
        self.params: list = []

    def on_train_begin(self, info):
        self.params.append(jax.device_get(_params(info.state)))

    def on_epoch_end(self, info):
        self.params.append(jax.device_get(_params(info.state)))


def _params(state):
    return state["params"] if isinstance(state, dict) else state.params


def _same(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _state(x, tx):
    model = models.MLP(hidden=(16,))
    params = model.init(jax.random.key(0), jnp.asarray(x[:1]))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


# --- EarlyStopping --------------------------------------------------------------------------------

# The validation "score" after epoch e is SCORES[e]: a deterministic metric the test controls.
SCORES = [1.0, 0.5, 0.6, 0.7, 0.4, 0.3]


def _scored_eval_step(state, batch):
    epoch = state.step // STEPS - 1
    return {"score": jnp.asarray(SCORES, jnp.float32)[epoch]}


@pytest.mark.parametrize("n_devices", [1, 2])
def test_early_stopping_stops_after_patience_and_restores_the_best_state(digits, n_devices):
    (x, y), (xt, yt) = digits
    s = (jaxdist.OneDeviceStrategy() if n_devices == 1
         else jaxdist.MirroredStrategy(jax.devices()[:2]))
    snaps, es = _Snapshots(), EarlyStopping("val_score", patience=2, restore_best_state=True)
    hist = jaxdist.fit(s.step(models.classifier_train_step),
                       models.create_train_state(models.MLP(hidden=(16,)), x[:1]),
                       s.distribute((x, y), 64, shuffle=True), epochs=len(SCORES),
                       steps_per_epoch=STEPS, eval_step=_scored_eval_step,
                       eval_data=s.distribute((xt[:64], yt[:64]), 64), callbacks=[snaps, es],
                       verbose=0)
    # best 0.5 at epoch 1; 0.6 and 0.7 make two epochs without improvement: stop after epoch 3.
    assert hist.epochs == [0, 1, 2, 3]
    assert hist.history["val_score"] == pytest.approx(SCORES[:4])
    assert (es.best, es.best_epoch, es.stopped_epoch) == (pytest.approx(0.5), 1, 3)
    # The returned state is epoch 1's (snapshot 0 is the initial state), not the last epoch's...
    assert _same(hist.state.params, snaps.params[2])
    assert not _same(hist.state.params, snaps.params[4])
    assert int(hist.state.step) == 2 * STEPS
    # ... placed the strategy's way, so training can go on from it.
    leaf = jax.tree.leaves(hist.state.params)[0]
    assert len(leaf.sharding.device_set) == n_devices and leaf.sharding.is_fully_replicated
    batch = next(iter(s.distribute((x, y), 64)))
    state, _ = s.step(models.classifier_train_step)(hist.state, batch)
    assert int(state.step) == 2 * STEPS + 1


def _drive(cb, values, monitor="val_accuracy"):
    """Feeds ``values`` as successive epoch logs; returns the epochs run."""
    info = TrainInfo(state={"w": np.zeros(1)})
    cb.on_train_begin(info)
    for epoch, v in enumerate(values):
        info.epoch, info.logs = epoch, {monitor: v}
        cb.on_epoch_end(info)
        if info.stop_training:
            return epoch + 1
    return len(values)


def test_early_stopping_mode_and_min_delta_follow_keras():
    assert EarlyStopping("val_accuracy").mode == "max"
    assert EarlyStopping("val_loss").mode == "min"
    # auto -> max for accuracy; 0.605 is not an improvement on 0.6 by more than min_delta=0.02.
    assert _drive(EarlyStopping("val_accuracy", patience=1, min_delta=0.02),
                  [0.5, 0.6, 0.605, 0.9]) == 3
    assert _drive(EarlyStopping("val_accuracy", patience=1), [0.5, 0.6, 0.605, 0.9]) == 4
    # mode="min" on an accuracy name: rising values are regressions.
    assert _drive(EarlyStopping("val_accuracy", patience=0, mode="min"), [0.5, 0.6]) == 2
    # patience=0 never stops after the first epoch (as Keras), and a reused callback starts afresh.
    es = EarlyStopping("val_accuracy", patience=0)
    assert _drive(es, [0.5, 0.4, 0.9]) == 2
    assert _drive(es, [0.1, 0.2, 0.3]) == 3
    with pytest.raises(ValueError, match="mode='biggest'"):
        EarlyStopping(mode="biggest")
    with pytest.raises(ValueError, match="patience=-1"):
        EarlyStopping(patience=-1)


def test_early_stopping_names_the_available_logs_when_monitor_is_missing(digits):
    (x, y), _ = digits
    s = jaxdist.OneDeviceStrategy()
    with pytest.raises(ValueError, match=r"'val_loss'.*\['accuracy', 'loss'\].*eval_data"):
        jaxdist.fit(s.step(models.classifier_train_step),
                    models.create_train_state(models.MLP(hidden=(16,)), x[:1]), (x, y),
                    batch_size=64, epochs=2, steps_per_epoch=1, callbacks=[EarlyStopping()],
                    verbose=0)


# --- LearningRateScheduler ------------------------------------------------------------------------

def test_lr_schedule_sets_the_real_update_size_without_recompiling(digits, count_compiles):
    (x, y), _ = digits
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    state = _state(x, optax.inject_hyperparams(optax.adam)(learning_rate=1e-3))
    snaps, step = _Snapshots(), s.step(models.classifier_train_step)
    hist = jaxdist.fit(step, state, s.distribute((x, y), 64, shuffle=True), epochs=4,
                       steps_per_epoch=STEPS, verbose=0,
                       callbacks=[LearningRateScheduler(lambda e: 1e-2 if e < 2 else 0.0), snaps])
    assert hist.history["learning_rate"] == pytest.approx([1e-2, 1e-2, 0.0, 0.0])
    moved = [not _same(a, b) for a, b in zip(snaps.params, snaps.params[1:])]
    assert moved == [True, True, False, False]  # a rate of 0 freezes the parameters exactly
    (lr,) = get_hyperparam(hist.state)
    assert lr.dtype == jnp.float32 and lr.sharding.is_fully_replicated
    assert len(lr.sharding.device_set) == 2
    # The compiled step serves every epoch: the rate is data, not a baked-in constant.
    with count_compiles() as compiles:
        hist = jaxdist.fit(step, hist.state, s.distribute((x, y), 64), epochs=3,
                           steps_per_epoch=1, verbose=0,
                           callbacks=[LearningRateScheduler(lambda e: 1e-3 * (e + 1))])
    assert compiles() == 0
    assert hist.history["learning_rate"] == pytest.approx([1e-3, 2e-3, 3e-3])


def test_lr_schedule_with_the_current_rate_and_a_nested_dict_state(digits):
    (x, y), _ = digits
    s = jaxdist.OneDeviceStrategy()
    model = models.MLP(hidden=(16,))
    params = model.init(jax.random.key(0), jnp.asarray(x[:1]))["params"]
    # The rate is two levels down: chain -> inject_hyperparams(chain -> inject_hyperparams(sgd)).
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.sgd)(
        learning_rate=0.1))
    state = {"params": params, "opt_state": tx.init(params)}

    def step(st, batch):
        (xb, yb), mask = batch.data, batch.mask
        grads = jax.grad(lambda p: jaxdist.compute_average_loss(
            optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, xb), yb),
            mask))(st["params"])
        updates, opt_state = tx.update(grads, st["opt_state"], st["params"])
        return {"params": optax.apply_updates(st["params"], updates), "opt_state": opt_state}, {}

    hist = jaxdist.fit(s.step(step), state, (x, y), batch_size=64, epochs=3, steps_per_epoch=1,
                       verbose=0, callbacks=[LearningRateScheduler(lambda epoch, lr: lr / 2)])
    assert hist.history["learning_rate"] == pytest.approx([0.05, 0.025, 0.0125])
    assert [float(v) for v in get_hyperparam(hist.state)] == pytest.approx([0.0125])


def test_lr_schedule_explains_how_to_wrap_a_plain_optimizer(digits):
    (x, y), _ = digits
    s = jaxdist.OneDeviceStrategy()
    plain = models.create_train_state(models.MLP(hidden=(16,)), x[:1])  # optax.adam, not injected
    wrap = r"optax\.inject_hyperparams\(optax\.adam\)\(learning_rate=1e-3\)"
    with pytest.raises(ValueError, match=wrap):
        jaxdist.fit(s.step(models.classifier_train_step), plain, (x, y), batch_size=64,
                    callbacks=[LearningRateScheduler(lambda e: 0.1)], verbose=0)
    injected = _state(x, optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
    with pytest.raises(ValueError, match=r"returned 'fast'; it must return a float"):
        LearningRateScheduler(lambda e: "fast").on_epoch_begin(TrainInfo(state=injected))
    # The new value keeps the old one's dtype (no float32 creeping into a bfloat16 state).
    info = TrainInfo(state=_state(x, optax.inject_hyperparams(optax.sgd)(
        learning_rate=jnp.asarray(0.1, jnp.bfloat16))))
    LearningRateScheduler(lambda e: 0.25).on_epoch_begin(info)
    (lr,) = get_hyperparam(info.state)
    assert lr.dtype == jnp.bfloat16 and float(lr) == 0.25
    with pytest.raises(ValueError, match="'momentum'"):
        LearningRateScheduler(lambda e: 0.9, hyperparam="momentum").on_epoch_begin(
            TrainInfo(state=injected))


# --- TensorBoard ----------------------------------------------------------------------------------

def _read_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Parses the event files' TFRecord framing: u64 length, u32 crc, payload, u32 crc."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(glob.glob(f"{log_dir}/events.out.tfevents.*")):
        data = open(path, "rb").read()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            event = Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_tensorboard_writes_epoch_and_batch_scalars(digits, tmp_path):
    (x, y), (xt, yt) = digits
    s = jaxdist.OneDeviceStrategy()
    state = _state(x, optax.inject_hyperparams(optax.adam)(learning_rate=1e-3))
    hist = jaxdist.fit(s.step(models.classifier_train_step), state, (x, y), batch_size=64,
                       epochs=2, steps_per_epoch=4, eval_step=models.classifier_eval_step,
                       eval_data=(xt[:128], yt[:128]), verbose=0, max_in_flight=1,
                       callbacks=[LearningRateScheduler(lambda e: 1e-3),
                                  TensorBoard(tmp_path, update_freq=2)])
    got = _read_scalars(tmp_path)
    for name in ("loss", "accuracy", "val_loss", "val_accuracy", "learning_rate"):
        assert got[f"epoch/{name}"] == [(e, pytest.approx(hist.history[name][e], rel=1e-6))
                                        for e in range(2)]
    # Every 2nd global step; with max_in_flight=1 the logs hold all but the newest step.
    assert [step for step, _ in got["batch/loss"]] == [2, 4, 6, 8]
    assert all(np.isfinite(v) and v > 0 for _, v in got["batch/loss"])
    assert "batch/val_loss" not in got


def test_tensorboard_writes_only_on_process_0_and_validates_update_freq(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="update_freq='often'"):
        TensorBoard(tmp_path, update_freq="often")
    with pytest.raises(ValueError, match="update_freq=0"):
        TensorBoard(tmp_path, update_freq=0)
    assert TensorBoard(tmp_path, update_freq="batch").update_freq == 1
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    tb, info = TensorBoard(tmp_path / "p1", update_freq=1), TrainInfo(step=1, logs={"loss": 1.0})
    tb.on_train_begin(info)
    tb.on_train_batch_end(info)
    tb.on_epoch_end(info)
    tb.close()
    assert not (tmp_path / "p1").exists()


@pytest.mark.parametrize("per_call", [1, 2])
def test_profile_batch_traces_exactly_those_steps(tmp_path, per_call):
    import collections
    import gzip
    import json

    x, y = jaxdist.datasets.synthetic(80, shape=(6,))
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    tb = TensorBoard(str(tmp_path), profile_batch=(3, 6))
    jaxdist.fit(s.step(models.classifier_train_step),
                models.create_train_state(models.MLP(hidden=(8,)), x[:1], seed=0),
                s.distribute((x, y), 10), epochs=1, verbose=0, callbacks=[tb],
                steps_per_execution=per_call)
    assert tb.traced == (3, 6)
    (trace,) = glob.glob(str(tmp_path / "plugins" / "profile" / "*" / "perfetto_trace.json.gz"))
    assert glob.glob(str(tmp_path / "plugins" / "profile" / "*" / "*.xplane.pb"))  # TensorBoard's
    events = json.load(gzip.open(trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = collections.Counter(e.get("name") for e in events)
    # the step's gradient all-reduce runs once per step on each of the 2 devices
    reduces = [c for n, c in names.items() if n and n.startswith("all-reduce")]
    assert reduces and all(c == 4 * 2 for c in reduces), names.most_common(20)


@pytest.mark.parametrize("bad", [(5, 2), (0, 3), "a,b", (1, 2, 3), -1])
def test_a_bad_profile_batch_is_one_line(bad):
    with pytest.raises(ValueError, match="profile_batch=.*expected 0 \\(no trace\\)"):
        TensorBoard("/nonexistent", profile_batch=bad)
