"""Model libraries as users bring them: Equinox modules, Flax NNX modules, plain pytrees + optax.

A state may hold leaves that are not arrays (an Equinox module's activation functions, say):
only its arrays are placed, traced, donated and checkpointed; the rest travel unchanged.
"""

from __future__ import annotations

import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist
from tests.conftest import run_python

RNG = np.random.default_rng(0)
X = RNG.normal(size=(20, 4)).astype(np.float32)   # 20 rows: the last batch of 8 is partial
Y = RNG.normal(size=(20, 2)).astype(np.float32)
OPT = optax.sgd(0.1)


def _close(a, b):
    # Float32 sums over the batch, reduced in another order on several devices: a few ulps of
    # values of order 1, compounded over a handful of steps.
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


# --- Equinox -------------------------------------------------------------------------------------

def _eqx_state():
    model = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0))
    return model, OPT.init(eqx.filter(model, eqx.is_array))


def _eqx_loss(model, x, y, mask):
    return jaxdist.compute_average_loss(jnp.mean((jax.vmap(model)(x) - y) ** 2, axis=1), mask)


def eqx_train_step(state, batch):
    model, opt_state = state
    (x, y), mask = batch
    loss, grads = eqx.filter_value_and_grad(_eqx_loss)(model, x, y, mask)
    updates, opt_state = OPT.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return (eqx.apply_updates(model, updates), opt_state), {"loss": loss}


def eqx_replica_step(state, batch):
    model, opt_state = state
    (x, y), mask = batch
    loss, grads = eqx.filter_value_and_grad(_eqx_loss)(model, x, y, mask)
    grads = jaxdist.all_reduce(grads, "sum")  # local sum / global count: the sum is the mean's
    updates, opt_state = OPT.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return (eqx.apply_updates(model, updates), opt_state), loss


def _arrays(tree):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def _eqx_reference(epochs=1):
    state = _eqx_state()
    for _ in range(epochs):
        for i in range(0, 20, 8):
            mask = np.arange(8) < 20 - i
            xb, yb = X[i:i + 8], Y[i:i + 8]
            pad = 8 - len(xb)
            xb, yb = np.concatenate([xb, xb[:pad]]), np.concatenate([yb, yb[:pad]])
            # jit of a module with function leaves: filter_jit's way, by hand
            state, _ = eqx.filter_jit(eqx_train_step)(state, jaxdist.Batch((xb, yb), mask))
    return state


@pytest.mark.parametrize("n, cls", [(1, jaxdist.MirroredStrategy), (4, jaxdist.MirroredStrategy),
                                    (4, jaxdist.CentralStorageStrategy)])
def test_equinox_module_in_the_decorator_and_fit(n, cls):
    s = cls(jax.devices()[:n])
    step = s.step(eqx_train_step)
    state = _eqx_state()
    for batch in s.distribute((X, Y), 8):
        state, metrics = step(state, batch)
    assert isinstance(state[0], eqx.nn.MLP) and state[0].activation is jax.nn.relu
    ref = _eqx_reference()
    for a, b in zip(_arrays(state), _arrays(ref)):
        _close(a, b)
    hist = jaxdist.fit(step, _eqx_state(), s.distribute((X, Y), 8), epochs=2, verbose=0)
    for a, b in zip(_arrays(hist.state), _arrays(_eqx_reference(epochs=2))):
        _close(a, b)
    out = jaxdist.predict(lambda st, b: jax.vmap(st[0])(b.data[0]), hist.state,
                          s.distribute((X, Y), 8))
    on_host = jax.tree.map(lambda v: np.asarray(v) if isinstance(v, jax.Array) else v,
                           hist.state[0])  # CentralStorageStrategy keeps it in host memory
    _close(out, jax.vmap(on_host)(X))


def test_equinox_step_compiles_once(count_compiles):
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    step = s.step(eqx_train_step)
    batches = list(s.distribute((X[:16], Y[:16]), 8))
    state, _ = step(_eqx_state(), batches[0])
    with count_compiles() as compiles:
        for _ in range(3):
            for b in batches:
                state, _ = step(state, b)
    assert compiles() == 0


def test_equinox_module_in_strategy_run_matches_the_global_view():
    s = jaxdist.MirroredStrategy(jax.devices()[:4])
    state = _eqx_state()
    for batch in s.distribute((X, Y), 8):
        state, loss = s.run(eqx_replica_step, args=(state, batch))
    assert state[0].activation is jax.nn.relu
    mirrored = s.to_mirrored(state)
    for a, b in zip(_arrays(mirrored), _arrays(_eqx_reference())):
        _close(a, b)


