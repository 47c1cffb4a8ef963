"""The in-memory state tier, in one process (8 simulated devices): snapshots off the loop's thread,
sharded state, damaged and missing snapshots, a directory without room, and the cadence."""

from __future__ import annotations

import errno
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.checkpoint import InMemoryTier, _assemble, _slots, memstate


def _mesh(n=8):
    return jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:n])


def _state(step, mesh=None, spec=None):
    spec = P("data") if spec is None else spec
    w = jnp.arange(64 * 6, dtype=jnp.float32).reshape(64, 6) + step
    b = jnp.full((6,), float(step), jnp.bfloat16)
    state = {"w": w, "b": b, "count": jnp.int32(step), "flag": jnp.array([True, False])}
    if mesh is not None:
        state["w"] = jax.device_put(state["w"], NamedSharding(mesh, spec))
        state["b"] = jax.device_put(state["b"], NamedSharding(mesh, P()))
    return state


def _same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_resumes_the_newest_of_two_slots_and_survives_donation(tmp_path):
    tier = InMemoryTier(str(tmp_path), rank=0, every=1)
    step = jax.jit(lambda s: jax.tree.map(lambda x: x + 1 if x.dtype != jnp.bool_ else x, s),
                   donate_argnums=0)
    state = _state(0)
    for k in range(1, 6):
        state = step(state)  # the next step donates (deletes) this state's buffers
        assert tier.save(k, state, {"epoch": 0, "position": k})
    tier.close()
    steps = sorted(int(h["step"]) for _, _, h in _slots.slots(str(tmp_path)))
    assert steps == [4, 5]  # two slots: the newest two steps
    snap = InMemoryTier(str(tmp_path), rank=0).resume(_state(0))
    assert snap.step == 5 and snap.data_state == {"epoch": 0, "position": 5}
    _same(snap.state, jax.tree.map(lambda x: x + 5 if x.dtype != jnp.bool_ else x, _state(0)))


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_a_damaged_newest_snapshot_falls_back_to_the_older_one(tmp_path, damage):
    tier = InMemoryTier(str(tmp_path), rank=0, every=1)
    for k in (1, 2):
        tier.save(k, _state(k))
        tier.flush()
    tier.close()
    rank_dir = str(tmp_path / "0")
    newest = next(s for _, s, h in _slots.slots(str(tmp_path)) if h["step"] == 2)
    path = _slots.data_path(rank_dir, newest)
    if damage == "flip":  # 16 bytes in the middle of the data
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            raw = bytearray(f.read(16))
            f.seek(os.path.getsize(path) // 2)
            f.write(bytes(b ^ 0xFF for b in raw))
    elif damage == "truncate":
        os.truncate(path, os.path.getsize(path) // 3)
    else:
        with open(_slots.header_path(rank_dir, newest), "w") as f:
            f.write('{"format": 1, "step": 2')  # half a header
    snap = InMemoryTier(str(tmp_path), rank=0).resume(_state(0))
    assert snap is not None and snap.step == 1
    _same(snap.state, _state(1))


def test_every_snapshot_damaged_gives_none_so_the_backup_is_used(tmp_path):
    tier = InMemoryTier(str(tmp_path), rank=0, every=1)
    tier.save(1, _state(1))
    tier.close()
    for _, slot, _ in list(_slots.slots(str(tmp_path))):
        path = _slots.data_path(str(tmp_path / "0"), slot)
        with open(path, "r+b") as f:
            f.write(b"\x00" * 32)
    assert InMemoryTier(str(tmp_path), rank=0).resume(_state(0)) is None


def test_a_snapshot_of_another_state_is_not_used(tmp_path):
    tier = InMemoryTier(str(tmp_path), rank=1)
    tier.save(7, {"w": jnp.ones(2)})
    tier.close()
    assert InMemoryTier(str(tmp_path), rank=0).resume({"w": jnp.ones(3)}) is None
    assert InMemoryTier(None).resume({"w": jnp.ones(3)}) is None  # no directory: disabled


@pytest.mark.parametrize("layout", ["sharded", "replicated"])
def test_sharded_state_is_kept_block_by_block_and_restored_in_place(tmp_path, layout):
    mesh = _mesh()
    spec = P("data") if layout == "sharded" else P()
    tier = InMemoryTier(str(tmp_path), rank=0, every=1)
    tier.save(3, _state(3, mesh, spec))
    tier.close()
    (header,) = [h for _, _, h in _slots.slots(str(tmp_path))]
    w_pieces = header["leaves"][-1]["pieces"]  # "w" sorts last
    assert len(w_pieces) == (8 if layout == "sharded" else 1)  # each block once
    target = _state(0, mesh, spec)
    snap = InMemoryTier(str(tmp_path), rank=0).resume(target)
    assert snap.source == 0  # read from this host, no collective
    _same(snap.state, _state(3))
    assert snap.state["w"].sharding == target["w"].sharding


def test_a_snapshot_is_resharded_onto_another_layout(tmp_path):
    tier = InMemoryTier(str(tmp_path), rank=0, every=1)
    tier.save(5, _state(5, _mesh(8), P("data")))  # 8 blocks of "w"
    tier.close()
    target = _state(0, _mesh(2), P(None, "data"))  # 2 devices, split along the other axis
    snap = InMemoryTier(str(tmp_path), rank=0).resume(target)
    assert snap.source == -1  # put together by the collective path
    _same(snap.state, _state(5))
    assert snap.state["w"].sharding == target["w"].sharding


def test_a_directory_without_room_switches_the_tier_off_with_one_warning(tmp_path, monkeypatch,
                                                                          caplog):
    monkeypatch.setattr(memstate, "_free_bytes", lambda d: 1000)
    tier = InMemoryTier(str(tmp_path), rank=0)
    with caplog.at_level("WARNING", logger="jaxdist.checkpoint.memstate"):
        assert tier.save(1, _state(1)) is False
        assert tier.save(2, _state(2)) is False
    assert not tier.enabled
    (record,) = [r for r in caplog.records if "in-memory state tier is off" in r.getMessage()]
    assert "need" in record.getMessage() and "--shm-size" in record.getMessage()


def test_a_full_directory_while_writing_switches_the_tier_off_and_training_goes_on(
        tmp_path, monkeypatch, caplog):
    tier = InMemoryTier(str(tmp_path), rank=0, every=1)
    assert tier.save(1, _state(1))
    tier.flush()

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with caplog.at_level("WARNING", logger="jaxdist.checkpoint.memstate"):
        tier.save(2, _state(2))
        tier.flush()
        assert tier.save(3, _state(3)) is False
    assert not tier.enabled
    assert any("No space left" in r.getMessage() for r in caplog.records)
    assert list(_slots.slots(str(tmp_path))) == []  # its slots are removed: room for others
    tier.close()


def test_copies_in_flight_are_bounded_and_a_step_past_the_bound_is_skipped_not_waited_for(
        tmp_path, monkeypatch):
    import threading

    release, entered = threading.Event(), threading.Event()
    real = _slots.write

    def slow(*args, **kwargs):
        entered.set()
        release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(_slots, "write", slow)
    monkeypatch.setattr(memstate, "_PENDING_SMALL", 0)  # as for a large state: two snapshots
    tier = InMemoryTier(str(tmp_path), rank=0)  # measured cadence: not known yet
    assert tier.save(1, _state(1))
    assert entered.wait(30)  # step 1's copy is done and being written (held up)
    assert tier.save(2, _state(2))  # queued: two snapshots in host memory
    assert tier.save(3, _state(3)) is False  # a third would pass the bound: skipped, not waited
    assert tier.skipped == 1
    release.set()
    tier.close()
    assert sorted(h["step"] for _, _, h in _slots.slots(str(tmp_path))) == [1, 2]


def test_a_fixed_cadence_snapshots_every_n_steps(tmp_path):
    tier = InMemoryTier(str(tmp_path), rank=0, every=3)
    taken = []
    for k in range(1, 11):
        if tier.save(k, _state(k)):
            taken.append(k)
        tier.flush()
    tier.close()
    assert taken == [1, 4, 7, 10]


def test_the_cadence_keeps_the_cost_within_the_budget():
    # XLA:CPU, 0.1 s steps, 100 MB: copies cost the loop 1 ms, the devices 1 ms more (their
    # launch) plus the copy itself (the writer moves 100 MB in 0.05 s: the copy is estimated at
    # 0.025 s); writing costs 0.05 s of CPU
    c = memstate._Cadence(None, 0.05, host_is_device=True, nbytes=100_000_000)
    c._steps.extend([1.0, 1.0] + [0.1] * 10)  # two compiling steps, then 0.1 s steps
    c.on_copy(0.001)
    c.on_persist(cpu_s=0.5, wall_s=2.0)  # the first: setup, not counted
    assert c.bound is None
    c.on_persist(cpu_s=0.05, wall_s=0.05)
    # copies: 0.027 s / (2/3 of 5% of 0.1 s) = 9 steps; writes get what is left of the 5%
    assert (c.copy_every, c.k, c.bound, c.bound_all) == (9, 25, 9, 25)
    assert c.cost() == pytest.approx(0.05 * 0.1)
    # a GPU: the copy and the write run beside the devices; only the dispatch counts
    gpu = memstate._Cadence(None, 0.05, host_is_device=False, nbytes=100_000_000)
    gpu._steps.extend([1.0, 1.0] + [0.1] * 10)
    gpu.on_copy(0.001)
    for _ in range(2):
        gpu.on_persist(cpu_s=0.5, wall_s=0.35)
    assert (gpu.copy_every, gpu.k, gpu.bound, gpu.bound_all) == (1, 4, 1, 7)
    fixed = memstate._Cadence(1, 0.05, host_is_device=True, nbytes=100_000_000)
    fixed._steps.extend([0.1] * 12)
    fixed.on_copy(0.01)
    for _ in range(2):
        fixed.on_persist(cpu_s=0.5, wall_s=0.05)
    assert (fixed.copy_every, fixed.k, fixed.bound) == (1, 1, 1)  # asked: every step, paid for


def test_while_no_copy_was_waited_for_the_loops_pace_times_the_steps(monkeypatch):
    # before: the cadence knew the step time only from copies the writer had to wait for; with
    # tiny steps the writer, persisting every copy, was always behind, so the tier copied and
    # wrote every step for the first 70 steps (a fifth of a short run's time)
    from jaxdist.checkpoint import _cadence

    now = [100.0]
    monkeypatch.setattr(_cadence.time, "perf_counter", lambda: now[0])
    c = memstate._Cadence(None, 0.05, host_is_device=True, nbytes=1_000_000)
    c.on_call(1)
    now[0] += 5.0  # compilation
    for step in range(2, 11):
        c.on_call(step)
        now[0] += 0.01
    assert c.step_s() is None  # 10 calls, the first two left out: not enough yet
    c.on_call(11)
    assert c.step_s() == pytest.approx(0.01)
    c.on_copy(0.002)
    for _ in range(2):
        c.on_persist(cpu_s=0.002, wall_s=0.003)
    # copies: 0.002 s twice (the loop's dispatch, the devices' launch) + the copy (1 MB at 1 GB/s
    # at least: 1 ms) over 2/3 of 5% of 0.01 s = 15 steps; writes: 0.002 s over what is left
    # (1.67% of 0.01 s) = 12 steps, so with the copies: 15
    assert (c.copy_every, c.k) == (15, 15)
    c._steps.extend([1.0, 1.0] + [0.02] * 3)  # copies waited for: they time the steps now
    assert c.step_s() == 0.02


def test_the_announced_bounds_follow_the_copies_and_writes_that_happened():
    # Asked: a copy every 2 steps, written every 2. The loop ran 3 steps ahead of the devices, so
    # a copy found the one before it still in flight and was skipped: copies came every 4 steps.
    c = memstate._Cadence(2, 0.05, host_is_device=False, nbytes=100_000_000)
    c._steps.extend([0.1] * 12)
    for step in (4, 8, 12):
        c.on_copy(0.001, step)
    for step in (4, 8, 12):
        c.on_persist(cpu_s=0.01, wall_s=0.01, step=step)
    assert (c.copy_every, c.k) == (2, 2)
    assert (c.bound, c.bound_all) == (4, 4)  # not 2: what a failure there could really cost
    forced = memstate._Cadence(2, 0.05, host_is_device=False, nbytes=100_000_000)
    forced._steps.extend([0.1] * 12)
    for step in (2, 4):
        forced.on_copy(0.001, step)
    forced.on_copy(0.001, None)  # a forced copy (a stop step) is no gap of the cadence
    for step in (2, 4):
        forced.on_persist(cpu_s=0.01, wall_s=0.01, step=step)
    assert forced.bound == 2


def test_a_survivor_writes_the_newest_landed_copy_even_while_an_older_one_is_being_written(
        tmp_path, monkeypatch):
    import threading

    release, entered = threading.Event(), threading.Event()
    real = _slots.write

    def slow(*args, **kwargs):  # the writer is busy with step 1 (a large write)
        if kwargs["step"] == 1:
            entered.set()
            release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(_slots, "write", slow)
    tier = InMemoryTier(str(tmp_path), rank=0, every=1)
    assert tier.save(1, _state(1))
    assert entered.wait(30)
    assert tier.save(2, _state(2))  # lands while the writer still writes step 1
    import time

    end = time.monotonic() + 30
    while tier._newest_done().step != 2 and time.monotonic() < end:
        time.sleep(0.01)
    assert tier._newest_done().step == 2  # what the flush watcher writes; the writer is at 1
    release.set()
    tier.flush()
    assert tier.last_written == 2
    tier.close()


def test_bad_settings_are_named_and_the_defaults_used(monkeypatch, caplog):
    # issue 37: a bad value used to raise in every rank, although the tier is optional
    monkeypatch.setenv(memstate.ENV_EVERY, "0")
    assert InMemoryTier("/tmp/x")._every is None
    assert "JAXDIST_MEMORY_TIER_EVERY='0': expected a whole number" in caplog.text
    monkeypatch.delenv(memstate.ENV_EVERY)
    for bad in ("5%", "nan", "inf"):
        monkeypatch.setenv(memstate.ENV_BUDGET, bad)
        assert InMemoryTier("/tmp/x")._budget == memstate.DEFAULT_BUDGET
        assert f"JAXDIST_MEMORY_TIER_BUDGET='{bad}'" in caplog.text
    with pytest.raises(ValueError, match="every=0"):  # an argument in code is still an error
        InMemoryTier("/tmp/x", every=0)


def test_states_are_told_apart_by_paths_shapes_and_dtypes():
    a = _assemble.describe({"w": np.zeros((2, 3), np.float32), "act": jnp.tanh})
    b = _assemble.describe({"w": np.zeros((2, 4), np.float32)})
    assert a[0] != b[0]
    assert _assemble.difference(a[1], b[1]) == \
        "['w']: (2, 3) float32 here, (2, 4) float32 in the job"


def test_a_step_held_only_in_part_is_passed_over():
    summaries = [{"9": {"data": None, "boxes": {"0": [[[0, 4]]]}},
                  "8": {"data": None, "boxes": {"0": [[[0, 4]]]}}},
                 {"8": {"data": None, "boxes": {"0": [[[4, 8]]]}}}]
    step, why = _assemble.best_step(summaries, [(8,)])
    assert step == 8 and "step 9 is held only in part" in why
