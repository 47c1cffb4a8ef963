"""zero_stage 1|2|3: sharded state gives stage 0's numbers, on 1-8 devices, with less memory."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdist
from jaxdist import models, zero
from jaxdist.checkpoint import CheckpointManager

TOL = 2e-5
HIDDEN = (256, 128)  # kernels 64x256 and 256x128 are sharded; 128x10 and the biases stay replicated


@pytest.fixture(scope="module")
def data():
    (x, y), (xt, yt) = jaxdist.datasets.digits()
    return (x[:448], y[:448]), (xt[:96], yt[:96])


def _state(x, precision="float32", tx=None):
    return models.create_train_state(models.MLP(hidden=HIDDEN), x[:1], seed=3,
                                     precision=precision, tx=tx)


def _train(stage, n, data, *, steps_fn=models.classifier_train_step, precision="float32",
           batch=64):
    (x, y), _ = data
    s = jaxdist.MirroredStrategy(jax.devices()[:n], zero_stage=stage)
    step = s.step(steps_fn)
    state = _state(x, precision)
    losses = []
    for b in s.distribute((x, y), batch):  # 7 steps
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return state, losses, step


def _close(a, b, tol=TOL):
    for (p, u), v in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=tol, atol=tol,
                                   err_msg=jax.tree_util.keystr(p))


@pytest.fixture(scope="module")
def reference(data):
    state, losses, _ = _train(0, 1, data)
    return jax.device_get(state.params), losses


# --- the rule -------------------------------------------------------------------------------------
def test_stage_is_validated_everywhere():
    for bad in (4, -1, True, "1", 1.0):
        with pytest.raises(ValueError, match="zero_stage"):
            jaxdist.MirroredStrategy(zero_stage=bad)
    with pytest.raises(ValueError, match="zero_stage"):
        jaxdist.MultiWorkerMirroredStrategy(zero_stage=7)
    with pytest.raises(ValueError, match="zero_stage"):  # checked before the TPU lookup
        jaxdist.TPUStrategy(zero_stage=9)
    with pytest.raises(ValueError, match="zero_stage"):
        jaxdist.mirrored(lambda s, b: (s, {}), zero_stage=5)
    assert jaxdist.mirrored(zero_stage=2)(lambda s, b: (s, {})).strategy.zero_stage == 2
    assert jaxdist.MultiWorkerMirroredStrategy(zero_stage=3).zero_stage == 3


def test_small_leaves_and_leaves_without_a_dividing_dimension_stay_replicated():
    n = 8
    assert zero.shard_dim((4095,), 4, n) is None  # 16,380 bytes < 16 KiB
    assert zero.shard_dim((4096,), 4, n) == 0
    assert zero.shard_dim((4099, 3), 4, n) is None  # big, but no dimension divides by 8
    assert zero.shard_dim((24, 4096), 4, n) == 1  # the largest dividing dimension
    assert zero.shard_dim((4096, 4096), 4, n) == 0  # first on a tie
    assert zero.shard_dim((4096, 4096), 4, 1) is None
    assert zero.shard_dim((), 4, n) is None


def test_which_leaves_are_optimizer_state(data):
    (x, _), _ = data
    state = _state(x)
    mesh = jaxdist.MirroredStrategy(zero_stage=1).mesh
    for stage in (1, 2, 3):
        sh = zero.ZeroShardings(mesh, ("data",), stage)(state)
        k0 = sh.params["Dense_0"]["kernel"].spec
        assert k0 == (jax.P() if stage < 3 else jax.P(None, "data"))
        assert sh.params["Dense_2"]["kernel"].spec == jax.P()  # 5 KiB: replicated
        mu = sh.opt_state[0].mu["Dense_0"]["kernel"].spec
        assert mu == jax.P(None, "data")
        assert sh.step.spec == jax.P()
    # A plain dict: leaves under "opt_state" are optimizer state; everything else is replicated at
    # stages 1-2 and sharded at stage 3.
    tree = {"params": jnp.ones((64, 256)), "opt_state": (jnp.ones((64, 256)),),
            "ema": jnp.ones((64, 256))}
    for stage, want in ((1, jax.P()), (3, jax.P(None, "data"))):
        sh = zero.ZeroShardings(mesh, ("data",), stage)(tree)
        assert sh["opt_state"][0].spec == jax.P(None, "data")
        assert sh["params"].spec == sh["ema"].spec == want


# --- the same numbers ----------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_every_stage_trains_like_stage_0_on_one_device(data, reference, n):
    params, losses = reference
    for stage in (0, 1, 2, 3):
        state, got, _ = _train(stage, n, data)
        _close(state.params, params)
        np.testing.assert_allclose(got, losses, rtol=TOL, atol=TOL)
        assert int(state.step) == 7


def test_mixed_precision_loss_scaling_and_accumulation(data):
    step = functools.partial(models.classifier_train_step, accumulate=2)
    # Stage 0 on the same 8 devices: float16 forward passes round differently per device count.
    ref, ref_losses, _ = _train(0, 8, data, steps_fn=step, precision="mixed_float16")
    assert isinstance(ref, jaxdist.precision.TrainState)
    for stage in (1, 2, 3):
        state, losses, _ = _train(stage, 8, data, steps_fn=step, precision="mixed_float16")
        _close(state.params, ref.params)
        np.testing.assert_allclose(losses, ref_losses, rtol=TOL)
        assert float(state.loss_scale.scale) == float(ref.loss_scale.scale)
        assert int(state.skipped) == int(ref.skipped)
        assert state.tx is ref.tx or type(state.tx) is type(ref.tx)  # the user's tx comes back


def test_fit_evaluate_predict_and_callbacks(data, tmp_path):
    (x, y), (xt, yt) = data
    out = {}
    for stage in (0, 3):
        s = jaxdist.MirroredStrategy(zero_stage=stage)
        sched = jaxdist.callbacks.LearningRateScheduler(lambda epoch: 1e-3 * 0.5 ** epoch)
        hist = jaxdist.fit(s.step(models.classifier_train_step),
                           _state(x, tx=optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)),
                           s.distribute((x, y), 64), epochs=2,
                           eval_step=models.classifier_eval_step,
                           eval_data=s.distribute((xt, yt), 64),
                           callbacks=[sched, jaxdist.callbacks.ModelCheckpoint(
                               str(tmp_path / f"ck{stage}"))], verbose=0)
        ev = jaxdist.evaluate(models.classifier_eval_step, hist.state, s.distribute((xt, yt), 64))
        pred = jaxdist.predict(models.classifier_predict_step, hist.state,
                               s.distribute((xt,), 64))
        out[stage] = hist, ev, pred
    (h0, e0, p0), (h3, e3, p3) = out[0], out[3]
    _close(h3.state.params, h0.state.params)
    for k in ("loss", "val_loss", "accuracy"):
        np.testing.assert_allclose(h3.history[k], h0.history[k], rtol=TOL, atol=TOL)
    np.testing.assert_allclose(e3["loss"], e0["loss"], rtol=TOL)
    np.testing.assert_allclose(np.asarray(p3), np.asarray(p0), rtol=1e-4, atol=1e-4)
    assert np.asarray(p3).shape == (96, 10)
    assert h3.state.params["Dense_0"]["kernel"].sharding.spec == jax.P(None, "data")


def test_compiles_once_per_step_shape(data, count_compiles):
    (x, y), _ = data
    s = jaxdist.MirroredStrategy(zero_stage=3)
    step = s.step(models.classifier_train_step)
    dist = s.distribute((x[:300], y[:300]), 64)  # the last batch is padded: same shape
    state, _ = step(_state(x), next(iter(dist)))
    with count_compiles() as compiles:
        for _ in range(2):
            for b in dist:
                state, _ = step(state, b)
        jax.block_until_ready(state)
    assert compiles() == 0
    assert len(step._compiled) == 1


def test_per_replica_view_refuses_sharded_state_and_names_the_fix(data):
    (x, y), _ = data
    s = jaxdist.MirroredStrategy(jax.devices()[:2], zero_stage=1)
    b = next(iter(s.distribute((x, y), 64)))
    with pytest.raises(NotImplementedError, match=r"strategy\.step"):
        s.run(models.classifier_replica_step, args=(_state(x), b))


# --- memory -----------------------------------------------------------------------------------------
def _nbytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _expected_per_device(tree, n, shard):
    total = 0
    for x in jax.tree.leaves(tree):
        dim = zero.shard_dim(x.shape, x.dtype.itemsize, n) if shard else None
        total += x.nbytes // (n if dim is not None else 1)
    return total


def test_bytes_per_device_from_the_addressable_shards(data):
    states = {stage: _train(stage, 8, data)[0] for stage in (0, 1, 3)}
    per = {stage: {part: zero.bytes_per_device(getattr(st, part))
                   for part in ("params", "opt_state")} for stage, st in states.items()}
    for stage in per:
        for part in per[stage]:
            assert len(set(per[stage][part].values())) == 1  # every device holds the same bytes
    one = {stage: {k: next(iter(v.values())) for k, v in d.items()} for stage, d in per.items()}
    params, opt = _nbytes(states[0].params), _nbytes(states[0].opt_state)
    assert one[0] == {"params": params, "opt_state": opt}
    assert one[1]["params"] == params
    assert one[1]["opt_state"] == _expected_per_device(states[0].opt_state, 8, True)
    assert one[3]["params"] == _expected_per_device(states[0].params, 8, True)
    # ~1/N: all but the small replicated leaves (128x10 kernel, biases, Adam's count) divide by 8.
    assert one[1]["opt_state"] < 0.16 * opt  # 0.154 here; 1/8 = 0.125
    assert one[3]["params"] + one[3]["opt_state"] < 0.16 * (params + opt)


def _collectives(step, state, batch):
    txt = step.lower(state, batch).compile().as_text()
    return set(re.findall(r"\b(all-reduce|reduce-scatter|all-gather)(?:-start)?\(", txt))


def test_compiled_collectives_per_stage(data):
    """What XLA:CPU emits (docs/guides/sharded_state.md): stage 0 one all-reduce; stages 1-3 add
    all-gathers (of the updated shards; at stage 3 of the parameters where the step uses them)."""
    (x, y), _ = data
    found = {}
    for stage in (0, 1, 2, 3):
        s = jaxdist.MirroredStrategy(zero_stage=stage)
        step = s.step(models.classifier_train_step)
        found[stage] = _collectives(step, _state(x), next(iter(s.distribute((x, y), 64))))
    assert found[0] == {"all-reduce"}
    for stage in (1, 2, 3):
        assert "all-gather" in found[stage]


# --- checkpoints ---------------------------------------------------------------------------------
@pytest.mark.parametrize("src,dst", [((8, 3), (1, 0)), ((1, 0), (8, 3)), ((4, 1), (2, 2)),
                                     ((2, 2), (8, 1))])
def test_checkpoints_restore_across_stages_and_device_counts(data, tmp_path, src, dst):
    (x, y), _ = data
    (n0, k0), (n1, k1) = src, dst
    s0 = jaxdist.MirroredStrategy(jax.devices()[:n0], zero_stage=k0)
    step = s0.step(models.classifier_train_step)
    state = _state(x)
    batches = list(s0.distribute((x, y), 64))
    for b in batches[:3]:
        state, _ = step(state, b)
    mgr = CheckpointManager(str(tmp_path), async_save=False)
    mgr.save(3, state)
    mgr.wait_until_finished()
    saved = jax.device_get(state)
    s1 = jaxdist.MirroredStrategy(jax.devices()[:n1], zero_stage=k1)
    restored = mgr.restore(target=_state(x), strategy=s1)
    _close(restored.params, saved.params, tol=0)
    _close(restored.opt_state, saved.opt_state, tol=0)
    want = s1.layout.state_shardings(restored)
    for a, t in zip(jax.tree.leaves(restored), jax.tree.leaves(want)):
        assert a.sharding == t
    # Training goes on from there to the same place as an uninterrupted run.
    step1 = s1.step(models.classifier_train_step)
    for b in list(s1.distribute((x, y), 64))[3:]:
        restored, _ = step1(restored, b)
    for b in batches[3:]:
        state, _ = step(state, b)
    _close(restored.params, state.params)


def test_multi_worker_strategy_in_one_process(data, reference):
    params, _ = reference
    (x, y), _ = data
    s = jaxdist.MultiWorkerMirroredStrategy(zero_stage=2)
    step = s.step(models.classifier_train_step)
    state = _state(x)
    for b in s.distribute((x, y), 64):
        state, _ = step(state, b)
    _close(state.params, params)


def test_jaxdist_train_zero_stage_flag():
    from tests.conftest import run_python

    proc = run_python(["-m", "jaxdist.cli", "train", "--devices", "4", "--zero-stage", "3",
                       "--epochs", "1", "--quiet"], timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "test accuracy" in proc.stdout
    proc = run_python(["-m", "jaxdist.cli", "train", "--strategy", "one_device", "--zero-stage",
                       "1", "--epochs", "1"], timeout=120)
    assert proc.returncode != 0 and "--zero-stage 1 needs --strategy mirrored" in proc.stderr
    proc = run_python(["-m", "jaxdist.cli", "train", "--zero-stage", "4"], timeout=120)
    assert proc.returncode != 0 and "--zero-stage" in proc.stderr


def test_two_axis_mesh_shards_over_both_axes(data, reference):
    """cross_device_ops="hierarchical" builds a (host, local) mesh: leaves split over both axes."""
    params, _ = reference
    (x, y), _ = data
    s = jaxdist.MirroredStrategy(cross_device_ops="hierarchical", zero_stage=3)
    assert len(s.layout.data_axes) == 2
    step = s.step(models.classifier_train_step)
    state = _state(x)
    for b in s.distribute((x, y), 64):
        state, _ = step(state, b)
    assert state.params["Dense_0"]["kernel"].sharding.spec == jax.P(None, s.layout.data_axes)
    _close(state.params, params)


def test_a_state_without_opt_state_is_named_in_a_warning(caplog):
    s = jaxdist.MirroredStrategy(zero_stage=1)
    with caplog.at_level("WARNING", logger="jaxdist.zero"):
        placed = s.put((jnp.ones((64, 256)), (jnp.ones((64, 256)),)))  # (params, opt) as a tuple
    assert "no leaf under a key or attribute named 'opt_state'" in caplog.text
    assert placed[1][0].sharding.spec == jax.P()  # replicated, as the warning says


def test_zero_stage_on_a_user_mesh_with_a_model_axis_is_refused_by_name():
    # ZeRO places leaves on the data axes only: a user's model-axis layout would be lost silently.
    mesh = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8])
    strategy = jaxdist.MirroredStrategy(mesh=mesh, data_axes=("data",), zero_stage=1)
    with pytest.raises(ValueError, match=r"zero_stage=1.*\['model'\].*zero_stage=0"):
        strategy.put({"params": jnp.ones((64, 64)), "opt_state": jnp.ones((64, 64))})
    ok = jaxdist.MirroredStrategy(mesh=mesh, data_axes=("data",))
    assert ok.put({"w": jnp.ones(8)})["w"].shape == (8,)
