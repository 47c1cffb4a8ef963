"""The user's own JAX meshes: Explicit axes (``jax.make_mesh``'s default), ``jax.set_mesh``
contexts, and strategies built on a mesh the user already has (``mesh=``, ``data_axes=``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding

import jaxdist

X = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
Y = np.random.default_rng(1).normal(size=(16, 2)).astype(np.float32)
W = np.random.default_rng(2).normal(size=(4, 2)).astype(np.float32)


def _step(state, batch):
    x, y = batch.data if isinstance(batch, jaxdist.Batch) else batch

    def loss(w):
        return jnp.mean((x @ w["w"] - y) ** 2)

    value, grads = jax.value_and_grad(loss)(state)
    return jax.tree.map(lambda a, g: a - 0.1 * g, state, grads), value


def _reference(steps=1):
    w = {"w": jnp.asarray(W)}
    for _ in range(steps):
        w, value = jax.jit(_step)(w, (jnp.asarray(X), jnp.asarray(Y)))
    return w, value


def _explicit_mesh(n=8, names=("data",), shape=None):
    return jax.make_mesh(shape or (n,), names, devices=jax.devices()[:n])


def _close(a, b):
    # float32 sums over 16 rows reduced in a different order on 8 devices: a few ulps.
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_make_mesh_is_explicit_here():
    assert _explicit_mesh().axis_types == (AxisType.Explicit,)


def test_batch_on_a_users_explicit_mesh():
    mesh = _explicit_mesh()
    on_mesh = NamedSharding(mesh, jax.P("data"))
    batch = (jax.device_put(X, on_mesh), jax.device_put(Y, on_mesh))
    step = jaxdist.mirrored(_step)
    w, value = step({"w": jnp.asarray(W)}, batch)
    ref_w, ref_value = _reference()
    _close(w["w"], ref_w["w"])
    _close(value, ref_value)


@pytest.mark.parametrize("placed", [True, False])
def test_step_called_inside_set_mesh(placed):
    mesh = _explicit_mesh()
    step = jaxdist.mirrored(_step)
    with jax.set_mesh(mesh):
        batch = (X, Y)
        if placed:
            batch = tuple(jax.device_put(v, jax.P("data")) for v in batch)
        w, value = step({"w": jnp.asarray(W)}, batch)
    _close(w["w"], _reference()[0]["w"])


def test_run_and_reduce_inside_set_mesh():
    s = jaxdist.MirroredStrategy(jax.devices()[:8])
    batch = next(iter(s.distribute((X,), 16)))
    with jax.set_mesh(_explicit_mesh()):
        out = s.run(lambda b: jnp.sum(b.data[0], axis=0), args=(batch,))
        total = s.reduce("sum", out)
    _close(total, X.sum(axis=0))


def test_batch_replaced_without_copy():
    mesh = _explicit_mesh()
    x = jax.device_put(X, NamedSharding(mesh, jax.P("data")))
    s = jaxdist.MirroredStrategy(jax.devices()[:8])
    placed = s.layout.put_batch((x,))[0]
    assert placed.sharding.mesh == s.mesh
    def ptrs(a):
        return sorted(sh.data.unsafe_buffer_pointer() for sh in a.addressable_shards)
    assert ptrs(placed) == ptrs(x)


def test_strategy_on_the_users_mesh_with_a_model_axis():
    mesh = _explicit_mesh(8, ("data", "model"), (4, 2))
    s = jaxdist.MirroredStrategy(mesh=mesh, data_axes=("data",))
    assert s.num_replicas_in_sync == 4
    assert s.mesh.devices.tolist() == mesh.devices.tolist()
    assert s.mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    assert s == jaxdist.MirroredStrategy(mesh=mesh, data_axes="data")
    assert hash(s) == hash(jaxdist.MirroredStrategy(mesh=mesh, data_axes=("data",)))
    assert s != jaxdist.MirroredStrategy(jax.devices()[:4])
    # The user's code shards the weight's columns over "model"; jaxdist keeps that layout.
    w = {"w": jax.device_put(W, NamedSharding(mesh, jax.P(None, "model")))}
    step = s.step(_step)
    batches = list(s.distribute((X, Y), 16))
    assert len(batches) == 1 and batches[0].data[0].sharding.spec == jax.P(("data",))
    new_w, value = step(w, batches[0])
    assert new_w["w"].sharding.spec == jax.P(None, "model")
    assert new_w["w"].sharding.mesh == s.mesh
    new_w, value = step(new_w, batches[0])
    ref_w, ref_value = _reference(steps=2)
    _close(new_w["w"], ref_w["w"])
    _close(value, ref_value)
    # One copy per replica: each replica's 2 devices hold the two column halves.
    assert len({str(sh.index) for sh in new_w["w"].addressable_shards}) == 2


def test_per_replica_view_on_the_users_mesh():
    mesh = _explicit_mesh(8, ("data", "model"), (4, 2))
    s = jaxdist.MirroredStrategy(mesh=mesh, data_axes=("data",))
    batch = next(iter(s.distribute((X,), 16)))
    out = s.run(lambda b: jaxdist.all_reduce(jnp.sum(b.data[0]), "sum"), args=(batch,))
    assert len(s.local_results(out)) == 4
    _close(s.reduce("mean", out), X.sum())
    assert [int(r) for r in s.local_results(s.run(jaxdist.replica_id))] == [0, 1, 2, 3]


@pytest.mark.parametrize("cls", [jaxdist.MirroredStrategy, jaxdist.CentralStorageStrategy,
                                 jaxdist.MultiWorkerMirroredStrategy])
def test_each_mesh_strategy_takes_the_users_mesh(cls):
    mesh = _explicit_mesh(4)
    s = cls(mesh=mesh)
    assert s.num_replicas_in_sync == 4 and s.layout.data_axes == ("data",)
    state = s.put({"w": jnp.asarray(W)})
    step = s.step(_step)
    for batch in s.distribute((X, Y), 16):
        state, value = step(state, batch)
    _close(state["w"], _reference()[0]["w"])


@pytest.mark.parametrize("cls", [jaxdist.MirroredStrategy, jaxdist.MultiWorkerMirroredStrategy,
                                 jaxdist.CentralStorageStrategy])
def test_each_mesh_strategy_on_a_users_mesh_with_a_model_axis(cls):
    # TPUStrategy takes the same keywords but needs TPUs; the others run here.
    mesh = _explicit_mesh(8, ("data", "model"), (4, 2))
    s = cls(mesh=mesh, data_axes=("data",))
    assert s.num_replicas_in_sync == 4
    w = {"w": jax.device_put(W, NamedSharding(mesh, jax.P(None, "model")))}
    step = s.step(_step)
    with jax.set_mesh(mesh):
        for _ in range(2):
            for batch in s.distribute((X, Y), 16):
                w, value = step(w, batch)
        out = s.run(lambda b: jnp.sum(b.data[0], axis=0), args=(batch,))
        _close(s.reduce("sum", out), X.sum(axis=0))
    _close(w["w"], _reference(steps=2)[0]["w"])
    if cls is not jaxdist.CentralStorageStrategy:  # that one keeps its copy in host memory
        assert w["w"].sharding.spec == jax.P(None, "model")


def test_fit_evaluate_and_predict_inside_set_mesh():
    s = jaxdist.MirroredStrategy(jax.devices()[:8])

    def loss_fn(w, batch):
        (x, y), mask = batch
        return jaxdist.compute_average_loss(jnp.mean((x @ w - y) ** 2, axis=1), mask)

    def train_step(w, batch):
        loss, grads = jax.value_and_grad(loss_fn)(w, batch)
        return w - 0.1 * grads, {"loss": loss}

    def eval_step(w, batch):
        return {"loss": loss_fn(w, batch)}

    def everything():
        data = s.distribute((X[:13], Y[:13]), 8)  # a padded last batch too
        hist = jaxdist.fit(s.step(train_step), jnp.asarray(W), data, epochs=2,
                           eval_step=s.step(eval_step), eval_data=data, verbose=0)
        evaluated = jaxdist.evaluate(s.step(eval_step), hist.state, data)
        predicted = jaxdist.predict(lambda w, b: b.data[0] @ w, hist.state, data)
        return hist.history, evaluated, np.asarray(predicted), np.asarray(hist.state)

    outside = everything()
    with jax.set_mesh(_explicit_mesh()):
        inside = everything()
    # The same programs on the same devices: the same numbers, bit for bit.
    assert inside[:2] == outside[:2]
    np.testing.assert_array_equal(inside[2], outside[2])
    np.testing.assert_array_equal(inside[3], outside[3])


def test_fit_with_optax_on_the_users_mesh():
    mesh = _explicit_mesh(8, ("batch",))
    s = jaxdist.MirroredStrategy(mesh=mesh, data_axes="batch")
    opt = optax.sgd(0.1)

    def step(state, batch):
        params, opt_state = state
        x, y = batch.data
        loss, grads = jax.value_and_grad(
            lambda p: jaxdist.compute_average_loss(jnp.mean((x @ p - y) ** 2, axis=1),
                                                   batch.mask))(params)
        updates, opt_state = opt.update(grads, opt_state)
        return (optax.apply_updates(params, updates), opt_state), {"loss": loss}

    params = jnp.asarray(W)
    hist = jaxdist.fit(s.step(step), (params, opt.init(params)), s.distribute((X, Y), 8),
                       epochs=2, verbose=0)
    assert len(hist.history["loss"]) == 2 and np.isfinite(hist.history["loss"]).all()


def test_mesh_option_errors():
    mesh = _explicit_mesh(4)
    with pytest.raises(ValueError, match="not both"):
        jaxdist.MirroredStrategy(jax.devices()[:4], mesh=mesh)
    with pytest.raises(ValueError, match="model"):
        jaxdist.MirroredStrategy(mesh=mesh, data_axes=("model",))
    with pytest.raises(ValueError, match="mesh="):
        jaxdist.MirroredStrategy(data_axes=("data",))
    with pytest.raises(TypeError, match="jax.sharding.Mesh"):
        jaxdist.MirroredStrategy(mesh=mesh.abstract_mesh)
    # A positional call still means devices, as before.
    assert jaxdist.MirroredStrategy(jax.devices()[:2], "ring").cross_device_ops == "ring"
    assert jaxdist.MirroredStrategy().mesh.axis_names == ("data",)
    assert repr(jaxdist.MirroredStrategy()) == (
        "MirroredStrategy(devices=None, cross_device_ops='xla', pack_bytes=None, compress=None, "
        "zero_stage=0)")
    assert repr(jaxdist.MirroredStrategy(mesh=mesh)).endswith(f"mesh={mesh!r}, data_axes=('data',))")


@pytest.mark.parametrize("module", ["jax._src.api", "jaxdist.core.layout"])
def test_jax_deprecations_are_errors_in_this_suite(module):
    # pyproject's filterwarnings: a deprecation JAX attributes to itself or to jaxdist's own call
    # fails the test, so jaxdist keeps to current JAX idioms.
    import warnings

    with pytest.raises(DeprecationWarning):
        warnings.warn_explicit("an old idiom", DeprecationWarning, "x.py", 1, module=module)
