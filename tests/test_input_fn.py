"""Input functions (distribute_datasets_from_function + InputContext), shard policies, reshuffling."""

from __future__ import annotations

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist


def _epoch(dataset, **kw):
    """(ids of real rows in order, number of steps, last_num_real per step) for one epoch."""
    ids, steps, reals = [], 0, []
    it = dataset.iterator(**kw) if kw else iter(dataset)
    for b in it:
        x = np.asarray(b.data["id"] if isinstance(b.data, dict) else b.data[0])
        mask = np.asarray(b.mask)
        assert int(mask.sum()) == it.last_num_real
        ids.extend(x[mask].tolist())
        reals.append(it.last_num_real)
        steps += 1
    return ids, steps, reals


# --- InputContext ----------------------------------------------------------------------------------
def test_input_context_matches_tf():
    ctx = jaxdist.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=8)
    assert ctx.get_per_replica_batch_size(64) == 8
    with pytest.raises(ValueError, match=r"The `global_batch_size` 60 is not divisible by "
                                         r"`num_replicas_in_sync` 8"):
        ctx.get_per_replica_batch_size(60)
    assert jaxdist.InputContext() == jaxdist.InputContext(1, 0, 1)  # tf's defaults
    with pytest.raises(ValueError, match=r"input_pipeline_id=2.*\[0, 2\)"):
        jaxdist.InputContext(2, 2, 4)
    with pytest.raises(dataclasses_frozen_error()):
        ctx.input_pipeline_id = 0


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