def test_equinox_checkpoint_restores_on_another_device_count(tmp_path):
    s = jaxdist.MirroredStrategy(jax.devices()[:4])
    step = s.step(eqx_train_step)
    state = _eqx_state()
    for batch in s.distribute((X, Y), 8):
        state, _ = step(state, batch)
    mgr = jaxdist.checkpoint.CheckpointManager(tmp_path, async_save=False)
    mgr.save(3, state)
    other = jaxdist.MirroredStrategy(jax.devices()[:2])
    back = mgr.restore(target=_eqx_state(), strategy=other)
    assert isinstance(back[0], eqx.nn.MLP) and back[0].activation is jax.nn.relu
    for a, b in zip(_arrays(back), _arrays(state)):
        np.testing.assert_array_equal(a, b)
    # The restored state trains on the other strategy.
    back, _ = other.step(eqx_train_step)(back, next(iter(other.distribute((X, Y), 8))))


# --- Flax NNX --------------------------------------------------------------------------------------

class NNXMLP(nnx.Module):
    def __init__(self, *, rngs):
        self.hidden = nnx.Linear(4, 8, rngs=rngs)
        self.out = nnx.Linear(8, 2, rngs=rngs)
        self.act = jax.nn.relu   # a function attribute: a static leaf

    def __call__(self, x):
        return self.out(self.act(self.hidden(x)))


def _nnx_loss(model, x, y, mask):
    return jaxdist.compute_average_loss(jnp.mean((model(x) - y) ** 2, axis=1), mask)


def test_nnx_split_merge_step_and_module_passed_directly():
    s = jaxdist.MirroredStrategy(jax.devices()[:4])
    graphdef, params = nnx.split(NNXMLP(rngs=nnx.Rngs(0)))

    def split_step(params, batch):
        (x, y), mask = batch
        loss, grads = jax.value_and_grad(
            lambda p: _nnx_loss(nnx.merge(graphdef, p), x, y, mask))(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    def module_step(model, batch):
        (x, y), mask = batch
        loss, grads = nnx.value_and_grad(_nnx_loss)(model, x, y, mask)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(model, nnx.Param), grads)
        nnx.update(model, params)
        return model, loss

    a, b = params, NNXMLP(rngs=nnx.Rngs(0))
    for batch in s.distribute((X, Y), 8):
        a, la = s.step(split_step)(a, batch)
        b, lb = s.step(module_step)(b, batch)
    _close(la, lb)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(nnx.state(b, nnx.Param))):
        _close(x, y)


def test_cli_trains_an_nnx_factory(tmp_path):
    (tmp_path / "nnx_user.py").write_text(textwrap.dedent("""
        import jax
        from flax import nnx

        class Net(nnx.Module):
            def __init__(self, num_classes, *, rngs):
                self.hidden = nnx.Linear(64, 32, rngs=rngs)
                self.out = nnx.Linear(32, num_classes, rngs=rngs)

            def __call__(self, x):
                return self.out(jax.nn.relu(self.hidden(x.reshape(x.shape[0], -1))))

        def make(num_classes):
            return Net(num_classes, rngs=nnx.Rngs(0))
    """))
    proc = run_python(["-m", "jaxdist.cli", "train", "--devices", "2", "--model", "nnx_user:make",
                       "--epochs", "2", "--quiet", "--checkpoint-dir", str(tmp_path / "ck")],
                      timeout=300, env={"PYTHONPATH": f"{tmp_path}:{run_python.__globals__['REPO']}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "test accuracy" in proc.stdout


# --- plain pytrees + optax -----------------------------------------------------------------------

def test_plain_pytree_with_optax_adam_and_a_name_leaf():
    opt = optax.adam(1e-2)
    params = {"w": jnp.zeros((4, 2)), "b": jnp.zeros(2)}
    state = {"params": params, "opt": opt.init(params), "name": "linear-probe"}

    def step(state, batch):
        (x, y), mask = batch
        loss, grads = jax.value_and_grad(lambda p: jaxdist.compute_average_loss(
            jnp.mean((x @ p["w"] + p["b"] - y) ** 2, axis=1), mask))(state["params"])
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        return {**state, "params": optax.apply_updates(state["params"], updates),
                "opt": opt_state}, {"loss": loss}

    s = jaxdist.MirroredStrategy(jax.devices()[:8])
    hist = jaxdist.fit(s.step(step), state, s.distribute((X, Y), 8), epochs=3, verbose=0)
    assert hist.state["name"] == "linear-probe"
    assert hist.history["loss"][-1] < hist.history["loss"][0]
