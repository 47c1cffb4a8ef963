"""In-memory datasets kept on the devices: batches gathered there from indices, bit-for-bit the
host's batches (order, padding, masks, positions, layouts), and the arrays sent to the devices once
however many epochs ``fit`` runs."""

from __future__ import annotations

import re
import textwrap

import jax
import numpy as np
import pytest

import jaxdist
from jaxdist import models
from tests.conftest import run_python

N = 203  # prime: the last batch is partial for every batch size used


def _epoch(dist, grouped, **where):
    """Everything an iterator hands out, as numpy, with its position and shardings."""
    out = []
    with dist.iterator(**where) as it:
        for item in it:
            b = item.batches if grouped else item
            leaves = [np.asarray(v) for v in jax.tree.leaves(b.data)]
            out.append((leaves, np.asarray(b.mask), it.position, it.last_num_real,
                        [v.sharding for v in jax.tree.leaves(b.data)], b.mask.sharding))
    return out


def _same(host, device):
    assert len(host) == len(device)
    for (hl, hm, hp, hn, hs, hms), (dl, dm, dp, dn, ds, dms) in zip(host, device):
        for u, v in zip(hl + [hm], dl + [dm], strict=True):
            assert u.dtype == v.dtype and u.shape == v.shape
            assert u.tobytes() == v.tobytes()  # bit for bit
        assert (hp, hn) == (dp, dn)
        assert hs == ds and hms == dms


@pytest.mark.parametrize("n", [1, 8])
@pytest.mark.parametrize("options", [{}, {"shuffle": True, "seed": 3}, {"drop_remainder": True},
                                     {"shuffle": True, "drop_remainder": True}])
@pytest.mark.parametrize("where", [{}, {"epoch": 2, "position": 3}, {"group_size": 3},
                                   {"group_size": 4, "epoch": 1, "position": 2, "steps": 5},
                                   {"steps": 4}])
def test_batches_gathered_on_the_devices_are_the_hosts_bit_for_bit(n, options, where):
    s = jaxdist.MirroredStrategy(jax.devices()[:n])
    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(N, 3, 2)).astype(np.float32), "y": np.arange(N, dtype=np.int32),
            "w": rng.normal(size=N)}
    grouped = "group_size" in where
    for gb, ahead in ((16, None), (64, 1)):  # chunks of 8 batches; one batch at a time
        runs = []
        for on_device in (False, True):
            dist = s.distribute(data, gb, on_device=on_device, **options)
            assert dist.on_device is on_device
            if ahead:
                dist._ahead = ahead
            runs.append(_epoch(dist, grouped, **where))
        assert runs[0] or options.get("drop_remainder")  # something was compared
        _same(*runs)


def test_on_device_is_the_default_within_the_budget_and_can_be_refused():
    from jaxdist.input import dataset

    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    x = np.zeros((64, 4), np.float32)
    assert s.distribute((x,), 8).on_device
    assert not s.distribute((x,), 8, on_device=False).on_device
    assert not s.distribute(lambda: iter([(x[:8],)]), 8).on_device  # iterables stream
    strings = np.array([str(i) for i in range(64)], dtype=object)
    assert not s.distribute((x, strings), 8).on_device  # only the host can index objects
    with pytest.raises(ValueError, match="on_device=True needs numeric arrays"):
        s.distribute((x, strings), 8, on_device=True)
    with pytest.raises(ValueError, match="on_device must be None"):
        s.distribute((x,), 8, on_device="yes")
    # CPU devices report no memory: the budget is ON_DEVICE_HOST_BYTES for the copies of all.
    budget = dataset.ON_DEVICE_HOST_BYTES
    try:
        dataset.ON_DEVICE_HOST_BYTES = x.nbytes * 2 - 1  # two devices, one copy each: too big
        assert not s.distribute((x,), 8).on_device
        assert s.distribute((x,), 8, on_device=True).on_device
    finally:
        dataset.ON_DEVICE_HOST_BYTES = budget


