"""The in-memory tier's copies that overlap the step (an on-device snapshot, host-copied, released
once landed; a direct copy when the device lacks room, or once a training step ran out of device
memory beside a snapshot) and its writes from several threads."""

from __future__ import annotations

import importlib
import logging
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist
from jaxdist import models
from jaxdist.checkpoint import InMemoryTier, _copies, _overlap, _pwrite, _slots, memstate


def _state(k):
    return {"w": jnp.arange(256, dtype=jnp.float32).reshape(16, 16) + k,
            "b": jnp.full((7,), float(k), jnp.bfloat16), "n": jnp.int32(k)}


_donating = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)


def _as_accelerator(monkeypatch):
    """Makes the tier treat XLA:CPU's devices as an accelerator's (CPU has pinned_host too)."""
    monkeypatch.setattr(_overlap, "_is_host_device", lambda blocks: False)


def test_snapshots_are_copied_to_host_released_once_landed_and_survive_donation(
        tmp_path, monkeypatch):
    # before: no snapshot: on an accelerator the host copy read the buffers the next step donates
    _as_accelerator(monkeypatch)
    taken = []
    real = _copies._snapshot_to_host

    def spy(blocks):
        host, snap = real(blocks)
        taken.append(snap)
        return host, snap

    monkeypatch.setattr(_overlap, "_snapshot_to_host", spy)
    tier = InMemoryTier(str(tmp_path), rank=0, every=1)
    state = _state(0)
    held_most = 0
    for k in range(1, 9):
        state = _donating(state)  # deletes the buffers of the state saved last step
        tier.save(k, state, {"epoch": 0, "position": k})
        with tier._cond:
            held_most = max(held_most, sum(c.held is not None for c, _ in tier._copies))
    tier.flush()
    assert tier._overlap.snapshots
    assert len(taken) >= 2  # the warm-up's and the copies'
    assert held_most <= 1  # one device snapshot at a time
    with tier._cond:
        assert tier._ready.held is None and not tier._copies  # released once landed
    tier.close()
    snap = InMemoryTier(str(tmp_path), rank=0).resume(_state(0))
    assert snap.step == 8
    for a, b in zip(jax.tree.leaves(snap.state), jax.tree.leaves(_state(8))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_pool_warm_up_is_not_counted_as_a_copy(tmp_path, monkeypatch):
    _as_accelerator(monkeypatch)
    warmed = []
    monkeypatch.setattr(_overlap, "_warm_pinned_pool",
                        lambda blocks, copies: warmed.append(copies))
    tier = InMemoryTier(str(tmp_path), rank=0, every=1)
    tier.save(1, _state(1))
    assert warmed == [1]  # beside the snapshot's own warm-up copy: two copies' room
    assert len(tier._cadence._loops) == 1  # only the real copy's dispatch was timed
    tier.close()


def test_a_device_without_room_for_a_snapshot_copies_directly_said_in_one_line(
        tmp_path, monkeypatch, caplog):
    _as_accelerator(monkeypatch)
    monkeypatch.setattr(_overlap, "_device_room", lambda blocks: (False, "no room (test)"))
    tier = InMemoryTier(str(tmp_path), rank=0, every=1)
    with caplog.at_level(logging.WARNING):
        for k in range(1, 5):
            assert tier.save(k, _state(k))
            tier.flush()
    said = [r.getMessage() for r in caplog.records if "not through a device snapshot" in r.message]
    assert len(said) == 1 and "no room (test)" in said[0], said
    assert not tier._overlap.snapshots
    tier.close()
    assert InMemoryTier(str(tmp_path), rank=0).resume(_state(0)).step == 4


def test_a_peak_that_grows_past_the_room_turns_snapshots_off_in_one_line(
        tmp_path, monkeypatch, caplog):
    # before: the room was checked once, at the first save, possibly before step 1's memory
    _as_accelerator(monkeypatch)
    peak, room = [100], [True]
    monkeypatch.setattr(_overlap, "_peak", lambda blocks: peak[0])
    monkeypatch.setattr(_overlap, "_device_room",
                        lambda blocks: (room[0], "" if room[0] else "no room beside 900 (test)"))
    tier = InMemoryTier(str(tmp_path), rank=0, every=1)
    with caplog.at_level(logging.WARNING):
        for k in range(1, 7):
            if k == 4:  # an evaluation, a longer batch: the step's peak grows past the room
                peak[0], room[0] = 900, False
            assert tier.save(k, _state(k))
            tier.flush()
            assert tier._overlap.snapshots == (k < 4), k
    said = [r.getMessage() for r in caplog.records if "directly" in r.message]
    assert len(said) == 1 and "no room beside 900 (test)" in said[0], said
    tier.close()
    assert InMemoryTier(str(tmp_path), rank=0).resume(_state(0)).step == 6


@pytest.mark.parametrize("when", ["start", "copy"])
def test_pinned_memory_exhausted_turns_the_tier_off_never_copying_to_the_device(
        tmp_path, monkeypatch, caplog, when):
    # before: a pinned pool at XLA's cap read as "no room for a snapshot", and copies went to
    # device memory (lost with the process)
    _as_accelerator(monkeypatch)
    full = [when == "start"]
    put = jax.device_put

    def device_put(x, where=None, **kw):
        if full[0] and isinstance(where, list) and any(
                getattr(w, "memory_kind", None) == "pinned_host" for w in where):
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: pinned host allocator (test)")
        return put(x, where, **kw)

    monkeypatch.setattr(jax, "device_put", device_put)
    tier = InMemoryTier(str(tmp_path), rank=0, every=1)
    with caplog.at_level(logging.WARNING):
        assert tier.save(1, _state(1)) == (when == "copy")
        full[0] = True
        assert not tier.save(2, _state(2))  # not a copy into device memory instead
    assert not tier.enabled
    said = [r.getMessage() for r in caplog.records if "tier is off" in r.message]
    assert len(said) == 1 and "pinned host memory is exhausted" in said[0], said
    tier.close()


def test_device_room_reads_the_allocators_limit_less_its_peak():
    class Dev:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats

        def __repr__(self):
            return "gpu:0"

    def block(dev, nbytes):
        return types.SimpleNamespace(sharding=types.SimpleNamespace(device_set={dev}),
                                     nbytes=nbytes)

    gb = 1 << 30
    roomy = Dev({"bytes_limit": 10 * gb, "peak_bytes_in_use": 5 * gb, "bytes_in_use": 2 * gb})
    tight = Dev({"bytes_limit": 10 * gb, "peak_bytes_in_use": 9 * gb, "bytes_in_use": 2 * gb})
    assert _copies._device_room([block(roomy, 2 * gb), block(roomy, 2 * gb)]) == (True, "")
    ok, why = _copies._device_room([block(tight, gb)])
    assert not ok and "gpu:0" in why and "1074 MB" in why  # the peak counts, not what is in use
    assert _copies._device_room([block(Dev(None), 100 * gb)])[0]  # no statistics: room assumed


@pytest.mark.parametrize("threads", [1, 3])
def test_parallel_writes_give_the_same_file_and_checksums(tmp_path, monkeypatch, threads):
    # Small chunks, so that blocks span many ranges and chunk edges fall inside them.
    monkeypatch.setattr(_pwrite, "_CHUNK_BYTES", 64)
    monkeypatch.setattr(_slots, "_CHUNK_WORDS", 8)
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 255, n, dtype=np.uint8) for n in (0, 3, 64, 65, 1000, 4096 + 13)]
    leaves = [((b.size,), "uint8", [(((0, b.size),), b)]) for b in blocks]
    stats = {}
    total = _slots.write(str(tmp_path), 0, step=1, data_state=None, fingerprint="f",
                         leaves=leaves, threads=threads, stats=stats)
    assert total == sum(b.size for b in blocks)
    header = _slots.read_header(str(tmp_path), 0)
    for i, b in enumerate(blocks):
        (piece,) = _slots.pieces(header, i)
        assert piece.checksum == _slots.checksum(b)
        np.testing.assert_array_equal(_slots.read_piece(str(tmp_path), 0, header, i, piece), b)
    assert stats["cpu_s"] >= 0


