"""strategy.run as tf.distribute defines it: fn's own output structure of per-replica values."""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist
from jaxdist import models

COUNTS = [1, 2, 4, 8]


def _mirrored(n, **kw):
    return jaxdist.MirroredStrategy(jax.devices()[:n], **kw)


@pytest.mark.parametrize("n", COUNTS)
def test_run_keeps_the_output_structure(n):
    s = _mirrored(n)
    rid = lambda: jaxdist.replica_id().astype(jnp.float32)  # noqa: E731
    a, b = s.run(lambda: (rid(), rid() * 2))
    assert isinstance(a, jaxdist.PerReplica) and isinstance(b, jaxdist.PerReplica)
    out = s.run(lambda: {"x": rid(), "nested": [rid() + 1, {"y": jnp.ones(3) * rid()}]})
    assert set(out) == {"x", "nested"} and isinstance(out["nested"][1]["y"], jaxdist.PerReplica)
    locals_ = s.local_results(out)
    assert len(locals_) == n
    for r, v in enumerate(locals_):
        assert float(v["x"]) == r and float(v["nested"][0]) == r + 1
        np.testing.assert_array_equal(np.asarray(v["nested"][1]["y"]), np.full(3, r, np.float32))
    total = s.reduce("sum", out)
    assert float(total["x"]) == sum(range(n))
    np.testing.assert_array_equal(np.asarray(total["nested"][1]["y"]), np.full(3, sum(range(n))))
    assert float(s.reduce("mean", b)) == pytest.approx(2 * sum(range(n)) / n)


def test_local_results_of_a_nest_mixing_plain_and_per_replica_values():
    s = _mirrored(4)
    per = s.run(lambda: jaxdist.replica_id())
    res = s.local_results({"id": per, "plain": 7})
    assert [int(r["id"]) for r in res] == [0, 1, 2, 3] and all(r["plain"] == 7 for r in res)
    assert float(s.reduce("mean", {"id": per, "plain": jnp.float32(7)})["plain"]) == 7.0


@pytest.mark.parametrize("n", COUNTS)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_matches_numpy_concatenate(n, axis):
    s = _mirrored(n)
    per = s.run(lambda: jnp.arange(6.0).reshape(2, 3) + 100 * jaxdist.replica_id())
    expected = np.concatenate([np.arange(6.0).reshape(2, 3) + 100 * r for r in range(n)], axis)
    got = s.gather({"v": per}, axis)["v"]
    np.testing.assert_array_equal(np.asarray(got), expected)
    assert got.sharding.is_fully_replicated


def test_gather_errors():
    s = _mirrored(4)
    with pytest.raises(ValueError, match=r"axis=0\) is out of range .*scalar per replica"):
        s.gather(s.run(lambda: jaxdist.replica_id()), 0)
    with pytest.raises(ValueError, match="not per-replica"):
        s.gather(jnp.ones(3), 0)
    assert _mirrored(1).gather(jnp.ones(3), 0).shape == (3,)


@pytest.mark.parametrize("options", [{}, {"cross_device_ops": "hierarchical"}])
@pytest.mark.parametrize("n", COUNTS)
@pytest.mark.parametrize("axis", [0, 1])
def test_all_gather_matches_numpy(n, axis, options):
    s = _mirrored(n, **options)
    x = np.arange(n * 2 * 3, dtype=np.float32).reshape(n * 2, 3)
    batch = jaxdist.Batch(x, np.ones(n * 2, bool))
    out = s.run(lambda b: jaxdist.all_gather({"x": b.data}, axis), args=(batch,))
    expected = np.concatenate(np.split(x, n), axis)
    for v in s.local_results(out):
        np.testing.assert_array_equal(np.asarray(v["x"]), expected)


def test_all_reduce_max_min_and_bad_ops():
    s = _mirrored(4)
    out = s.run(lambda: (jaxdist.all_reduce(jaxdist.replica_id(), "max"),
                         jaxdist.all_reduce(jaxdist.replica_id(), "MIN")))
    assert [(int(a), int(b)) for a, b in s.local_results(out)] == [(3, 0)] * 4
    with pytest.raises(ValueError, match="unknown all_reduce op 'prod'.*'max' or 'min'"):
        s.run(lambda: jaxdist.all_reduce(jnp.ones(()), "prod"))
    with pytest.raises(RuntimeError, match="outside a replica context"):
        jaxdist.all_gather(jnp.ones(3))


def _toy_state_and_batch(s, n_rows=8):
    state = {"w": jnp.ones(3), "step": jnp.int32(0)}
    x = np.arange(n_rows * 3, dtype=np.float32).reshape(n_rows, 3)
    batch = next(iter(s.distribute((x,), n_rows)))
    return state, batch, x


def _toy_step(state, batch):
    g = jax.grad(lambda w: jnp.sum(w * batch.data[0]))(state["w"])
    g = jaxdist.all_reduce(g, "sum")
    return {"w": state["w"] - 0.01 * g, "step": state["step"] + 1}, jnp.sum(g)