# --- distribute_datasets_from_function ---------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 8])
def test_each_step_takes_one_per_replica_batch_per_replica(n):
    s = jaxdist.MirroredStrategy(jax.devices()[:n])
    seen_ctx = []

    def fn(ctx):
        seen_ctx.append(ctx)
        size = ctx.get_per_replica_batch_size(4 * n)
        return [(np.arange(i, min(i + size, 37)),) for i in range(0, 37, size)]

    ds = s.distribute_datasets_from_function(fn)
    assert seen_ctx == [jaxdist.InputContext(1, 0, n)]
    assert ds.global_batch_size == 4 * n
    batches = list(ds)
    assert len(seen_ctx) == 1  # called once; the list is read again for every epoch
    first = batches[0]
    assert first.data[0].sharding == s.layout.batch and first.mask.sharding == s.layout.replicated
    # Row block r of the global batch is replica r's per-replica batch.
    np.testing.assert_array_equal(np.asarray(first.data[0]), np.arange(4 * n))
    ids, steps, reals = _epoch(ds)
    assert ids == list(range(37)) and steps == -(-37 // (4 * n))
    assert sum(reals) == 37
    # The last step: replicas whose batch is short or missing carry padding rows (mask False).
    last_mask = np.asarray(batches[-1].mask).reshape(n, 4)
    per_replica_real = [min(max(37 - (steps - 1) * 4 * n - 4 * r, 0), 4) for r in range(n)]
    assert last_mask.sum(axis=1).tolist() == per_replica_real


def test_grain_pipeline_sliced_shuffled_batched_reshuffles_per_epoch():
    s = jaxdist.MirroredStrategy(jax.devices()[:4])
    global_batch = 16

    def dataset_fn(ctx):
        ds = grain.MapDataset.range(103)
        ds = ds[ctx.input_pipeline_id::ctx.num_input_pipelines].shuffle(seed=5)
        return ds.map(lambda i: {"id": np.int32(i), "x": np.float32(i) * 2}).batch(
            ctx.get_per_replica_batch_size(global_batch))

    ds = s.distribute_datasets_from_function(dataset_fn)
    orders = []
    for _ in range(3):  # created once, iterated once per epoch
        order = []
        for b in ds:
            mask = np.asarray(b.mask)
            np.testing.assert_array_equal(np.asarray(b.data["x"]), np.asarray(b.data["id"]) * 2.0)
            order.extend(np.asarray(b.data["id"])[mask].tolist())
        assert sorted(order) == list(range(103))
        orders.append(order)
    assert len({tuple(o) for o in orders}) == 3  # a new order every epoch
    # The order is a function of (seed, epoch): grain's epoch e of the shuffled dataset.
    ref = grain.MapDataset.range(103).shuffle(seed=5)
    assert orders[2] == [int(ref[i]) for i in range(2 * 103, 3 * 103)]
    again = s.distribute_datasets_from_function(dataset_fn)
    assert _epoch(again, epoch=1)[0] == orders[1]
    # Resume mid-epoch: the rest of the epoch exactly.
    it = again.iterator(epoch=2)
    head = [np.asarray(next(it).data["id"]).tolist() for _ in range(3)]
    tail = _epoch(again, **it.state())[0]
    assert [i for b in head for i in b] + tail == orders[2]


def test_fit_trains_on_a_dataset_from_a_function():
    (x, y), _ = jaxdist.datasets.digits()
    s = jaxdist.MirroredStrategy(jax.devices()[:4])

    def dataset_fn(ctx):
        n = len(x)
        idx = np.arange(ctx.input_pipeline_id, n, ctx.num_input_pipelines)
        size = ctx.get_per_replica_batch_size(64)
        return [(x[idx[i:i + size]], y[idx[i:i + size]]) for i in range(0, len(idx), size)]

    from jaxdist import models

    state = models.create_train_state(models.MLP(hidden=(32,)), x[:1], seed=0)
    step = s.step(models.classifier_train_step)
    hist = jaxdist.fit(step, state, s.distribute_datasets_from_function(dataset_fn), epochs=2,
                       verbose=0)
    assert hist.history["loss"][1] < hist.history["loss"][0]
    # Both ways of feeding the same batches give the same parameters.
    hist2 = jaxdist.fit(step, models.create_train_state(models.MLP(hidden=(32,)), x[:1], seed=0),
                        s.distribute((x, y), 64), epochs=2, verbose=0)
    for a, b in zip(jax.tree.leaves(hist.state.params), jax.tree.leaves(hist2.state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_a_one_shot_iterator_is_asked_for_again_each_epoch():
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    calls = []

    def fn(ctx):
        calls.append(ctx)
        return ((np.arange(i, i + 3),) for i in range(0, 12, 3))  # a generator object

    ds = s.distribute_datasets_from_function(fn)  # reads the first batch to learn its size
    assert ds.global_batch_size == 6 and len(calls) == 1
    assert _epoch(ds)[0] == list(range(12))  # the batch read to learn the size is not lost
    assert _epoch(ds)[0] == list(range(12)) and len(calls) == 2


@pytest.mark.parametrize("fn, kw, err, match", [
    (lambda ctx: [(np.arange(5),)], {"global_batch_size": 8}, ValueError,
     r"per-replica batch 0 .* has 5 examples, more than the per-replica batch size 4"),
    (lambda ctx: [(np.arange(4),), (np.arange(0),)], {}, ValueError,
     r"per-replica batch 1 .* has 0 examples"),
    (lambda ctx: 42, {}, TypeError, r"returned a int; it must return a dataset batched"),
    (lambda ctx: [], {}, ValueError, r"pipeline is empty.*pass global_batch_size="),
])
def test_input_function_errors(fn, kw, err, match):
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    with pytest.raises(err, match=match):
        list(s.distribute_datasets_from_function(fn, **kw))


# --- AutoShardPolicy ----------------------------------------------------------------------------
def _files(sizes):
    """A FileSource of files whose rows are consecutive ids, and a log of what was read."""
    starts = np.cumsum([0, *sizes])
    reads = []

    def read(path):
        k = int(path.split("-")[1])
        reads.append(path)
        ids = np.arange(starts[k], starts[k + 1])
        yield from ((ids[i:i + 3], ids[i:i + 3] * 10) for i in range(0, len(ids), 3))

    return jaxdist.FileSource([f"file-{k}" for k in range(len(sizes))], read), reads


@pytest.mark.parametrize("policy", ["auto", jaxdist.AutoShardPolicy.FILE, "OFF"])
def test_file_source_on_one_process_reads_each_file_once(policy):
    s = jaxdist.MirroredStrategy(jax.devices()[:4])
    src, reads = _files([7, 1, 10])
    ds = s.distribute(src, 8, auto_shard_policy=policy)
    expected = jaxdist.AutoShardPolicy.OFF if policy == "OFF" else jaxdist.AutoShardPolicy.FILE
    assert ds.auto_shard_policy is expected
    ids, steps, reals = _epoch(ds)
    assert ids == list(range(18)) and reals == [8, 8, 2]  # regrouped into global batches
    assert reads == ["file-0", "file-1", "file-2"]
    b = next(iter(ds))
    np.testing.assert_array_equal(np.asarray(b.data[1]), np.asarray(b.data[0]) * 10)
    dropped = s.distribute(src, 8, auto_shard_policy=policy, drop_remainder=True)
    assert _epoch(dropped)[2] == [8, 8]


def test_data_policy_keeps_each_batch_as_read():
    s = jaxdist.MirroredStrategy(jax.devices()[:4])
    src, reads = _files([7, 1])
    ds = s.distribute(src, 8, auto_shard_policy="data")
    assert _epoch(ds)[2] == [3, 3, 1, 1]  # one global batch per batch read, padded


@pytest.mark.parametrize("data, policy, match", [
    ([(np.arange(4),)], "file", r"FILE needs a source that exposes shards .*got a list.*FileSource"),
    ((np.arange(8),), "file", r"applies to iterable sources; in-memory arrays"),
    ((np.arange(8),), "off", r"applies to iterable sources"),
])
def test_policy_errors(data, policy, match):
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    with pytest.raises(ValueError, match=match):
        s.distribute(data, 4, auto_shard_policy=policy)


def test_file_source_needs_a_file_per_pipeline():
    src, _ = _files([3, 3])
    assert [p for p in src.shard(1, 2).paths] == ["file-1"]
    with pytest.raises(ValueError, match=r"3 input pipelines its own files, but the source has "
                                         r"only 2.*AutoShardPolicy.DATA"):
        src.shard(0, 3)
    with pytest.raises(ValueError, match=r"non-empty sequence of str paths"):
        jaxdist.FileSource("one-path.txt", lambda p: [])


# --- the two input errors of issue 8 ----------------------------------------------------------------
def test_an_empty_batch_from_an_iterable_is_a_clear_error():
    # Failed before with "IndexError: index 0 is out of bounds".
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    batches = [(np.arange(4),), (np.arange(0),)]
    with pytest.raises(ValueError, match=r"batch 1 of the dataset has 0 examples"):
        list(s.distribute(batches, 4))


@pytest.mark.parametrize("x_rows", [100, 8])
def test_a_list_of_arrays_is_refused_with_the_fix(x_rows):
    # Failed before with 8 rows: silently two "batches", x then y.
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    with pytest.raises(ValueError, match=r"list of 2 arrays .*pass a tuple \(x, y\)"):
        s.distribute([np.zeros((x_rows, 3)), np.zeros(x_rows)], 8)
    assert len(list(s.distribute([(np.zeros((8, 3)), np.zeros(8))], 8))) == 1  # list of batches


# --- per-epoch reshuffling of a dataset created once ---------------------------------------------
def test_a_dataset_created_once_reshuffles_every_epoch_as_a_function_of_seed_and_epoch():
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    data = {"id": np.arange(50)}
    ds = s.distribute(data, 10, shuffle=True, seed=11)
    orders = [[i for b in ds for i in np.asarray(b.data["id"]).tolist()] for _ in range(3)]
    assert len({tuple(o) for o in orders}) == 3
    for epoch, order in enumerate(orders):
        assert order == np.random.default_rng([11, epoch]).permutation(50).tolist()
        fresh = s.distribute(data, 10, shuffle=True, seed=11)  # exact resume at any epoch
        assert [i for b in fresh.iterator(epoch=epoch)
                for i in np.asarray(b.data["id"]).tolist()] == order


def test_global_view_step_sums_match_on_a_dataset_from_a_function():
    s = jaxdist.MirroredStrategy(jax.devices()[:8])

    def fn(ctx):
        return [(np.arange(i, min(i + 2, 29), dtype=np.float32),) for i in range(0, 29, 2)]

    step = s.step(lambda w, b: (w, {"sum": jnp.sum(jnp.where(b.mask, b.data[0], 0.0))}))
    w, total = jnp.zeros(()), 0.0
    for b in s.distribute_datasets_from_function(fn):
        w, m = step(w, b)
        total += float(m["sum"])
    assert total == float(np.arange(29).sum())


def test_per_replica_view_gives_replica_r_its_own_per_replica_batch():
    s = jaxdist.MirroredStrategy(jax.devices()[:4])

    def fn(ctx):  # per-replica batch k holds k in every row
        return [(np.full(3, k, np.int32),) for k in range(6)]

    firsts = []
    for b in s.distribute_datasets_from_function(fn):
        out = s.run(lambda b: b.data[0][0] + 100 * jnp.sum(b.mask), args=(b,))
        firsts.append([int(v) for v in s.local_results(out)])
    # tf: replica r of step t gets the pipeline's batch 4 t + r; missing ones are all padding.
    assert firsts == [[300, 301, 302, 303], [304, 305, 4, 4]]


@pytest.mark.parametrize("make", [
    lambda: jaxdist.DefaultStrategy(), lambda: jaxdist.OneDeviceStrategy(jax.devices()[1]),
    lambda: jaxdist.CentralStorageStrategy(jax.devices()[:2])])
def test_every_mesh_strategy_takes_an_input_function(make):
    s = make()
    ds = s.distribute_datasets_from_function(
        lambda ctx: [(np.arange(i, min(i + 2, 7)),) for i in range(0, 7, 2)])
    assert ds.input_context.num_replicas_in_sync == s.num_replicas_in_sync
    assert sorted(_epoch(ds)[0]) == list(range(7))