def test_fit_with_the_dataset_on_the_devices_trains_exactly_as_from_the_host(digits):
    (x, y), _ = digits
    s = jaxdist.MirroredStrategy(jax.devices()[:4])
    state = models.create_train_state(models.MLP(hidden=(16,)), np.zeros((1, 8, 8, 1), np.float32))
    for k in (1, 3):
        runs = [jaxdist.fit(s.step(models.classifier_train_step), state,
                            s.distribute((x[:300], y[:300]), 64, shuffle=True, seed=1,
                                         on_device=on_device),
                            epochs=2, verbose=0, steps_per_execution=k)
                for on_device in (False, True)]
        assert runs[0].history == runs[1].history
        for u, v in zip(jax.tree.leaves(runs[0].state), jax.tree.leaves(runs[1].state), strict=True):
            assert np.asarray(u).tobytes() == np.asarray(v).tobytes()


_FIT_SCRIPT = textwrap.dedent("""
    import sys
    import jax, numpy as np, optax
    import jax._src.pjit
    import jaxdist
    # JAX's C++ dispatch of a compiled call skips the transfer guard's log for numpy arguments;
    # without it every call goes through the Python dispatch, which logs each transfer.
    jax._src.pjit._get_fastpath_data = lambda *args, **kwargs: None
    s = jaxdist.MirroredStrategy(jax.devices()[:1])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 784)).astype(np.float32)
    y = rng.integers(0, 10, 2048).astype(np.int32)

    def step(w, batch):
        (xb, yb), mask = batch
        def loss_fn(w):
            logits = xb @ w
            per = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
            return jaxdist.compute_average_loss(per, mask)
        loss, g = jax.value_and_grad(loss_fn)(w)
        return w - 0.01 * g, {"loss": loss}

    data = s.distribute((x, y), 128, shuffle=True, **eval(sys.argv[1]))
    w = s.put(np.zeros((784, 10), np.float32))
    jax.block_until_ready(w)
    sys.stderr.write("FIT BEGINS\\n"); sys.stderr.flush()
    with jax.transfer_guard_host_to_device("log_explicit"):
        jaxdist.fit(s.step(step), w, data, epochs=4, verbose=0, **eval(sys.argv[2]))
    sys.stderr.write("FIT ENDS\\n")
    print(x.nbytes + y.nbytes)
""")

_TRANSFER = re.compile(r"host-to-device transfer: aval=ShapedArray\((\w+)\[([\d,]*)\]")


def _fit_transfers(options: str, fit_options: str) -> tuple[int, int]:
    """Bytes sent host -> devices during a 4-epoch fit (JAX's transfer guard logs every transfer,
    explicit or as a compiled call's argument), and the dataset's bytes."""
    res = run_python(["-c", _FIT_SCRIPT, options, fit_options], timeout=240, devices=1)
    assert res.returncode == 0, res.stderr[-3000:]
    during = res.stderr.split("FIT BEGINS", 1)[1].split("FIT ENDS", 1)[0]
    sent = 0
    for dtype, shape in _TRANSFER.findall(during):
        dims = [int(d) for d in shape.split(",") if d]
        sent += int(np.prod(dims, dtype=np.int64)) * np.dtype(dtype).itemsize
    return sent, int(res.stdout.split()[-1])


@pytest.mark.parametrize("fit_options", ["{}", "{'steps_per_execution': 3}"])
def test_a_4_epoch_fit_sends_an_in_memory_dataset_to_the_devices_once(fit_options):
    sent, dataset_bytes = _fit_transfers("{}", fit_options)
    # Once, plus the indices (4 bytes a row an epoch), masks and small constants.
    assert dataset_bytes <= sent < 1.25 * dataset_bytes, (sent, dataset_bytes)
    # The count sees the batches when they come from the host: every epoch sends them again.
    host, _ = _fit_transfers("{'on_device': False}", fit_options)
    assert host >= 4 * dataset_bytes, (host, dataset_bytes)


