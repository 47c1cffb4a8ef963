"""Distributed input: padding + mask, exactly-once examples, shuffling, resume, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist

N_EXAMPLES = 203  # prime: the last batch is partial for every batch size used


def _ids_seen(dist, epoch):
    seen = []
    it = dist.iterator(epoch=epoch)
    for b in it:
        ids, mask = np.asarray(b.data["id"]), np.asarray(b.mask)
        assert int(mask.sum()) == it.last_num_real
        seen.extend(ids[mask].tolist())
    return seen


@pytest.mark.parametrize("n", [1, 2, 8])
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_example_once_per_epoch(n, shuffle):
    s = jaxdist.MirroredStrategy(jax.devices()[:n])
    data = {"id": np.arange(N_EXAMPLES), "x": np.random.default_rng(0).normal(size=(N_EXAMPLES, 3))}
    dist = s.distribute(data, 32, shuffle=shuffle, seed=7)
    assert len(dist) == 7
    for epoch in range(2):
        seen = _ids_seen(dist, epoch)
        assert sorted(seen) == list(range(N_EXAMPLES))
    if shuffle:  # a different order every epoch, the same order for the same (seed, epoch)
        assert _ids_seen(dist, 0) != _ids_seen(dist, 1)
        assert _ids_seen(dist, 1) == _ids_seen(s.distribute(data, 32, shuffle=True, seed=7), 1)


def test_batches_are_sharded_and_shape_never_changes():
    s = jaxdist.MirroredStrategy(jax.devices()[:4])
    shapes = set()
    for b in s.distribute((np.zeros((50, 2), np.float32), np.arange(50)), 16):
        x, y = b.data
        # The mask is replicated: its sum (compute_average_loss's count) needs no collective.
        assert x.sharding == s.layout.batch and b.mask.sharding == s.layout.replicated
        assert len(x.addressable_shards) == 4
        shapes.add((x.shape, y.shape, b.mask.shape))
    assert shapes == {((16, 2), (16,), (16,))}


def test_padding_uses_copies_of_real_rows():
    s = jaxdist.OneDeviceStrategy()
    x = np.arange(1, 6, dtype=np.float32)  # no zeros: zero padding would be visible
    *_, last = s.distribute((x,), 4)
    assert np.asarray(last.mask).tolist() == [True, False, False, False]
    assert np.all(np.asarray(last.data[0]) == 5.0)


@pytest.mark.parametrize("n", [1, 4])
def test_uneven_data_sum_and_count_match_one_device_pass(n):
    """Summed loss and example count over an epoch equal one un-batched pass on one device."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(N_EXAMPLES, 5)).astype(np.float32)
    w = rng.normal(size=(5,)).astype(np.float32)
    expected_sum = float(np.sum((x @ w) ** 2))
    s = jaxdist.MirroredStrategy(jax.devices()[:n])

    @s.step
    def step(w, batch):
        per_example = (batch.data[0] @ w) ** 2
        mean = jaxdist.compute_average_loss(per_example, batch.mask)
        return w, {"sum": mean * jnp.sum(batch.mask), "count": jnp.sum(batch.mask)}

    total, count = 0.0, 0
    for b in s.distribute((x,), 24):
        w, m = step(w, b)
        total += float(m["sum"])
        count += int(m["count"])
    assert count == N_EXAMPLES
    np.testing.assert_allclose(total, expected_sum, rtol=1e-5)
    # fit's epoch metric weights by real counts, so it is the exact mean too.
    hist = jaxdist.fit(s.step(lambda w, b: (w, {"loss": jaxdist.compute_average_loss(
        (b.data[0] @ w) ** 2, b.mask)})), w, s.distribute((x,), 24), verbose=0)
    np.testing.assert_allclose(hist.history["loss"][0], expected_sum / N_EXAMPLES, rtol=1e-5)


def test_drop_remainder():
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    dist = s.distribute((np.arange(10),), 4, drop_remainder=True)
    assert len(dist) == 2
    assert all(np.asarray(b.mask).all() for b in dist)


def test_iterable_of_batches_and_generator_function():
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    batches = [(np.arange(8), np.ones(8)), (np.arange(8, 11), np.ones(3))]
    got = [(np.asarray(b.data[0]), np.asarray(b.mask)) for b in s.distribute(batches, 8)]
    assert [int(m.sum()) for _, m in got] == [8, 3]
    assert got[1][0][got[1][1]].tolist() == [8, 9, 10]
    dist = s.distribute(lambda: iter(batches), 8)  # re-iterable: called once per epoch
    assert len(list(dist)) == 2 and len(list(dist)) == 2


