"""In-process parameter-server training of the digits MLP (servers and workers as threads)."""

import os
import sys

import jax
import numpy as np
import optax
import pytest

import jaxdist
import jaxdist.ps as ps

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_ps_scripts"))
import digits_job as dj  # noqa: E402

TIMEOUT = 240


def _assert_each_step_applied_once(coord, values):
    expected = sorted(ps.make_step_id(v.closure_id) for v in values)
    for shard, log in enumerate(coord.server_logs()):
        assert sorted(u.step_id for u in log) == expected, f"ps{shard}"


def _train(coord, steps):
    it = coord.create_per_worker_dataset(dj.batches)
    values = [coord.schedule(dj.train_step, args=(it,)) for _ in range(steps)]
    coord.join(timeout=TIMEOUT)
    return values


def test_async_training_reaches_95_percent_and_applies_each_step_once():
    strategy = ps.ParameterServerStrategy(ps.LocalCluster(num_ps=2, num_workers=3))
    assert strategy.num_replicas_in_sync == 3 and strategy.mesh is None
    with strategy.start(dj.init_params(), optax.adam(3e-3), dj.loss_fn) as coord:
        assert "ps0:" in strategy.placement_report() and "ps1:" in strategy.placement_report()
        # 900 steps: 600 reached 0.961-0.981 here (under load the lower end) and 0.9499 once in
        # CI (async staleness varies the result); 900 gives 0.972-0.986, with 2 busy loops beside too
        values = _train(coord, 900)
        (_, _), (xt, yt) = dj.digits()
        acc = dj.accuracy(coord.fetch_params(), xt, yt)
        assert acc >= 0.95, acc
        assert values[-1].fetch() < values[0].fetch()
        _assert_each_step_applied_once(coord, values)
        assert [s["version"] for s in coord.server_status()] == [900, 900]


def test_killed_worker_closures_are_rescheduled_and_applied_once():
    strategy = ps.ParameterServerStrategy(ps.LocalCluster(num_ps=2, num_workers=3))
    with strategy.start(dj.init_params(), optax.sgd(0.1), dj.loss_fn) as coord:
        it = coord.create_per_worker_dataset(dj.batches)
        killed = []

        def step_then_die(worker, iterator):
            loss = worker.step(next(iterator))
            if not killed:  # dies after pushing, before reporting: the re-run must be a no-op
                killed.append(worker.index)
                coord.workers[worker.index].killed = True
            return loss

        values = [coord.schedule(step_then_die, args=(it,)) for _ in range(30)]
        coord.join(timeout=TIMEOUT)
        assert coord.rescheduled >= 1 and len(killed) == 1
        assert all(np.isfinite(v.fetch()) for v in values)
        _assert_each_step_applied_once(coord, values)


def test_bounded_staleness_holds_in_the_servers_log():
    strategy = ps.ParameterServerStrategy(ps.LocalCluster(num_ps=2, num_workers=3),
                                          staleness=1, placement="round_robin")
    with strategy.start(dj.init_params(), optax.adam(3e-3), dj.loss_fn) as coord:
        values = _train(coord, 150)
        logs = coord.server_logs()
        worst = max(u.applied_at - u.computed_on for log in logs for u in log)
        assert worst <= 1
        _assert_each_step_applied_once(coord, values)
        assert values[-1].fetch() < values[0].fetch()


@pytest.mark.parametrize("worker_strategy", [None, "mirrored"])
def test_sync_mode_matches_full_batch_training(worker_strategy):
    (x, y), _ = dj.digits()
    workers, per_worker, rounds = 3, 16, 8
    tx = optax.sgd(0.5, momentum=0.9)  # linear in the gradients: adam would amplify float noise

    def global_batch(t):
        sl = slice(t * workers * per_worker, (t + 1) * workers * per_worker)
        return x[sl], y[sl]

    def sync_step(worker, t, k):
        bx, by = global_batch(t)
        return worker.step((bx[k * per_worker:(k + 1) * per_worker],
                            by[k * per_worker:(k + 1) * per_worker]))

    local = jaxdist.MirroredStrategy() if worker_strategy else None  # all devices per worker
    assert local is None or local.num_replicas_in_sync == 8  # conftest's simulated devices
    strategy = ps.ParameterServerStrategy(ps.LocalCluster(num_ps=2, num_workers=workers),
                                          sync_replicas=workers, max_shard_bytes=4096,
                                          worker_strategy=local)
    with strategy.start(dj.init_params(), tx, dj.loss_fn) as coord:
        assert "rows [" in strategy.placement_report()  # the 64x64 kernel is partitioned
        for t in range(rounds):
            for k in range(workers):
                coord.schedule(sync_step, args=(t, k))
        coord.join(timeout=TIMEOUT)
        got = coord.fetch_params()
        assert [s["version"] for s in coord.server_status()] == [rounds, rounds]

    params = dj.init_params()
    state = tx.init(params)
    grad = jax.jit(jax.grad(dj.loss_fn))
    for t in range(rounds):
        updates, state = tx.update(grad(params, global_batch(t)), state, params)
        params = optax.apply_updates(params, updates)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    moved = max(float(np.abs(a - b).max()) for a, b in
                zip(jax.tree.leaves(got), jax.tree.leaves(dj.init_params())))
    assert moved > 1e-2  # the comparison is not between two untrained models


def test_closure_errors_surface_in_fetch_and_join():
    strategy = ps.ParameterServerStrategy(ps.LocalCluster(num_ps=1, num_workers=2))
    with strategy.start(dj.init_params(), optax.sgd(0.1), dj.loss_fn) as coord:
        def boom(worker):
            raise ValueError("bad batch")
        v = coord.schedule(boom)
        ok = coord.schedule(lambda worker: worker.index)
        with pytest.raises(ps.ClosureError, match="ValueError: bad batch"):
            coord.join(timeout=TIMEOUT)
        with pytest.raises(ps.ClosureError, match="bad batch"):
            v.fetch()
        assert ok.fetch() in (0, 1) and coord.done()


def test_example_runs_in_process():
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    out = subprocess.run([sys.executable, os.path.join(root, "examples", "parameter_server.py"),
                          "--steps", "60"], env=env, capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "3 workers, 60 async steps" in out.stdout and "placement: greedy" in out.stdout


def test_fit_drives_a_parameter_server_job_to_95_percent():
    # issue 11: ParameterServerStrategy through jaxdist.fit, 2 servers x 3 workers
    strategy = ps.ParameterServerStrategy(ps.LocalCluster(num_ps=2, num_workers=3))
    step = strategy.step(dj.loss_fn, optimizer=optax.adam(3e-3))
    (x, y), (xt, yt) = dj.digits()
    history = jaxdist.fit(step, dj.init_params(), (x, y), batch_size=32, epochs=15, verbose=0,
                          seed=1)
    assert len(history.history["loss"]) == 15 and history.epochs == list(range(15))
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert dj.accuracy(history.state, xt, yt) >= 0.95
    assert step.coordinator is None  # fit shut the job down
    with pytest.raises(ValueError, match="eval_step inside jaxdist.fit is not supported"):
        jaxdist.fit(step, dj.init_params(), (x, y), batch_size=32, verbose=0,
                    eval_step=lambda s, b: {}, eval_data=(xt, yt))
