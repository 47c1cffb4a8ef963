"""ModelCheckpoint: monitor / mode / save_best_only, keep-N, save policies, template-free restore."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

import jaxdist
from jaxdist import models
from jaxdist.callbacks import AnyOf, BestMetric, EveryNEpochs, EveryNSteps, ModelCheckpoint, SaveCandidate
from jaxdist.checkpoint import CheckpointManager

STEPS_PER_EPOCH = 12  # 1438 rows / 128


def _fit(digits, callbacks, epochs=5):
    (x, y), (xt, yt) = digits
    strategy = jaxdist.MirroredStrategy()
    # A rate that overshoots now and then, so that validation metrics do not improve every epoch.
    state = models.create_train_state(models.MLP(hidden=(32,)), x[:1], tx=optax.sgd(0.9))
    return jaxdist.fit(strategy.step(models.classifier_train_step), state,
                       strategy.distribute((x, y), 128, shuffle=True), epochs=epochs,
                       eval_step=models.classifier_eval_step,
                       eval_data=strategy.distribute((xt[:128], yt[:128]), 128),
                       callbacks=callbacks, verbose=0)


def _improving_epochs(values, mode):
    best, out = None, []
    for e, v in enumerate(values):
        if best is None or (v < best if mode == "min" else v > best):
            best = v
            out.append(e)
    return out


@pytest.mark.parametrize("monitor,mode", [("val_loss", "min"), ("val_accuracy", "max")])
def test_save_best_only_saves_exactly_when_the_monitor_improves(tmp_path, digits, monitor, mode):
    mc = ModelCheckpoint(tmp_path, monitor=monitor, save_best_only=True, max_to_keep=None,
                         async_save=False)
    assert mc.mode == mode  # "auto"
    hist = _fit(digits, [mc], epochs=6)
    expected = [(e + 1) * STEPS_PER_EPOCH for e in _improving_epochs(hist.history[monitor], mode)]
    assert 1 < len(expected) < 6  # some epochs improved and some did not
    assert CheckpointManager(tmp_path).all_steps() == expected
    assert mc.best == (min if mode == "min" else max)(hist.history[monitor])


def test_keep_best_n_keeps_the_best_epochs(tmp_path, digits):
    mc = ModelCheckpoint(tmp_path, monitor="val_loss", max_to_keep=2, keep="best", async_save=False)
    hist = _fit(digits, [mc], epochs=5)
    best_two = sorted(np.argsort(hist.history["val_loss"])[:2])
    assert CheckpointManager(tmp_path).all_steps() == [(e + 1) * STEPS_PER_EPOCH for e in best_two]


def test_keep_latest_n(tmp_path, digits):
    _fit(digits, [ModelCheckpoint(tmp_path, max_to_keep=2, async_save=False)], epochs=4)
    assert CheckpointManager(tmp_path).all_steps() == [36, 48]


@dataclasses.dataclass(frozen=True)
class OddEpochs:
    """A user's own policy: anything with should_save(candidate, previous)."""

    def should_save(self, candidate, previous):
        return candidate.epoch_end and candidate.epoch % 2 == 1


def test_policy_objects_decide_when_to_save(tmp_path, digits):
    _fit(digits, [ModelCheckpoint(tmp_path / "a", policy=OddEpochs(), max_to_keep=None,
                                  async_save=False)], epochs=4)
    assert CheckpointManager(tmp_path / "a").all_steps() == [24, 48]
    _fit(digits, [ModelCheckpoint(tmp_path / "b", policy=AnyOf(EveryNSteps(5), EveryNEpochs(2)),
                                  max_to_keep=None, async_save=False)], epochs=2)
    assert CheckpointManager(tmp_path / "b").all_steps() == [5, 10, 15, 20, 24]


