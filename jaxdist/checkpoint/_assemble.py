"""Resuming from the in-memory tier: every process agrees on a step and gets its part of the state.

Collective: every process of the job calls :func:`resume` at the same point. In order:

1. *Same state?* Each process describes the state it is about to train (tree, shapes, dtypes); a
   process whose description differs from the job's (the one the processes holding snapshots
   agree on) is refused with the difference named (:class:`StateMismatchError`), and the others
   are told to re-form without it (:class:`RejoinRequired`), before any collective that depends on
   the state's shapes could mismatch.
2. *Which step?* Each process lists the snapshots it can read on its host (any rank's slots:
   a restarted process finds its predecessor's), as the blocks of each leaf they hold; the newest
   step whose blocks, over all processes, cover every leaf is taken. A step held only in part
   (a lost host held the only copy of some shards) is passed over, and the log says so.
3. *Each process's part.* When every process can fill its own devices' shards of the state from
   its own host (a restart in place, replicated or sharded state alike), it reads them there.
   Otherwise (a host lost or joined, another process count) each leaf is assembled by one
   collective: every process contributes the blocks it holds, zeros elsewhere, and a bitwise max
   over processes gives every device the leaf, which is then placed the target's way (re-sharded
   for a new layout). Every block is checked against its checksum *before* any collective; a
   damaged one is excluded and the agreement runs again, so a damaged snapshot falls back to the
   newest intact one.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxdist.checkpoint import _slots

logger = logging.getLogger("jaxdist.checkpoint.memstate")


class StateMismatchError(RuntimeError):
    """This process's state differs from the job's (another model, shapes or dtypes).

    Every process of the job learns it at once: the others end cleanly (``RejoinRequired``), and
    their ``jax.distributed.shutdown`` waits for this process's, which a process ending on this
    error therefore still calls (``peers_leave_too``: see ``jaxdist.launch.runtime``)."""

    peers_leave_too = True


class RejoinRequired(SystemExit):
    """Another process's state differs from the job's: this one ends cleanly (exit status 0) so
    that the job re-forms without it."""


def dtype_name(x: Any) -> str:
    dtype = x.dtype if hasattr(x, "dtype") else jax.dtypes.canonicalize_dtype(np.result_type(x))
    return np.dtype(dtype).name


def describe(tree: Any) -> tuple[str, list]:
    """The state's fingerprint and its description: ``[[path, shape, dtype], ...]`` for each
    array leaf (static leaves, such as a train state's ``apply_fn``, are left out: their reprs
    differ between processes).

    >>> import numpy as np
    >>> describe({"w": np.zeros((2, 3), np.float32)})[1]
    [["['w']", [2, 3], 'float32']]
    """
    from jaxdist.core.values import is_static_leaf

    desc = [[jax.tree_util.keystr(path), list(np.shape(x)), dtype_name(x)]
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0] if not is_static_leaf(x)]
    return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16], desc


def difference(mine: list, theirs: list) -> str:
    """The first ways two state descriptions differ, in words."""
    if len(mine) != len(theirs):
        return f"{len(mine)} arrays here, {len(theirs)} in the job's state"
    diffs = [f"{a[0]}: {tuple(a[1])} {a[2]} here, {tuple(b[1])} {b[2]} in the job"
             if a[0] == b[0] else f"{a[0]} here where the job has {b[0]}"
             for a, b in zip(mine, theirs) if a != b]
    return "; ".join(diffs[:4]) + (f" (and {len(diffs) - 4} more)" if len(diffs) > 4 else "")


def allgather_json(value: Any) -> list[Any]:
    """``value`` from every process (JSON-serialisable), in process order; one process: ``[value]``."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int64(data.size))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    return [json.loads(rows[i, :int(n)].tobytes()) for i, n in enumerate(sizes)]


def check_same_state(directory: str, target: Any) -> None:
    """Step 1: raises in the process whose state differs, and in the others (to re-form).

    Call it before anything that depends on the state's shapes runs across processes (placing
    the state the strategy's way is such a collective)."""
    if jax.process_count() == 1:
        return
    fingerprint, desc = describe(target)
    holds = any(h.get("fingerprint") == fingerprint for _, _, h in _slots.slots(directory))
    everyone = allgather_json({"fp": fingerprint, "desc": desc, "holds": holds})
    if len({e["fp"] for e in everyone}) == 1:
        return
    # The job's state is the one the holders of snapshots have; among equals, the most common.
    pool = [e for e in everyone if e["holds"]] or everyone
    counts: dict[str, int] = {}
    for e in pool:
        counts[e["fp"]] = counts.get(e["fp"], 0) + 1
    job_fp = max(counts, key=lambda fp: (counts[fp], -[e["fp"] for e in pool].index(fp)))
    job_desc = next(e["desc"] for e in pool if e["fp"] == job_fp)
    odd = [i for i, e in enumerate(everyone) if e["fp"] != job_fp]
    if fingerprint != job_fp:
        raise StateMismatchError(
            f"this process's train state differs from the job's ({difference(desc, job_desc)}): "
            "it is refused; start it with the job's model and settings")
    logger.warning("process(es) %s train a state that differs from the job's; the job re-forms "
                   "without them", odd)
    raise RejoinRequired(0)


