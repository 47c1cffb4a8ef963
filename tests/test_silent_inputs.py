"""Values that used to be accepted silently: NaN data, out-of-range uint64 labels, odd numbers."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxdist
from jaxdist import launch, models
from jaxdist.cluster import ClusterSpec


def _data(n=40):
    return jaxdist.datasets.synthetic(n, shape=(6,))


def test_nan_in_in_memory_data_warns_naming_the_leaf():
    x, y = _data()
    x = x.copy()
    x[3, 2], x[7, 0] = np.nan, np.inf
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    with pytest.warns(RuntimeWarning, match=r"dataset leaf data\[0\] \(float32\) has 1 NaN and 1 "
                                            r"inf.*TerminateOnNaN"):
        s.distribute((x, y), 10)


def test_terminate_on_nan_stops_fit_within_a_few_steps():
    x, y = _data()
    x = x.copy()
    x[12:] = np.nan  # batch 2 onwards (batch size 4)
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    state = models.create_train_state(models.MLP(hidden=(16,)), x[:1], seed=0)
    with pytest.warns(RuntimeWarning):
        data = s.distribute((x, y), 4)
    cb = jaxdist.callbacks.TerminateOnNaN()
    history = jaxdist.fit(s.step(models.classifier_train_step), state, data, epochs=3,
                          callbacks=[cb], verbose=0)
    # NaN from step 4 on; metrics are read a few steps late; an epoch has 10 steps.
    assert cb.stopped_step is not None and 4 <= cb.stopped_step < 10
    assert history.epochs == [0] and np.isnan(history.history["loss"][0])


@pytest.mark.parametrize("labels, dtype", [([0, 2**63], np.uint64), ([0, -2**40], np.int64),
                                           ([0, 2**32], np.int64)])
def test_labels_that_do_not_fit_jax_dtype_are_refused(labels, dtype):
    if jax.config.jax_enable_x64:
        pytest.skip("64-bit mode keeps the values")
    x, _ = _data(2)
    y = np.array(labels, dtype)
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    with pytest.raises(ValueError, match=rf"dataset leaf data\[1\] \({np.dtype(dtype)}\) holds "
                                         rf"{labels[1]}, which does not fit "
                                         rf"{'uint32' if dtype == np.uint64 else 'int32'}.*"
                                         r"jax_enable_x64"):
        s.distribute((x, y), 2)
    with pytest.raises(ValueError, match=r"batch 0 of the dataset leaf data\['y'\]"):
        list(s.distribute([{"x": x, "y": y}], 2))
    # In range, 64-bit labels are fine (the usual numpy default).
    assert len(s.distribute((x, np.array([0, 9], dtype)), 2)) == 1


@pytest.mark.parametrize("text", [" 2 ", "2 ", "+2", "\u0662", "\u0968", "2.0", "0x2"])
def test_process_counts_must_be_ascii_digits(text, capsys):
    env = {"JAXDIST_COORDINATOR": "127.0.0.1:1234", "JAXDIST_NUM_PROCESSES": text,
           "JAXDIST_PROCESS_ID": "0"}
    with pytest.raises(ValueError, match="JAXDIST_NUM_PROCESSES = .*not an integer"):
        ClusterSpec.from_env(env)
    with pytest.raises(ValueError, match="JAXDIST_PROCESS_ID = .*not an integer"):
        ClusterSpec.from_env({**env, "JAXDIST_NUM_PROCESSES": "2", "JAXDIST_PROCESS_ID": text})
    for flag in ("-n", "--devices-per-process", "--max-restarts", "--port"):
        argv = ["-n", "2", flag, text, "x.py"] if flag != "-n" else ["-n", text, "x.py"]
        with pytest.raises(SystemExit) as info:
            launch.main(argv)
        assert info.value.code == 2
        assert "not an integer" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not an integer in 1..65535"):
        ClusterSpec(f"h:{text}", 1, 0)


@pytest.mark.parametrize("index", ["0", True, False, 0.0, None])
def test_tf_config_index_of_the_wrong_type_is_not_an_integer(index):
    config = {"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": index}}
    with pytest.raises(ValueError, match=r"TF_CONFIG\['task'\]\['index'\] = .*: not an integer "
                                         r"\(a JSON .*\).*expected a number in 0..1") as info:
        ClusterSpec.from_tf_config(config)
    assert "out of range" not in str(info.value)


# --- issue 19 -----------------------------------------------------------------------------------

def test_terminate_on_nan_fires_when_an_epoch_is_shorter_than_the_run_ahead_window():
    # before: 3 epochs of 4 steps (= max_in_flight) all trained on NaN, stopped_step None
    x, y = _data()
    x = np.full_like(x[:16], np.nan)
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    state = models.create_train_state(models.MLP(hidden=(16,)), x[:1], seed=0)
    with pytest.warns(RuntimeWarning):
        data = s.distribute((x, y[:16]), 4)
    cb = jaxdist.callbacks.TerminateOnNaN()
    history = jaxdist.fit(s.step(models.classifier_train_step), state, data, epochs=3,
                          callbacks=[cb], verbose=0)
    assert history.epochs == [0] and cb.stopped_step == 4


def test_fit_on_an_empty_dataset_raises_a_clear_error():
    # before: an empty history, no error, and epoch 0 skipped as if resumed
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    data = s.distribute((np.zeros((0, 3), np.float32), np.zeros((0,), np.int32)), 4)
    with pytest.raises(ValueError, match="fit data is empty: 0 examples give no batch"):
        jaxdist.fit(lambda st, b: (st, {"loss": st.sum()}), jax.numpy.zeros(3), data, verbose=0)
    with pytest.raises(ValueError, match="steps_per_epoch=0"):
        jaxdist.fit(lambda st, b: (st, {"loss": st.sum()}), jax.numpy.zeros(3),
                    s.distribute(_data(), 4), steps_per_epoch=0, verbose=0)


def test_fit_warns_when_labels_outside_the_model_s_classes_train_to_nan():
    # before: labels of 200 for a 10-class model gave loss NaN in every epoch and no warning
    x, y = _data(64)
    y = y.copy()
    y[::7] = 200
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    state = models.create_train_state(models.MLP(hidden=(16,)), x[:1], seed=0)
    with pytest.warns(RuntimeWarning, match=r"loss became NaN or Inf by step \d+ \(epoch 0\).*"
                                            r"labels outside the model's classes") as record:
        history = jaxdist.fit(s.step(models.classifier_train_step), state,
                              s.distribute((x, y), 16), epochs=2, verbose=0)
    assert np.isnan(history.history["loss"]).all()
    assert sum("became NaN" in str(w.message) for w in record) == 1  # once per fit