def test_the_tier_writes_with_several_threads_beside_accelerators_only():
    assert memstate._write_threads(host_is_device=True) == 1
    assert memstate._write_threads(host_is_device=False) >= 1


class _LateSnapshot:
    """A device snapshot that is done ``after_s`` after the writer first waits for it (its step
    is still running)."""

    def __init__(self, after_s):
        self.after_s, self.done = after_s, False

    def is_ready(self):
        return self.done

    def block_until_ready(self):
        import time

        time.sleep(self.after_s)
        self.done = True
        return self


def test_the_writer_times_a_copys_landing_from_its_snapshot(tmp_path, monkeypatch):
    # before: a copy's landing was never measured, only estimated from the write speed
    _as_accelerator(monkeypatch)
    real = _copies._snapshot_to_host
    late = []

    def waits(blocks):
        host, snap = real(blocks)
        jax.block_until_ready(host)  # the host copy lands as soon as the snapshot is done
        late.append(_LateSnapshot(0.05))
        return host, [*snap, late[-1]]

    monkeypatch.setattr(_overlap, "_snapshot_to_host", waits)
    tier = InMemoryTier(str(tmp_path), rank=0, every=1)
    landed = []
    monkeypatch.setattr(tier, "_first_save", _spy_landings(tier, tier._first_save, landed))
    for k in range(1, 4):
        tier.save(k, _state(k))
        tier.flush()
    tier.close()
    # one per copy, the writer having waited for its snapshot (the warm-up copy at the start: not)
    assert len(landed) == sum(s.done for s in late) == 3
    assert all(0 <= s < 0.05 for s in landed)  # timed from the snapshot, not from the copy's start