@pytest.mark.parametrize("n", [1, 8])
def test_per_replica_state_feeds_back_on_device_without_copies(n):
    s = _mirrored(n)
    state, batch, x = _toy_state_and_batch(s)
    state, loss = s.run(_toy_step, args=(state, batch))
    (old_w,) = jax.tree.leaves(state["w"])  # the array the PerReplica holds (its pytree leaf)
    # Nothing may move between host and device, or between devices, once the state is per-replica.
    with jax.transfer_guard("disallow"):
        state, loss = s.run(_toy_step, args=(state, batch))
        mirrored = s.to_mirrored(state)
    assert old_w.is_deleted()  # donated: the new state lives in its buffers
    assert state["w"].stacked.sharding.is_equivalent_to(s.layout.batch, 2)
    assert mirrored["w"].sharding.is_equivalent_to(s.layout.replicated, 1)
    np.testing.assert_allclose(np.asarray(mirrored["w"]), 1 - 0.02 * x.sum(0), rtol=1e-6)
    assert int(mirrored["step"]) == 2
    np.testing.assert_array_equal(np.asarray(s.local_results(state)[-1]["w"]),
                                  np.asarray(mirrored["w"]))


def test_to_mirrored_check_names_the_leaves_that_differ():
    s = _mirrored(4)
    out = s.run(lambda: {"same": jnp.float32(jnp.nan) * jnp.ones(2),
                         "differs": jaxdist.replica_id().astype(jnp.float32)})
    with pytest.raises(ValueError, match=r"\['differs'\].*all_reduce"):
        s.to_mirrored(out, check=True)
    assert np.isnan(np.asarray(s.to_mirrored({"same": out["same"]}, check=True)["same"])).all()


def test_per_replica_state_goes_to_global_view_steps_and_checkpoints(tmp_path):
    s = _mirrored(4)
    state, batch, _ = _toy_state_and_batch(s)
    state, _ = s.run(_toy_step, args=(state, batch))
    step = s.step(lambda st, b: (st, {"w0": st["w"][0]}))
    _, m = step(state, batch)  # mirrored on the way in
    assert float(m["w0"]) == pytest.approx(float(s.local_results(state)[0]["w"][0]))
    mgr = jaxdist.checkpoint.CheckpointManager(tmp_path, async_save=False)
    with pytest.raises(TypeError, match=r"per-replica.*strategy\.to_mirrored\(state\)"):
        mgr.save(1, state)
    mgr.save(1, s.to_mirrored(state))
    mgr.close()


def test_run_compiles_once_per_function_and_does_not_keep_closures_alive(count_compiles):
    s = _mirrored(2)
    state, batch, _ = _toy_state_and_batch(s)
    captured = jnp.ones(3)

    def make():
        def fn(state, batch):
            return _toy_step(state, batch)[0], jnp.sum(captured)
        return fn

    fn = make()
    state, _ = s.run(fn, args=(state, batch))
    state, _ = s.run(fn, args=(state, batch))  # now per-replica: compiles the steady state
    with count_compiles() as compiles:
        for _ in range(3):
            state, _ = s.run(fn, args=(state, batch))
    assert compiles() == 0
    ref = weakref.ref(fn)
    del fn
    gc.collect()
    assert ref() is None, "the run cache keeps the user's function alive"


def test_run_of_a_bound_method_compiles_once(count_compiles):
    s = _mirrored(2)

    class Trainer:
        def step(self, v):
            return v + 1

    t = Trainer()
    v = s.run(t.step, args=(jnp.float32(0),))
    v = s.run(t.step, args=(v,))
    with count_compiles() as compiles:
        v = s.run(t.step, args=(v,))
    assert compiles() == 0 and [float(r) for r in s.local_results(v)] == [3.0, 3.0]
    ref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is None


def test_run_of_a_method_of_an_unhashable_object_compiles_once(count_compiles):
    import dataclasses

    @dataclasses.dataclass  # eq=True, so instances are not hashable
    class Trainer:
        scale: float = 2.0

        def step(self, v):
            return v * self.scale

    s = _mirrored(2)
    t = Trainer()
    v = s.run(t.step, args=(jnp.float32(1),))
    v = s.run(t.step, args=(v,))
    with count_compiles() as compiles:
        v = s.run(t.step, args=(v,))
    assert compiles() == 0 and [float(r) for r in s.local_results(v)] == [8.0, 8.0]
    ref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is None and not s._run_cache._by_id


def test_static_python_values_and_errors_in_run_arguments():
    s = _mirrored(2)
    out = s.run(lambda v, mode: v * (2 if mode == "double" else 3), args=(jnp.float32(1), "double"))
    assert [float(r) for r in s.local_results(out)] == [2.0, 2.0]
    with pytest.raises(TypeError, match="neither an array nor hashable"):
        s.run(lambda v, bad: v, args=(jnp.float32(1), _Unhashable()))
    with pytest.raises(ValueError, match="leading axis must be 2; was it made by another strategy"):
        s.run(lambda v: v, args=(_mirrored(4).run(lambda: jaxdist.replica_id()),))


class _Unhashable:
    __hash__ = None


def test_per_replica_training_matches_the_global_view(digits):
    (x, y), _ = digits
    s = _mirrored(8)
    data = s.distribute((x[:256], y[:256]), 64)
    step = s.step(models.classifier_train_step)
    g = p = models.create_train_state(models.MLP(hidden=(16,)), x[:1], seed=0)
    for batch in data:
        g, _ = step(g, batch)
        p, metrics = s.run(models.classifier_replica_step, args=(p, batch))
    p = s.to_mirrored(p, check=True)
    for a, b in zip(jax.tree.leaves(g.params), jax.tree.leaves(p.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    assert set(s.reduce("sum", metrics)) == {"loss", "accuracy"}