def _summary(held: list[tuple[str, int, dict]]) -> dict[str, Any]:
    """What this process can read, per step: the input position and each leaf's blocks."""
    out: dict[str, Any] = {}
    for _, _, header in held:
        if header["leaves"] and not any(leaf["pieces"] for leaf in header["leaves"]):
            continue  # a process that writes no blocks (another on its host writes them)
        step = str(header["step"])
        entry = out.setdefault(step, {"data": header.get("data"), "boxes": {}})
        for i, leaf in enumerate(header["leaves"]):
            entry["boxes"].setdefault(str(i), []).extend(p["index"] for p in leaf["pieces"])
    return out


def best_step(summaries: list[dict], shapes: list[tuple]) -> tuple[int | None, str]:
    """The newest step whose blocks over all processes cover every leaf, and why newer ones
    were passed over (empty when none were)."""
    steps = sorted({int(s) for summ in summaries for s in summ}, reverse=True)
    passed: list[str] = []
    for step in steps:
        missing = []
        for i, shape in enumerate(shapes):
            boxes = [tuple(tuple(b) for b in box) for summ in summaries
                     for box in summ.get(str(step), {}).get("boxes", {}).get(str(i), [])]
            if not _slots.covers(shape, boxes):
                missing.append(i)
        if not missing:
            return step, "; ".join(passed)
        passed.append(f"step {step} is held only in part (blocks of {len(missing)} of "
                      f"{len(shapes)} arrays are on no live process, e.g. array {missing[0]})")
    return None, "; ".join(passed)


def _held_at(held: list[tuple[str, int, dict]], step: int) -> list[tuple[str, int, dict]]:
    return [h for h in held if int(h[2]["step"]) == step]


def _find(held_s: list, leaf: int, box: tuple) -> tuple[str, int, dict, _slots.Piece] | None:
    for rank_dir, slot, header in held_s:
        for piece in _slots.pieces(header, leaf):
            if _slots.contains(piece.index, box):
                return rank_dir, slot, header, piece
    return None


def _box(index: tuple, shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """A device's slice tuple as ``((start, stop), ...)``."""
    return tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape))


def _cut(block: np.ndarray, outer: tuple, inner: tuple) -> np.ndarray:
    return block[tuple(slice(c - a, d - a) for (a, _), (c, d) in zip(outer, inner))]


class _Reader:
    """Reads pieces once each, checking their checksums."""

    def __init__(self):
        self._cache: dict[tuple, np.ndarray] = {}

    def get(self, rank_dir: str, slot: int, header: dict, leaf: int,
            piece: _slots.Piece) -> np.ndarray:
        key = (rank_dir, slot, leaf, piece.offset)
        if key not in self._cache:
            self._cache[key] = _slots.read_piece(rank_dir, slot, header, leaf, piece)
        return self._cache[key]


def _local_plan(held_s: list, targets: list, shapes: list) -> list | None:
    """For each leaf, where each of this process's devices finds its block on this host
    (``[(device, box, source), ...]``, or a whole-leaf source for a host value); None when some
    block is not here."""
    plan = []
    for i, (t, shape) in enumerate(zip(targets, shapes)):
        if isinstance(t, jax.Array):
            entries = []
            for device, index in t.sharding.addressable_devices_indices_map(shape).items():
                box = _box(index, shape)
                src = _find(held_s, i, box)
                if src is None:
                    return None
                entries.append((device, box, src))
            plan.append(entries)
        else:
            box = tuple((0, n) for n in shape)
            src = _find(held_s, i, box)
            if src is None:
                return None
            plan.append([(None, box, src)])
    return plan


def _read_local(plan: list, reader: _Reader) -> list:
    """Every block the local plan names, read and checked (no collective yet)."""
    out = []
    for leaf, entries in enumerate(plan):
        blocks = []
        for device, box, (rank_dir, slot, header, piece) in entries:
            block = reader.get(rank_dir, slot, header, leaf, piece)
            blocks.append((device, box, _cut(block, piece.index, box)))
        out.append(blocks)
    return out