def _spy_landings(tier, first_save, landed):
    def first(state):
        ok = first_save(state)
        tier._cadence.on_landed = landed.append
        return ok
    return first


# --- a training step out of device memory beside a held snapshot ------------------------------


class _Gate:
    """Part of a device snapshot that the writer waits on until ``opened``: the tier holds that
    snapshot until then, so that a step runs beside it whatever the threads' timing."""

    def __init__(self, opened):
        self.opened = opened

    def is_ready(self):
        return self.opened.is_set()

    def block_until_ready(self):
        self.opened.wait(timeout=60)
        return self


class _OpensOnClose(jaxdist.callbacks.Callback):
    """Opens the gate when ``fit`` ends, before the tier's own ``close`` waits for its copies."""

    def __init__(self, opened):
        self.opened = opened

    def close(self):
        self.opened.set()


class _OutOfMemoryOnce:
    """``fit``'s compiled step, raising what XLA raises for a device out of memory at the first
    call at which ``when()`` holds (after deleting the state, as a donation that consumed it
    would, with ``consume``); calls after that one open ``opened``."""

    def __init__(self, step, when, opened, consume=False):
        self.step, self.when, self.opened, self.consume = step, when, opened, consume
        self.calls, self.failed, self.raised = 0, None, None

    def __call__(self, state, batch):
        self.calls += 1
        if self.failed is not None:
            self.opened.set()  # the snapshot was dropped by now: the writer may go on
        elif self.when():
            self.failed = self.calls
            if self.consume:
                for x in jax.tree.leaves(state):
                    x.delete()
            self.raised = jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB (test)")
            raise self.raised
        return self.step(state, batch)

    def __getattr__(self, name):
        return getattr(self.step, name)


def _held(tier):
    with tier._cond:
        return any(c.held is not None for c, _ in tier._copies)


def _fit_beside_the_tier(tmp_path, monkeypatch, digits, when=None, consume=False, gate=True):
    """``fit`` of 8 steps with the tier's snapshots on (``every=1``), its step failing once as
    ``_OutOfMemoryOnce`` says (``when(tier)``; None: never); the writer waits for each device
    snapshot until the step after the failure (``gate``). Returns ``(history or the error,
    the step, the tier, how many snapshots were taken after the warm-up's)``."""
    from jaxdist.launch import heartbeat

    _as_accelerator(monkeypatch)
    monkeypatch.setattr(heartbeat, "_current", None)  # this test's heartbeat, not the process's
    monkeypatch.setenv(memstate.ENV_STATE_DIR, str(tmp_path / "state"))
    opened, taken = threading.Event(), []
    real = _copies._snapshot_to_host

    def gated(blocks):
        host, snap = real(blocks)
        taken.append(blocks)
        return host, [*snap, _Gate(opened)] if gate else snap

    monkeypatch.setattr(_overlap, "_snapshot_to_host", gated)
    backup = jaxdist.callbacks.BackupAndRestore(
        str(tmp_path / "backup"), memory_tier=jaxdist.checkpoint.MemoryTierPolicy(every=1),
        delete_checkpoint=False)
    tier = backup.memory
    fit_module = importlib.import_module("jaxdist.training.fit")
    made = []

    def as_step(*args, **kw):
        made.append(_OutOfMemoryOnce(real_as_step(*args, **kw),
                                     (lambda: when(tier)) if when else (lambda: False), opened,
                                     consume))
        return made[-1]

    real_as_step = fit_module._as_step
    monkeypatch.setattr(fit_module, "_as_step", as_step)
    try:
        out = _fit_digits(digits, callbacks=[_OpensOnClose(opened), backup])
    except jax.errors.JaxRuntimeError as e:
        out = e
    return out, made[0], tier, len(taken) - 1