def test_best_metric_policy_is_stateless():
    p = BestMetric("val_accuracy")
    c = lambda s, v: SaveCandidate(s, s, True, {"val_accuracy": v})  # noqa: E731
    assert p.should_save(c(1, 0.5), [])
    assert not p.should_save(c(2, 0.4), [c(1, 0.5)])
    assert p.should_save(c(3, 0.6), [c(1, 0.5)])
    assert not p.should_save(SaveCandidate(4, 4, True, {"loss": 1.0}), [])  # monitor missing
    with pytest.raises(ValueError, match="policy= or save_best_only"):
        ModelCheckpoint("/tmp/x", policy=p, save_best_only=True)


def test_restore_for_inference_without_a_template(tmp_path, digits):
    (x, _), _ = digits
    hist = _fit(digits, [ModelCheckpoint(tmp_path, async_save=False)], epochs=2)
    mgr = CheckpointManager(tmp_path)
    strategy = jaxdist.MirroredStrategy()
    tree = mgr.restore(strategy=strategy)  # no target: shapes and dtypes from the checkpoint
    assert set(tree) >= {"params", "opt_state", "step"} and int(tree["step"]) == 24
    for a, b in zip(jax.tree.leaves(tree["params"]), jax.tree.leaves(hist.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    model = models.MLP(hidden=(32,))
    preds = jaxdist.predict(lambda p, b: model.apply({"params": p}, b.data), tree["params"],
                            strategy.distribute(x[:40], 16))
    np.testing.assert_allclose(preds, model.apply({"params": hist.state.params}, x[:40]),
                               rtol=1e-5, atol=1e-5)


class _ResumeAt(jaxdist.callbacks.Callback):
    def __init__(self, resume):
        self.resume = resume

    def on_train_begin(self, info):
        return self.resume


def test_resume_is_a_value_a_callback_returns(digits):
    (x, y), _ = digits
    strategy = jaxdist.MirroredStrategy()
    state = models.create_train_state(models.MLP(hidden=(8,)), x[:1])
    resume = jaxdist.callbacks.Resume(state=state, step=30, epoch=2, position=6)
    seen = []

    class Record(jaxdist.callbacks.Callback):
        def on_epoch_begin(self, info):
            seen.append((info.epoch, info.position, info.step))

    hist = jaxdist.fit(strategy.step(models.classifier_train_step), state,
                       strategy.distribute((x, y), 128), epochs=3,
                       callbacks=[_ResumeAt(resume), Record()], verbose=0)
    assert seen == [(2, 6, 30)] and hist.epochs == [2]
    with pytest.raises(ValueError, match="two callbacks resume"):
        jaxdist.fit(strategy.step(models.classifier_train_step), state,
                    strategy.distribute((x, y), 128), epochs=1,
                    callbacks=[_ResumeAt(resume), _ResumeAt(resume)], verbose=0)


def test_a_second_fit_names_checkpoints_by_the_states_step(tmp_path, digits):
    # before: the second fit, continuing from state.step 12, wrote step 12 again (this fit's
    # count), over the first fit's checkpoint; the API contract says "ModelCheckpoint names
    # checkpoints by state.step"
    first = _fit(digits, [ModelCheckpoint(tmp_path, max_to_keep=None, async_save=False)], epochs=1)
    assert int(first.state.step) == STEPS_PER_EPOCH
    (x, y), _ = digits
    strategy = jaxdist.MirroredStrategy()
    mc = ModelCheckpoint(tmp_path, max_to_keep=None, async_save=False, save_freq=5)
    second = jaxdist.fit(strategy.step(models.classifier_train_step), first.state,
                         strategy.distribute((x, y), 128, shuffle=True), epochs=1,
                         callbacks=[mc], verbose=0)
    assert int(second.state.step) == 2 * STEPS_PER_EPOCH
    # every 5 steps of the state's count (15, 20) and the epoch end (24)
    assert CheckpointManager(tmp_path).all_steps() == [12, 15, 20, 24]
    restored = CheckpointManager(tmp_path).restore(24, target=second.state, strategy=strategy)
    assert int(restored.step) == 24
