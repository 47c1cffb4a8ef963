"""jaxdist.predict: input order, padding removed, gathered from every replica and process."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

import jaxdist
from jaxdist import launch, models
from tests.conftest import REPO

SCRIPT = os.path.join(REPO, "tests", "_scripts", "predict_job.py")


def _expected(x):
    state = models.create_train_state(models.MLP(hidden=(16,)), x[:1], seed=3)
    return np.asarray(state.apply_fn({"params": state.params}, x[:101]))


def test_predict_on_8_devices_keeps_order_and_drops_padding(digits):
    (x, _), _ = digits
    strategy = jaxdist.MirroredStrategy()
    assert strategy.num_replicas_in_sync == 8
    state = models.create_train_state(models.MLP(hidden=(16,)), x[:1], seed=3)
    preds = jaxdist.predict(models.classifier_predict_step, state, strategy.distribute(x[:101], 24))
    assert preds.shape == (101, 10)
    np.testing.assert_allclose(preds, _expected(x), rtol=1e-5, atol=1e-5)
    # Raw data with batch_size, (x, y) pairs and a pytree of outputs work too.
    both = jaxdist.predict(lambda s, b: {"logits": models.classifier_predict_step(s, b),
                                         "label": b.data[1]},
                           state, strategy.distribute((x[:101], np.arange(101)), 24))
    np.testing.assert_array_equal(both["label"], np.arange(101))
    # The state is not consumed.
    assert jax.tree.leaves(state.params)[0].is_deleted() is False


def test_predict_refuses_a_shuffled_dataset(digits):
    (x, _), _ = digits
    strategy = jaxdist.MirroredStrategy()
    state = models.create_train_state(models.MLP(hidden=(16,)), x[:1])
    with pytest.raises(ValueError, match="input order"):
        jaxdist.predict(models.classifier_predict_step, state,
                        strategy.distribute(x[:64], 16, shuffle=True))


@pytest.mark.multiprocess
def test_predict_on_2_processes_gives_every_process_all_predictions(tmp_path, digits):
    (x, _), _ = digits
    res = launch.run([SCRIPT, "--out", str(tmp_path / "preds_RANK.npz")], num_processes=2,
                     devices_per_process=2, timeout_s=240, grace_period_s=10,
                     env={"PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1"}, cwd=REPO)
    assert res.returncode == 0, res.output[-3000:]
    for rank in (0, 1):
        preds = np.load(tmp_path / f"preds_{rank}.npz")["preds"]
        assert preds.shape == (101, 10)
        np.testing.assert_allclose(preds, _expected(x), rtol=1e-5, atol=1e-5)