def _fit_digits(digits, callbacks=()):
    (x, y), _ = digits
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    state = models.create_train_state(models.MLP(hidden=(16,)), x[:1], seed=1)
    return jaxdist.fit(s.step(models.classifier_train_step), state,
                       s.distribute((x[:256], y[:256]), 32), epochs=1, verbose=0,
                       callbacks=list(callbacks))


def test_a_step_out_of_memory_beside_a_snapshot_drops_it_and_runs_again(
        tmp_path, monkeypatch, caplog, digits):
    # before: the step's RESOURCE_EXHAUSTED ended fit (the JaxRuntimeError came out of it at
    # step 2), the tier still holding its snapshot and copying through snapshots
    with caplog.at_level(logging.WARNING):
        out, step, tier, taken = _fit_beside_the_tier(tmp_path, monkeypatch, digits, _held)
    assert not isinstance(out, Exception), out
    assert step.failed == 2 and step.calls == 9  # failed beside step 1's snapshot, ran again once
    clean = _fit_digits(digits)
    assert out.history == clean.history
    for a, b in zip(jax.tree.leaves(out.state), jax.tree.leaves(clean.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    said = [r.getMessage() for r in caplog.records if "directly" in r.getMessage()]
    assert len(said) == 1, said
    assert "ran out of device memory beside the tier's device snapshot" in said[0]
    assert "copy (step 1) abandoned" in said[0] and "smaller batch" in said[0], said
    assert taken == 1  # step 1's; the copies after the failure read the state itself
    assert not tier._overlap.snapshots and not tier.holds_snapshot
    assert tier.last_written == 8  # the tier went on copying, directly


def test_a_step_out_of_memory_without_a_held_snapshot_is_raised_unchanged(
        tmp_path, monkeypatch, caplog, digits):
    # before: raised too (nothing was ever retried); this holds the retry to a held snapshot,
    # and drop_snapshot with none held changes nothing (main had neither it nor holds_snapshot)
    def landed(tier):  # step 1's copy has landed and its snapshot is released: none held
        if tier._cadence is None:
            return False  # step 1: nothing copied yet
        with tier._cond:
            return tier._cond.wait_for(lambda: tier._ready is not None and not _held(tier),
                                       timeout=60)

    with caplog.at_level(logging.WARNING):
        out, step, tier, _ = _fit_beside_the_tier(tmp_path, monkeypatch, digits, landed,
                                                  gate=False)
        assert not tier.holds_snapshot and tier.drop_snapshot("test") is False
    assert out is step.raised and not getattr(out, "__notes__", None)
    assert step.failed == 2 and step.calls == 2  # not run again
    assert tier._overlap.snapshots  # nothing dropped
    assert not [r for r in caplog.records if "directly" in r.getMessage()]


def test_a_step_out_of_memory_whose_inputs_were_donated_is_raised_with_a_note(
        tmp_path, monkeypatch, caplog, digits):
    # before: raised without the note, the tier still holding its snapshot
    with caplog.at_level(logging.WARNING):
        out, step, tier, _ = _fit_beside_the_tier(tmp_path, monkeypatch, digits, _held,
                                                  consume=True)
    assert out is step.raised
    assert step.failed == 2 and step.calls == 2  # not run again: its inputs are gone
    (note,) = out.__notes__
    assert "dropped the device snapshot" in note and "donated" in note and "\n" not in note
    assert not tier._overlap.snapshots
    said = [r.getMessage() for r in caplog.records if "directly" in r.getMessage()]
    assert len(said) == 1, said