def test_an_iterables_whole_batches_are_copied_once_where_placing_copies(monkeypatch):
    # On GPUs and TPUs placing host rows copies them (into the runtime's staging memory), so a
    # whole batch is handed over as it came; on CPU devices it is copied into an aligned buffer of
    # ours, which XLA:CPU then uses in place. Either way the batches are the same.
    import threading

    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    source = [(x[:8],), (x[8:16],), (x[16:],)]  # the last batch is padded: always gathered
    dist = s.distribute(source, 8, prefetch=0)
    seen = {}
    for copies in (False, True):
        monkeypatch.setattr(type(dist), "_put_copies", lambda self, c=copies: c)
        hosts = list(dist._host_batches(0, 0, 0, threading.Event()))
        shared = [np.shares_memory(h.local[0], item[0]) for h, item in zip(hosts, source)]
        assert shared == [copies, copies, False]
        seen[copies] = [(np.asarray(b.data[0]), np.asarray(b.mask)) for b in dist]
    for (a, m), (b, n) in zip(seen[False], seen[True], strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(m, n)


def test_a_loop_of_grouped_calls_sends_nothing_per_call_once_warm():
    # steps_per_execution's count is placed once per value; the stacks come from a dataset already
    # on the devices. JAX's guard raises on any host -> device transfer, explicit or implicit.
    import jax.numpy as jnp

    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    step = s.step(lambda w, b: (w + jnp.sum(jnp.where(b.mask, b.data, 0.0)), {"m": jnp.sum(b.data)}))
    groups = list(s.distribute(np.arange(64, dtype=np.float32), 8).iterator(group_size=3))
    w = s.put(jnp.float32(0))
    for g in groups[:2]:  # compile, and place each count once (3, then 2 for the last group)
        w, _ = step.steps(w, g.batches, len(g.num_real))
    w, _ = step.steps(w, groups[-1].batches, len(groups[-1].num_real))
    with jax.transfer_guard_host_to_device("disallow"):
        for g in groups:
            w, m = step.steps(w, g.batches, len(g.num_real))
        jax.block_until_ready((w, m))
    assert float(w) == 2 * float(np.arange(64).sum())  # two epochs


@pytest.mark.parametrize("on_device", [True, False])
def test_arrays_changed_after_distribute_change_no_batch(on_device):
    """As tf.data: the dataset is what the arrays were at distribute(), on the host and the
    devices alike (a device copy aliased a 64-byte-aligned host buffer on the CPU)."""
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    x = np.arange(N * 3, dtype=np.float32).reshape(N, 3)
    y = np.arange(N, dtype=np.int32)
    dist = s.distribute((x, y), 16, on_device=on_device)
    before = _epoch(dist, False, epoch=0)
    x[:] = -1.0
    y[:] = -1
    _same(before, _epoch(dist, False, epoch=0))
    frozen = np.zeros((N, 3), np.float32)
    frozen.setflags(write=False)  # read-only: used as it is, no copy
    assert s.distribute((frozen, y), 16)._arrays[0] is frozen


def test_arrays_that_do_not_fit_the_devices_stay_on_the_host_in_one_line(monkeypatch, caplog):
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    x = np.arange(N * 3, dtype=np.float32).reshape(N, 3)
    host = _epoch(s.distribute((x,), 16, on_device=False), False, epoch=0)
    put = jax.device_put

    def out_of_memory(value, *args, **kwargs):  # the dataset's placement runs out of memory
        if any(getattr(a, "shape", None) == (N, 3) for a in jax.tree.leaves(value)):
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                             "allocate 2436 bytes.")
        return put(value, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", out_of_memory)
    auto = s.distribute((x,), 16)
    assert auto.on_device  # within the budget at distribute()
    with caplog.at_level("WARNING", logger="jaxdist.input.dataset"):
        _same(host, _epoch(auto, False, epoch=0))  # the same batches, from the host
    assert not auto.on_device
    assert [r.getMessage() for r in caplog.records] == [
        "distribute: the dataset's arrays do not fit on the devices (RESOURCE_EXHAUSTED: Out of "
        "memory while trying to allocate 2436 bytes.); their batches are gathered on the host"]
    with pytest.raises(MemoryError, match=r"^distribute: the dataset's 0\.0 MB do not fit on "
                       r"each device .* pass on_device=False"):
        _epoch(s.distribute((x,), 16, on_device=True), False, epoch=0)
