"""2 processes x 2 devices: per-process input (FILE / DATA / OFF, input functions with grain),
pipelines that end at different steps, a failing pipeline, and one that is never read.

Writes what each process read and saw to OUT_DIR/rank<r>.json.
"""

import json
import os
import sys
import time

import jaxdist

jaxdist.initialize(timeout_s=60)

import grain  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

out_dir = sys.argv[1]
me = jax.process_index()
s = jaxdist.MultiWorkerMirroredStrategy()
step = s.step(lambda w, b: (w, {"sum": jnp.sum(jnp.where(b.mask, b.data[0], 0)),
                                "count": jnp.sum(b.mask)}))
result: dict = {"rank": me}


def local(x, rows_of=None):
    """This process's rows of a global array, in order; a replicated array (a mask ``distribute``
    replicates) gives the rows ``rows_of``'s shards hold."""
    if x.is_fully_replicated and rows_of is not None:
        whole = np.asarray(x.addressable_data(0))
        return np.concatenate([whole[sh.index[0]] for sh in _in_order(rows_of)])
    return np.concatenate([np.asarray(sh.data) for sh in _in_order(x)])


def _in_order(x):
    return sorted(x.addressable_shards, key=lambda sh: sh.index[0].start or 0)


def epoch(ds, **kw):
    """One epoch: this process's real ids, global real counts per step, and the on-device totals."""
    ids, reals, total, count = [], [], 0, 0
    w = jnp.zeros(())
    with (ds.iterator(**kw) if kw else iter(ds)) as it:
        for b in it:
            mask = local(b.mask, rows_of=b.data[0])
            ids.extend(local(b.data[0])[mask].tolist())
            reals.append(it.last_num_real)
            w, m = step(w, b)
            total, count = total + int(m["sum"]), count + int(m["count"])
    return {"ids": ids, "reals": reals, "sum": total, "count": count}


# --- AutoShardPolicy over a FileSource: files of uneven sizes ---------------------------------------
SIZES = [7, 3, 11, 4, 2]  # process 0 reads files 0, 2, 4 (20 rows), process 1 files 1, 3 (7 rows)
STARTS = np.cumsum([0, *SIZES])
reads: list = []


def read(path):
    k = int(path.rsplit("-", 1)[1])
    reads.append(k)
    ids = np.arange(STARTS[k], STARTS[k + 1], dtype=np.int32)
    for i in range(0, len(ids), 3):
        yield (ids[i:i + 3],)


src = jaxdist.FileSource([f"part-{k}" for k in range(len(SIZES))], read)
for policy in ("file", "data"):
    reads.clear()
    ds = s.distribute(src, 8, auto_shard_policy=policy)
    result[policy] = {**epoch(ds), "files": sorted(reads), "policy": ds.auto_shard_policy.value}


# --- in-memory arrays: gathered on the devices (the default) or on the host, the same batches ---------
def rows_seen(ds, **where):
    """Every batch's local rows, local mask, position and real count, as lists."""
    seen = []
    with ds.iterator(**where) as it:
        for item in it:
            b = item.batches if "group_size" in where else item
            data = [local(v).tolist() for v in b.data]
            seen.append([data, np.asarray(b.mask.addressable_data(0)).tolist(), it.position,
                         list(it.last_num_real) if isinstance(it.last_num_real, tuple)
                         else it.last_num_real])
    return seen


arrays = (np.arange(45, dtype=np.int32), np.linspace(0, 1, 90, dtype=np.float32).reshape(45, 2))
result["in_memory"] = {}
for where in ({}, {"epoch": 1, "position": 2}, {"group_size": 2, "epoch": 2}):
    runs = [rows_seen(s.distribute(arrays, 8, shuffle=True, seed=4, on_device=on), **where)
            for on in (False, True)]
    result["in_memory"][json.dumps(where)] = runs


# --- OFF: each process's iterable is its own -------------------------------------------------------
def own_stream():
    ids = np.arange(10, dtype=np.int32) if me == 0 else np.arange(100, 103, dtype=np.int32)
    return [(ids[i:i + 4],) for i in range(0, len(ids), 4)]


result["off"] = epoch(s.distribute(own_stream, 8, auto_shard_policy="off"))


# --- distribute_datasets_from_function with grain -----------------------------------------------------
def grain_fn(ctx):
    ds = grain.MapDataset.range(45)[ctx.input_pipeline_id::ctx.num_input_pipelines]
    return ds.map(np.int32).shuffle(seed=3).map(lambda i: (i,)).batch(
        ctx.get_per_replica_batch_size(8))


ds = s.distribute_datasets_from_function(grain_fn)
result["context"] = [ds.input_context.num_input_pipelines, ds.input_context.input_pipeline_id,
                     ds.input_context.num_replicas_in_sync]
result["grain"] = [epoch(ds) for _ in range(2)]
result["grain_again_epoch1"] = epoch(s.distribute_datasets_from_function(grain_fn), epoch=1)


# --- pipelines that end at different steps ------------------------------------------------------------
def uneven_fn(ctx):
    ids = np.arange(30, dtype=np.int32) if ctx.input_pipeline_id == 0 else np.arange(
        1000, 1006, dtype=np.int32)
    size = ctx.get_per_replica_batch_size(8)
    return [(ids[i:i + size],) for i in range(0, len(ids), size)]


result["uneven"] = epoch(s.distribute_datasets_from_function(uneven_fn))


# --- a pipeline that fails on process 1: process 0 is told at once, not after a timeout ---------------
def failing_fn(ctx):
    def gen():
        for i in range(6):
            if ctx.input_pipeline_id == 1 and i == 3:
                raise OSError("disk went away")
            yield (np.arange(2 * i, 2 * i + 2, dtype=np.int32),)
    return gen()


t0 = time.monotonic()
try:
    epoch(s.distribute_datasets_from_function(failing_fn, sync_timeout_s=120))
    result["failing"] = "no error"
except Exception as e:  # noqa: BLE001
    result["failing"] = f"{type(e).__name__}: {e}"
result["failing_s"] = time.monotonic() - t0
jaxdist.barrier("after-failing", timeout_s=60)

# --- a dataset iterated on process 0 only: a bounded wait that names process 1 ------------------------
ds = s.distribute_datasets_from_function(uneven_fn, sync_timeout_s=3)
if me == 0:
    try:
        next(iter(ds))
        result["alone"] = "no error"
    except jaxdist.InputSyncTimeoutError as e:
        result["alone"] = str(e)
jaxdist.barrier("done", timeout_s=60)

with open(os.path.join(out_dir, f"rank{me}.json"), "w") as f:
    json.dump(result, f)
print(f"process {me} finished")