def test_resume_from_iterator_state():
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    dist = s.distribute({"id": np.arange(100)}, 10, shuffle=True, seed=3)
    it = dist.iterator(epoch=2)
    first = [np.asarray(next(it).data["id"]).tolist() for _ in range(4)]
    state = it.state()
    assert state == {"epoch": 2, "position": 4}
    rest = [np.asarray(b.data["id"]).tolist() for b in it]
    resumed = [np.asarray(b.data["id"]).tolist() for b in dist.iterator(**state)]
    assert resumed == rest and len(first) + len(rest) == 10


def test_iterator_propagates_source_errors():
    s = jaxdist.OneDeviceStrategy()

    def broken():
        yield (np.arange(4),)
        raise OSError("disk went away")

    it = iter(s.distribute(broken, 4))
    next(it)
    with pytest.raises(OSError, match="disk went away"):
        next(it)


@pytest.mark.parametrize("data, batch, n, match", [
    ((np.zeros((10, 2)),), 12, 8, r"global_batch_size=12 does not divide over the 8 replicas.*8 or 16"),
    ((np.zeros((10, 2)),), 0, 1, r"positive int"),
    ((np.zeros((10, 2)), np.zeros(9)), 4, 1, r"different leading .* \{'data\[0\]': 10, 'data\[1\]': 9\}"),
    ({"x": np.zeros((4, 2)), "y": [1, 2, 3, 4]}, 4, 1, r"leaf data\['y'\]\[0\] is int"),
    ((np.float32(3.0),), 4, 1, r"a scalar"),
    (42, 4, 1, r"cannot distribute a int"),
])
def test_bad_input_errors(data, batch, n, match):
    s = jaxdist.MirroredStrategy(jax.devices()[:n])
    with pytest.raises(ValueError, match=match):
        s.distribute(data, batch)


def test_list_instead_of_tuple_is_explained():
    s = jaxdist.OneDeviceStrategy()
    with pytest.raises(ValueError,
                       match=r"list of 2 arrays \[\(100, 2\), \(100,\)\].*pass a tuple \(x, y\)"):
        list(s.distribute([np.zeros((100, 2)), np.zeros(100)], 10))


def test_raw_batch_that_does_not_divide_over_replicas():
    s = jaxdist.MirroredStrategy(jax.devices()[:8])
    step = s.step(lambda w, b: (w, {"m": jnp.mean(b)}))
    with pytest.raises(ValueError, match=r"batch has 12 examples, which does not divide over 8"):
        step(jnp.zeros(()), np.zeros(12, np.float32))


def _prefetch_threads():
    import threading

    return [t for t in threading.enumerate() if t.name == "jaxdist-prefetch" and t.is_alive()]


def test_abandoned_closed_and_failed_iterators_stop_their_threads():
    import gc
    import time

    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    dist = s.distribute((np.arange(40),), 4, prefetch=2)
    for _ in range(5):  # abandoned mid-epoch, queue full
        next(iter(dist))
    it = iter(dist)
    next(it)
    it.close()

    def broken():
        yield (np.arange(4),)
        raise OSError("boom")

    failing = iter(s.distribute(broken, 4))
    next(failing)
    with pytest.raises(OSError):
        next(failing)
    with iter(dist) as it2:
        next(it2)
    del it, it2, failing
    deadline = time.time() + 10
    while _prefetch_threads() and time.time() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert _prefetch_threads() == []


def test_resume_of_an_iterable_with_dropped_partial_batches():
    s = jaxdist.OneDeviceStrategy()
    batches = [(np.arange(0, 4),), (np.arange(4, 6),), (np.arange(6, 10),), (np.arange(10, 14),)]
    dist = s.distribute(batches, 4, drop_remainder=True)
    it = dist.iterator()
    assert np.asarray(next(it).data[0]).tolist() == [0, 1, 2, 3]
    assert np.asarray(next(it).data[0]).tolist() == [6, 7, 8, 9]
    rest = [np.asarray(b.data[0]).tolist() for b in dist.iterator(**it.state())]
    assert rest == [[10, 11, 12, 13]]


def test_a_bare_jax_array_is_an_in_memory_dataset():
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    dist = s.distribute(jnp.arange(32.0).reshape(16, 2), 8)
    assert len(dist) == 2
    assert [b.data.shape for b in dist] == [(8, 2), (8, 2)]


