"""A tf.distribute user's script, moved to jaxdist: tf's member names work, tf's habits get errors
that say what to write instead (issue 30).

The migration script below is the shape of TensorFlow's custom training loop tutorial: a dataset
distributed with ``experimental_distribute_dataset``, state created under ``strategy.scope()``, a
per-replica step whose loss is ``compute_average_loss(..., global_batch_size=GLOBAL_BATCH)``,
``strategy.run`` / ``reduce`` / ``experimental_local_results`` in the loop, then Keras-style
``fit`` with a ``ModelCheckpoint`` and a restore.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdist
from jaxdist import models


def _strategies():
    devices = jax.devices()
    return {
        "default": jaxdist.DefaultStrategy(),
        "one_device": jaxdist.OneDeviceStrategy(devices[0]),
        "mirrored": jaxdist.MirroredStrategy(devices[:4]),
        "mirrored_hierarchical": jaxdist.MirroredStrategy(devices[:4],
                                                          cross_device_ops="hierarchical"),
        "central_storage": jaxdist.CentralStorageStrategy(devices[:2]),
        "multi_worker": jaxdist.MultiWorkerMirroredStrategy(),
    }


STRATEGIES = list(_strategies())


def test_a_tf_distribute_custom_loop_then_fit_checkpoint_and_restore(tmp_path):
    # before: experimental_distribute_dataset, scope() and experimental_local_results were
    # AttributeErrors, and compute_average_loss(..., global_batch_size=...) a bare TypeError
    strategy = jaxdist.MirroredStrategy(jax.devices()[:4])
    (x, y), (x_test, y_test) = jaxdist.datasets.digits()
    GLOBAL_BATCH = 32 * strategy.num_replicas_in_sync
    dataset = strategy.experimental_distribute_dataset((x, y), GLOBAL_BATCH, shuffle=True)

    with strategy.scope():
        state = models.create_train_state(models.MLP(hidden=(64,)), x[:1], learning_rate=3e-3)

    def train_step(state, inputs):
        (images, labels), mask = inputs

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, images)
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
            # tf: tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH); the
            # mask keeps a padded last batch's copies out of the sum (tf's last batch is short)
            return jaxdist.compute_average_loss(per_example, mask, global_batch_size=GLOBAL_BATCH)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        grads = jaxdist.all_reduce(grads, jaxdist.ReduceOp.SUM)
        return state.apply_gradients(grads=grads), loss

    losses = []
    with strategy.scope():
        for _epoch in range(3):
            total, batches = 0.0, 0
            for inputs in dataset:
                state, per_replica_losses = strategy.run(train_step, args=(state, inputs))
                total += float(strategy.reduce(jaxdist.ReduceOp.SUM, per_replica_losses,
                                               axis=None))
                batches += 1
                local = strategy.experimental_local_results(per_replica_losses)
                assert len(local) == strategy.num_replicas_in_sync
            losses.append(total / batches)
    assert losses[-1] < losses[0] * 0.7, losses

    state = strategy.to_mirrored(state)  # tf: the mirrored variables after the loop
    ckpt = tmp_path / "ckpt"
    history = jaxdist.fit(strategy.step(models.classifier_train_step), state, dataset, epochs=2,
                          eval_step=models.classifier_eval_step,
                          eval_data=strategy.experimental_distribute_dataset((x_test, y_test),
                                                                             GLOBAL_BATCH),
                          callbacks=[jaxdist.callbacks.ModelCheckpoint(str(ckpt))], verbose=0)
    assert history.history["val_accuracy"][-1] > 0.85, history.history
    manager = jaxdist.checkpoint.CheckpointManager(ckpt)
    # 1438 rows in batches of 128: 12 steps an epoch; 3 epochs of the loop, then 2 of fit
    assert manager.latest_step() == 5 * 12 == int(history.state.step)
    restored = manager.restore(target=history.state, strategy=strategy)
    for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(history.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    accuracy = jaxdist.evaluate(models.classifier_eval_step, restored,
                                strategy.distribute((x_test, y_test), GLOBAL_BATCH))["accuracy"]
    assert accuracy == history.history["val_accuracy"][-1]


@pytest.mark.parametrize("name", STRATEGIES)
def test_tf_member_names_are_aliases_on_every_strategy(name):
    strategy = _strategies()[name]
    data = (np.arange(20, dtype=np.float32).reshape(10, 2), np.arange(10, dtype=np.int32))
    n = strategy.num_replicas_in_sync
    batch = 4 * n
    ours = [b.mask.tolist() for b in strategy.distribute(data, batch)]
    assert [b.mask.tolist() for b in strategy.experimental_distribute_dataset(data, batch)] == ours

    def fn(ctx):
        return [(data[0][i:i + 2], data[1][i:i + 2]) for i in range(0, 10, 2)]

    a = [b.mask.tolist() for b in strategy.experimental_distribute_datasets_from_function(fn)]
    assert a == [b.mask.tolist() for b in strategy.distribute_datasets_from_function(fn)]

    per_replica = strategy.run(lambda: jaxdist.replica_id() * 1.0)
    local = strategy.experimental_local_results(per_replica)
    assert [float(v) for v in local] == [float(v) for v in strategy.local_results(per_replica)]

    with strategy.scope() as scoped:
        assert scoped is strategy
        assert jax.sharding.get_abstract_mesh() == strategy.mesh.abstract_mesh
        state = strategy.put({"w": jnp.ones(3)})  # tf: a variable created in scope
        total = strategy.reduce("sum", strategy.run(lambda s: s["w"].sum(), args=(state,)))
    assert float(total) == 3.0 * n
    assert jax.sharding.get_abstract_mesh().empty  # left as it was


def test_scope_nests_with_a_users_own_mesh():
    strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
    mine = jax.make_mesh((4,), ("batch",), devices=jax.devices()[:4])
    with jax.set_mesh(mine):
        with strategy.scope():
            assert jax.sharding.get_abstract_mesh() == strategy.mesh.abstract_mesh
        assert jax.sharding.get_abstract_mesh() == mine.abstract_mesh


def test_parameter_server_strategy_has_scope_and_experimental_distribute_dataset():
    from jaxdist.ps import LocalCluster

    strategy = jaxdist.ParameterServerStrategy(LocalCluster(num_ps=1, num_workers=2))
    x = np.linspace(-1, 1, 64, dtype=np.float32)
    with strategy.scope() as scoped:
        assert scoped is strategy and jax.sharding.get_abstract_mesh().empty
        data = strategy.experimental_distribute_dataset((x, 3 * x), 16, shuffle=False)
        step = strategy.step(lambda p, b: ((p["w"] * b[0] - b[1]) ** 2).mean(),
                             optimizer=optax.sgd(0.5))
    with data.iterator(epoch=0) as it:
        assert [b[0].tolist() for b in it] == [x[i:i + 16].tolist() for i in range(0, 64, 16)]
    history = jaxdist.fit(step, {"w": np.zeros((), np.float32)}, (x, 3 * x), batch_size=16,
                          epochs=5, verbose=0)
    assert round(float(history.state["w"]), 2) == 3.0
    with pytest.raises(TypeError, match=r"distribute\(\(x, y\), 128\), not"):
        strategy.distribute(x, 3 * x)


# --- tf habits that get an error saying what to write --------------------------------------------

def test_distribute_x_y_says_to_pass_one_tuple():
    # before: "global_batch_size must be a positive int, got array([...])"
    strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
    x, y = np.zeros((8, 2), np.float32), np.zeros(8, np.int32)
    with pytest.raises(TypeError, match=r"got an array of shape \(8,\) as global_batch_size.*"
                                        r"strategy.distribute\(\(x, y\), 128\)"):
        strategy.distribute(x, y)
    with pytest.raises(TypeError, match="pass the unbatched arrays and the global batch size"):
        strategy.experimental_distribute_dataset((x, y))


def test_compute_average_loss_takes_tfs_global_batch_size():
    # before: TypeError: unexpected keyword argument 'global_batch_size'. tf divides the summed
    # loss by it: tf.nn.compute_average_loss([1., 2., 3., 4.], global_batch_size=8) == 10 / 8
    loss = jnp.array([1.0, 2.0, 3.0, 4.0])
    assert float(jaxdist.compute_average_loss(loss, global_batch_size=8)) == 1.25
    assert float(jaxdist.compute_average_loss(loss, global_batch_size=4)) == 2.5  # the mean
    weights = jnp.array([1.0, 0.0, 1.0, 0.5])  # tf: (1 + 3 + 2) / 8
    assert float(jaxdist.compute_average_loss(loss, sample_weight=weights,
                                              global_batch_size=8)) == 0.75
    for bad in (0, -8, 2.5, "8", True):
        with pytest.raises(ValueError, match="takes a positive int"):
            jaxdist.compute_average_loss(loss, global_batch_size=bad)


@pytest.mark.parametrize("n", [1, 2, 8])
def test_global_batch_size_in_the_per_replica_view_sums_to_tfs(n):
    # Each replica divides its own sum by the global batch size: summed over the replicas that is
    # the global mean on a full batch, and tf's number (sum / 8) on the 5 real rows of the last.
    strategy = jaxdist.MirroredStrategy(jax.devices()[:n])
    values = np.arange(13, dtype=np.float32)
    got = []
    for batch in strategy.distribute((values,), 8):
        per_replica = strategy.run(
            lambda b: jaxdist.compute_average_loss(b.data[0], b.mask, global_batch_size=8),
            args=(batch,))
        got.append(float(strategy.reduce("sum", per_replica)))
    assert got == [sum(range(8)) / 8, sum(range(8, 13)) / 8]


def test_reading_a_per_replica_value_as_a_number_points_to_reduce():
    strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
    loss = strategy.run(lambda: jnp.float32(1.0))
    for read in (float, int, lambda v: f"{v:.4f}", np.asarray):
        with pytest.raises(TypeError, match=r"holds one value per replica.*strategy\.reduce\("
                                            r"'sum', value\)"):
            read(loss)
    assert float(strategy.reduce("sum", loss)) == 2.0
    assert str(loss).startswith("PerReplica(") and f"{loss}" == repr(loss)