def _place_local(blocks: list, targets: list, shapes: list) -> list:
    leaves = []
    for entries, t, shape in zip(blocks, targets, shapes):
        if isinstance(t, jax.Array):
            arrays = [jax.device_put(block, device) for device, _, block in entries]
            leaves.append(jax.make_array_from_single_device_arrays(shape, t.sharding, arrays))
        else:
            leaves.append(entries[0][2].reshape(shape))
    return leaves


def _contributions(held_s: list, shapes: list, dtypes: list, reader: _Reader) -> list:
    """Each leaf as this process can fill it from its host (zeros where it holds nothing)."""
    out = []
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        full = np.zeros(shape, _slots.dtype_of(dtype))
        for rank_dir, slot, header in held_s:
            for piece in _slots.pieces(header, i):
                block = reader.get(rank_dir, slot, header, i, piece)
                full[tuple(slice(a, b) for a, b in piece.index)] = block
        out.append(full)
    return out


def _as_bytes(x: np.ndarray) -> np.ndarray:
    """``x`` viewed as unsigned bytes, one trailing axis of the item size (none for 1 byte)."""
    raw = np.ascontiguousarray(x).view(np.uint8)
    if x.dtype.itemsize == 1:
        return raw.reshape(x.shape)
    return raw.reshape(x.shape + (x.dtype.itemsize,))


def _assemble(contributions: list, targets: list, dtypes: list) -> list:
    """One collective per leaf: the bitwise max over processes of what each holds."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("processes",))
    spread, whole = NamedSharding(mesh, PartitionSpec("processes")), NamedSharding(mesh,
                                                                                  PartitionSpec())
    local = jax.local_devices()
    out = []
    for full, t, dtype in zip(contributions, targets, dtypes):
        raw = _as_bytes(full)
        zeros = np.zeros_like(raw)
        rows = [jax.device_put((raw if k == 0 else zeros)[None], d) for k, d in enumerate(local)]
        stacked = jax.make_array_from_single_device_arrays((len(devices),) + raw.shape, spread,
                                                           rows)
        target_dtype = np.dtype(_slots.dtype_of(dtype))

        def merge(x, target_dtype=target_dtype):
            merged = jax.numpy.max(x, axis=0)
            if target_dtype == np.bool_:
                return merged != 0
            if target_dtype.itemsize == 1:
                return jax.lax.bitcast_convert_type(merged, target_dtype)
            return jax.lax.bitcast_convert_type(merged, target_dtype)

        value = jax.jit(merge, out_shardings=whole)(stacked)
        if isinstance(t, jax.Array):
            out.append(jax.device_put(value, t.sharding))
        else:
            out.append(np.asarray(value.addressable_data(0)))
    return out


def resume(directory: str, target: Any, target_leaves: list) -> tuple[int, list, dict | None,
                                                                    str] | None:
    """Steps 1-3 above: ``(step, leaves placed like the targets, input position, how)`` or None.

    Raises:
      StateMismatchError: this process's state differs from the job's.
      RejoinRequired: another process's does; the job re-forms without it.
    """
    fingerprint, desc = describe(target)
    shapes = [tuple(np.shape(t)) for t in target_leaves]
    dtypes = [dtype_name(t) for t in target_leaves]
    bad: set[tuple[str, int]] = set()
    for _attempt in range(3):
        held = [(d, s, h) for d, s, h in _slots.slots(directory)
                if h.get("fingerprint") == fingerprint and (d, s) not in bad]
        summaries = allgather_json(_summary(held))
        step, passed = best_step(summaries, shapes)
        if passed:
            logger.warning("in-memory tier: %s", passed)
        if step is None:
            return None
        data = next(s[str(step)]["data"] for s in summaries if str(step) in s)
        held_s = _held_at(held, step)
        plan = _local_plan(held_s, target_leaves, shapes)
        local_everywhere = all(allgather_json(plan is not None))
        reader = _Reader()
        try:
            if local_everywhere:
                blocks = _read_local(plan, reader)
            else:
                blocks = _contributions(held_s, shapes, dtypes, reader)
            ok = True
        except _slots.Damaged as e:
            logger.warning("in-memory tier: %s; not using that snapshot", e)
            bad |= {(d, s) for d, s, _ in held_s}
            ok = False
        if not all(allgather_json(ok)):
            continue  # every process drops what it found damaged and agrees again
        if local_everywhere:
            how = "its own host"
            leaves = _place_local(blocks, target_leaves, shapes)
        else:
            how = "the job's processes, over the network"
            leaves = _assemble(blocks, target_leaves, dtypes)
        return step, leaves, data, how
    logger.warning("in-memory tier: no intact snapshot after %d tries; using the persistent "
                   "backup", 3)
    return None