def test_host_rows_are_gathered_into_aligned_buffers():
    # XLA:CPU places 64-byte-aligned host buffers without copying them; every leaf dtype and shape
    # still comes out equal to a[idx], and object arrays fall back to plain indexing.
    from jaxdist.input.dataset import _ALIGN, _take_rows

    rng = np.random.default_rng(0)
    tree = {"x": rng.normal(size=(37, 3, 5)).astype(np.float32), "y": np.arange(37, dtype=np.int8),
            "f": rng.normal(size=37), "o": np.array([str(i) for i in range(37)], dtype=object)}
    idx = rng.permutation(37)[:11]
    out = _take_rows(tree, idx)
    for k, a in tree.items():
        np.testing.assert_array_equal(out[k], a[idx])
        assert out[k].dtype == a.dtype
        if k != "o":
            assert out[k].ctypes.data % _ALIGN == 0
            assert not np.shares_memory(out[k], a)


def test_full_batches_share_one_device_mask_and_a_partial_batch_gets_its_own():
    s = jaxdist.MirroredStrategy(jax.devices()[:4])
    dist = s.distribute({"id": np.arange(20)}, 8)  # 8, 8, then 4 real rows padded to 8
    batches = list(dist)
    assert batches[0].mask is batches[1].mask
    assert np.asarray(batches[0].mask).all()
    np.testing.assert_array_equal(np.asarray(batches[2].mask), np.arange(8) < 4)
    assert batches[2].mask.sharding == batches[0].mask.sharding


def test_iterator_reports_how_long_it_waited_for_the_pipeline():
    # No timing bounds (machines are noisy): a batch that cannot exist yet must be waited for, and
    # for no longer than next() took; a batch already queued costs no wait.
    import threading
    import time

    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    gate = threading.Event()

    def gated():
        yield {"x": np.full((4,), 0, np.float32)}
        gate.wait(60)
        for k in (1, 2):
            yield {"x": np.full((4,), k, np.float32)}

    with s.distribute(gated, 4, prefetch=4).iterator() as it:
        assert it.stall_s == 0.0
        assert float(next(it).data["x"][0]) == 0.0
        before = it.stall_s
        opener = threading.Timer(0.5, gate.set)
        opener.start()
        t0 = time.perf_counter()
        assert float(next(it).data["x"][0]) == 1.0  # produced only after the gate opened
        took = time.perf_counter() - t0
        assert 0.0 < it.stall_s - before <= took
        opener.join()
        it._producer.thread.join(60)  # batch 2 and the end are queued now
        before = it.stall_s
        assert [float(b.data["x"][0]) for b in it] == [2.0]
        assert it.stall_s == before


@pytest.mark.parametrize("source", ["arrays", "iterable"])
def test_batches_made_on_the_loop_thread_equal_prefetched_ones(source):
    s = jaxdist.MirroredStrategy(jax.devices()[:4])
    x, y = np.arange(44, dtype=np.float32).reshape(22, 2), np.arange(22)
    data = (x, y) if source == "arrays" else (lambda: ((x[i:i + 8], y[i:i + 8])
                                                       for i in range(0, 22, 8)))
    kw = {"shuffle": True, "seed": 3} if source == "arrays" else {}

    def epoch(prefetch, **where):
        dist = s.distribute(data, 8, prefetch=prefetch, **kw)
        with dist.iterator(epoch=1, **where) as it:
            return [(np.asarray(b.data[0]), np.asarray(b.data[1]), np.asarray(b.mask), it.position)
                    for b in it]

    before = len(_prefetch_threads())
    inline = epoch(0)
    assert len(_prefetch_threads()) == before  # no thread was started
    for a, b in zip(inline, epoch(2), strict=True):
        for u, v in zip(a, b):
            np.testing.assert_array_equal(u, v)
    assert [m.sum() for _, _, m, _ in inline] == [8, 8, 6]
    assert [p for *_, p in epoch(0, position=1)] == [2, 3]  # resumes after the first batch


def test_in_memory_data_is_made_on_the_loop_thread_by_default_and_errors_surface():
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    assert s.distribute((np.arange(8),), 4)._prefetch == 0
    assert s.distribute(lambda: iter([(np.arange(4),)]), 4)._prefetch == 2

    def broken():
        yield (np.arange(4),)
        raise OSError("disk gone")

    it = iter(s.distribute(broken, 4, prefetch=0))
    assert np.asarray(next(it).data[0]).tolist() == [0, 1, 2, 3]
    with pytest.raises(OSError, match="disk gone"):
        next(it)
    with pytest.raises(StopIteration):  # a failed iterator is closed
        next(it)
    with pytest.raises(ValueError, match=r"prefetch must be an int >= 0"):
        s.distribute((np.arange(8),), 4, prefetch=-1)
