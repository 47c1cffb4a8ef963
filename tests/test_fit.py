"""fit / evaluate: exact epoch metrics, callbacks, bounded run-ahead on 8 devices."""

from __future__ import annotations

import textwrap

import jax
import numpy as np
import pytest

import jaxdist
from jaxdist import models
from tests.conftest import run_python


def test_fit_matches_a_manual_loop_and_reports_exact_metrics(digits):
    (x, y), (xt, yt) = digits
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    init = models.create_train_state(models.MLP(hidden=(32,)), x[:1])
    hist = jaxdist.fit(s.step(models.classifier_train_step), init, s.distribute(
        (x, y), 100, shuffle=True), epochs=2, verbose=0, eval_step=models.classifier_eval_step,
        eval_data=s.distribute((xt, yt), 100))
    assert hist.epochs == [0, 1]
    manual = models.create_train_state(models.MLP(hidden=(32,)), x[:1])
    step = s.step(models.classifier_train_step)
    dist = s.distribute((x, y), 100, shuffle=True)
    for epoch in range(2):
        for b in dist.iterator(epoch=epoch):
            manual, _ = step(manual, b)
    for a, b in zip(jax.tree.leaves(hist.state.params), jax.tree.leaves(manual.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The validation accuracy is the exact fraction of correct test examples.
    logits = manual.apply_fn({"params": manual.params}, xt)
    exact = float(np.mean(np.argmax(np.asarray(logits), -1) == yt))
    assert hist.history["val_accuracy"][-1] == pytest.approx(exact, abs=1e-6)
    assert jaxdist.evaluate(models.classifier_eval_step, manual, (xt, yt), batch_size=64)[
        "accuracy"] == pytest.approx(exact, abs=1e-6)


def test_callbacks_see_progress_and_can_stop(digits):
    (x, y), _ = digits
    seen = []

    class StopAfter(jaxdist.callbacks.Callback):
        def on_train_batch_end(self, info):
            seen.append((info.epoch, info.step, info.epoch_steps))
            if info.step == 5:
                info.stop_training = True

    s = jaxdist.OneDeviceStrategy()
    hist = jaxdist.fit(s.step(models.classifier_train_step),
                       models.create_train_state(models.MLP(hidden=(8,)), x[:1]), (x, y),
                       batch_size=128, epochs=3, steps_per_epoch=3, callbacks=[StopAfter()],
                       verbose=0)
    assert seen == [(0, 1, 1), (0, 2, 2), (0, 3, 3), (1, 4, 1), (1, 5, 2)]
    assert hist.epochs == [0, 1]


def test_fit_rejects_non_scalar_metrics_and_unbounded_run_ahead(digits):
    (x, y), _ = digits
    s = jaxdist.OneDeviceStrategy()
    with pytest.raises(ValueError, match=r"metric 'v' has shape \(8,\)"):
        jaxdist.fit(s.step(lambda st, b: (st, {"v": b.data[0][:, 0, 0, 0]})), 0.0, (x, y),
                    batch_size=8, verbose=0)
    with pytest.raises(ValueError, match=r"max_in_flight=100"):
        jaxdist.fit(s.step(lambda st, b: (st, {})), 0.0, (x, y), batch_size=8, max_in_flight=100)
    with pytest.raises(ValueError, match="pass batch_size="):
        jaxdist.fit(s.step(lambda st, b: (st, {})), 0.0, (x, y))


@pytest.mark.slow
def test_200_steps_on_8_devices_do_not_abort_in_the_rendezvous():
    """DESIGN.md: ~100 queued steps with collectives abort XLA:CPU; fit must bound run-ahead,
    also when a step returns no metrics to read back (then nothing else would wait)."""
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np, jaxdist
        from jaxdist import models
        x, y = jaxdist.datasets.synthetic(64 * 224, shape=(16,))
        s = jaxdist.MirroredStrategy()
        assert s.num_replicas_in_sync == 8
        state = models.create_train_state(models.MLP(hidden=(32,)), x[:1])
        hist = jaxdist.fit(s.step(models.classifier_train_step), state,
                           s.distribute((x, y), 64, shuffle=True), epochs=1, verbose=0)
        print("steps", int(hist.state.step), "loss", hist.history["loss"][0])

        @s.step
        def no_metrics(w, batch):   # heavy enough that dispatch outruns the devices
            h = batch.data[0]
            for _ in range(5):
                h = jnp.tanh(h @ w)
            return w - 1e-6 * jnp.mean(h), {}   # the mean is an all-reduce; nothing returned
        x2 = np.random.default_rng(0).normal(size=(256 * 200, 512)).astype(np.float32)
        out = jaxdist.fit(no_metrics, jnp.eye(512), s.distribute((x2,), 256), epochs=1, verbose=0)
        assert bool(jnp.isfinite(out.state).all())
        print("no-metrics steps done")
    """)
    proc = run_python(code, timeout=300, devices=8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps 224" in proc.stdout and "no-metrics steps done" in proc.stdout


def test_fit_reads_no_metric_before_it_is_ready_below_the_bound(monkeypatch):
    """With a step the devices take longer over than the host (as a GPU step of a large model),
    ``fit`` never waits for a metric while at most ``max_in_flight`` calls are unfinished (a
    counting stub of the read), and its history and state are those of a plain loop, bit for bit."""
    from jaxdist.training import fit as fit_module

    s = jaxdist.OneDeviceStrategy()

    def slow_step(w, batch):  # ~10 ms of device work a step on this CPU, microseconds of host work
        h = jax.lax.fori_loop(0, 24, lambda _, h: jax.numpy.tanh(h @ w), batch.data)
        loss = jaxdist.compute_average_loss(jax.numpy.mean(h * h, axis=1), batch.mask)
        return w * 0.999 + 1e-4 * (h.T @ h) / h.shape[0], {"loss": loss, "n": {"h0": h[0, 0]}}

    rng = np.random.default_rng(0)
    x = rng.normal(size=(40 * 192 + 64, 256)).astype(np.float32)
    w0 = (rng.normal(size=(256, 256)) / 16).astype(np.float32)
    data = s.distribute(x, 192, shuffle=False)
    step = s.step(slow_step)

    pushed, at_push, early, fetched, draining = [], [], [], [], []
    push, fetch, drain = fit_module._Meter.push, fit_module._fetch, fit_module._Meter.drain

    def counting_push(meter, metrics, num_real):
        pushed.append(jax.tree.leaves(metrics))
        # Counted before fit decides whether to wait: steps only finish as time passes (in
        # order, on one device), so the unfinished calls fit counts next are at most these.
        # (Counted at the read instead, steps finishing in between made this test fail by
        # timing on a loaded machine.)
        at_push.append(sum(not all(v.is_ready() for v in leaves) for leaves in pushed))
        push(meter, metrics, num_real)

    def counting_fetch(flats):
        if not draining and any(not v.is_ready() for f in flats for v in f.values()):
            early.append(at_push[-1])  # (a wait for a value not ready: decided in this push)
        fetched.append(len(flats))
        return fetch(flats)

    monkeypatch.setattr(fit_module._Meter, "push", counting_push)
    monkeypatch.setattr(fit_module, "_fetch", counting_fetch)

    def epoch_end_drain(meter):  # the epoch's end waits for its last steps, as it must
        draining.append(True)
        try:
            return drain(meter)
        finally:
            draining.pop()

    monkeypatch.setattr(fit_module._Meter, "drain", epoch_end_drain)
    hist = jaxdist.fit(step, jax.numpy.asarray(w0), data, epochs=2, verbose=0)
    monkeypatch.undo()

    assert len(pushed) == 2 * len(data) and sum(fetched) == len(pushed)
    assert all(n > 8 for n in early), f"waited for a metric with {early} calls unfinished"

    w, sums = jax.numpy.asarray(w0), []  # the plain loop, reading every step
    for epoch in range(2):
        total, count = {}, 0
        for batch in data.iterator(epoch=epoch):
            w, m = step(w, batch)
            n = int(np.asarray(batch.mask).sum())
            for k, v in (("loss", m["loss"]), ("n/h0", m["n"]["h0"])):
                total[k] = total.get(k, 0.0) + float(v) * n
            count += n
        sums.append({k: v / count for k, v in total.items()})
    assert hist.history == {k: [e[k] for e in sums] for k in ("loss", "n/h0")}
    np.testing.assert_array_equal(np.asarray(hist.state), np.asarray(w))


def test_a_callback_that_asks_for_the_newest_metrics_waits_for_them():
    s = jaxdist.OneDeviceStrategy()

    def step(w, batch):
        loss = jaxdist.compute_average_loss(batch.data * w, batch.mask)
        return w + 1.0, {"loss": loss}

    seen = []

    class Newest(jaxdist.callbacks.Callback):
        def on_train_batch_end(self, info):
            seen.append((info.step, info.latest_logs()["loss"], info.logs["loss"]))

    data = s.distribute(np.ones(12, np.float32), 4, shuffle=False)
    jaxdist.fit(step, jax.numpy.float32(0.0), data, epochs=1, verbose=0, callbacks=[Newest()])
    # Step k (1-based) has loss k - 1: the running mean over steps 1..k is (k - 1) / 2.
    assert seen == [(k, (k - 1) / 2, (k - 1) / 2) for k in (1, 2, 3)]


def test_fit_with_raw_arrays_in_a_launched_process_that_never_joined_says_so(monkeypatch):
    # before: a process that started JAX before importing jaxdist trained alone on every rank,
    # silently, where a strategy raised
    monkeypatch.setenv("JAXDIST_NUM_PROCESSES", "2")
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(RuntimeError, match=r"^fit: this process is one of 2 .* has not joined"):
        jaxdist.fit(lambda w, b: (w, {"loss": w}), jax.numpy.float32(0.0),
                    np.ones(8, np.float32), batch_size=4, verbose=0)
