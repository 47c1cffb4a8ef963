"""The in-memory tier's files: two slots per process, each a data file and a header.

``<dir>/<rank>/slot-<i>.bin`` holds the pieces of one snapshot back to back (raw bytes: nothing is
ever unpickled); ``slot-<i>.json`` says what they are (step, input position, for each leaf its
global shape, dtype and the pieces this process wrote: where each lies in the global array, at
which offset, and a checksum). A slot is valid only while its header exists: the header is removed
before the data is overwritten and written (atomically) after, so a reader never takes half a
snapshot, and a killed writer leaves the other slot as the newest valid one. Checksums catch
damaged or truncated data when a piece is read back.

The files' names and that validity rule are the state directory's contract, which the launcher
reads too (whether a failed job left a snapshot to keep): they live in ``jaxdist.launch.statedir``
and are re-exported here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxdist.checkpoint._pwrite import _write_blocks
from jaxdist.launch.heartbeat import write_atomic
from jaxdist.launch.statedir import FORMAT as FORMAT
from jaxdist.launch.statedir import SLOTS as SLOTS
from jaxdist.launch.statedir import data_path as data_path
from jaxdist.launch.statedir import header_path as header_path
from jaxdist.launch.statedir import read_header as read_header
from jaxdist.launch.statedir import slots as slots

_CHUNK_WORDS = 1 << 20  # 8 MiB a chunk when summing


class TierFull(OSError):
    """The tier's directory has no room for a snapshot."""


class Damaged(ValueError):
    """A piece read back does not match its checksum or its size."""


class Piece(NamedTuple):
    """One contiguous block of a leaf as written: where it lies in the global array and in the file.

    Attributes:
      index: ``((start, stop), ...)`` per dimension of the leaf.
      offset, nbytes: its place in the slot's data file.
      checksum: of its bytes (:func:`checksum`).
    """

    index: tuple[tuple[int, int], ...]  # type: ignore[assignment]  # (shadows tuple.index)
    offset: int
    nbytes: int
    checksum: str


def checksum(data: np.ndarray) -> str:
    """A 64-bit checksum of an array's bytes, position-weighted by 8 MiB chunk.

    It catches damage (flipped bytes, truncation, stale data), not an attacker: the tier's files
    are the job's own, in the host's memory. Computed with numpy at memory speed.

    >>> a = np.arange(10, dtype=np.float32)
    >>> b = a.copy(); b.view(np.uint8)[5] ^= 1
    >>> checksum(a) == checksum(a.copy()), checksum(a) == checksum(b)
    (True, False)
    """
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    n = raw.size // 8 * 8
    words = raw[:n].view(np.uint64)
    total = np.uint64(raw.size)
    with np.errstate(over="ignore"):
        for i in range(0, words.size, _CHUNK_WORDS):
            part = words[i:i + _CHUNK_WORDS].sum(dtype=np.uint64)
            total += part * np.uint64(2 * (i // _CHUNK_WORDS) + 3)
        tail = raw[n:].astype(np.uint64)
        total += (tail * (np.arange(tail.size, dtype=np.uint64) + np.uint64(7))).sum(
            dtype=np.uint64)
    return f"{int(total):016x}"


def free_slot(rank_dir: str) -> int:
    """The slot to overwrite next: an invalid one, else the one holding the older step."""
    steps = []
    for slot in range(SLOTS):
        header = read_header(rank_dir, slot)
        if header is None:
            return slot
        steps.append((int(header["step"]), slot))
    return min(steps)[1]


def write(rank_dir: str, slot: int, *, step: int, data_state: dict | None, fingerprint: str,
          leaves: Sequence[tuple[tuple[int, ...], str, list[tuple[tuple, np.ndarray]]]],
          extra: dict | None = None, threads: int = 1, stats: dict | None = None) -> int:
    """Writes one snapshot into ``slot``; returns the bytes written.

    Args:
      leaves: for each leaf of the state, ``(global shape, dtype name, [(index, block), ...])``
        with the blocks this process writes (possibly none).
      threads: threads that write (``os.pwrite`` of disjoint byte ranges) and sum the bytes
        (measured with 1.3 GB into /dev/shm on an H100 host: one thread 1.1 s, eight 0.115 s).
      stats: filled with ``cpu_s``, the CPU time the writing threads other than the caller's
        took together.

    Raises:
      TierFull: the directory has no room (the slot is left invalid, the other one untouched).
    """
    os.makedirs(rank_dir, exist_ok=True)
    try:
        os.remove(header_path(rank_dir, slot))  # invalid from here until the new header lands
    except FileNotFoundError:
        pass
    total = sum(block.nbytes for _, _, blocks in leaves for _, block in blocks)
    path = data_path(rank_dir, slot)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    meta, offset = [], 0
    try:
        try:
            if os.fstat(fd).st_size > total:
                os.ftruncate(fd, total)
            if total and hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, total)  # room first: a full tmpfs says so here
        except OSError as e:
            raise TierFull(e.errno, f"no room for a {total / 1e6:.1f} MB snapshot in {rank_dir}: "
                                    f"{e.strerror}") from None
        placed: list[tuple[dict[str, Any], np.ndarray]] = []  # (meta piece, block) in file order
        for shape, dtype, blocks in leaves:
            pieces = []
            for index, block in blocks:
                block = np.ascontiguousarray(block)
                pieces.append({"index": [list(i) for i in index], "offset": offset,
                               "nbytes": block.nbytes})
                placed.append((pieces[-1], block))
                offset += block.nbytes
            meta.append({"shape": list(shape), "dtype": dtype, "pieces": pieces})
        try:
            sums = _write_blocks(fd, [(p["offset"], b) for p, b in placed], threads, stats)
        except OSError as e:
            raise TierFull(e.errno, f"writing a snapshot to {rank_dir}: {e.strerror}") from None
        for (piece, _), total_sum in zip(placed, sums):
            piece["checksum"] = total_sum
    finally:
        os.close(fd)
    header = {"format": FORMAT, "step": int(step), "data": data_state, "bytes": total,
              "fingerprint": fingerprint, "leaves": meta, **(extra or {})}
    try:
        write_atomic(header_path(rank_dir, slot), json.dumps(header).encode())
    except OSError as e:
        raise TierFull(e.errno, f"writing a snapshot header to {rank_dir}: {e.strerror}") from None
    return total


def pieces(header: dict, leaf: int) -> list[Piece]:
    """The pieces of leaf number ``leaf`` in a slot's header."""
    return [Piece(tuple(tuple(i) for i in p["index"]), int(p["offset"]), int(p["nbytes"]),
                  str(p["checksum"])) for p in header["leaves"][leaf]["pieces"]]


def read_piece(rank_dir: str, slot: int, header: dict, leaf: int, piece: Piece) -> np.ndarray:
    """One piece's block, checked against its checksum.

    Raises:
      Damaged: its bytes are not the ones written.
    """
    dtype = np.dtype(dtype_of(header["leaves"][leaf]["dtype"]))
    shape = tuple(b - a for a, b in piece.index)
    count = int(np.prod(shape, dtype=np.int64))
    if count * dtype.itemsize != piece.nbytes:
        raise Damaged(f"a piece of leaf {leaf} in {data_path(rank_dir, slot)} has the wrong size")
    try:
        block = np.fromfile(data_path(rank_dir, slot), dtype=dtype, count=count,
                            offset=piece.offset)
    except (OSError, ValueError) as e:
        raise Damaged(f"{data_path(rank_dir, slot)} unreadable: {e}") from None
    if block.size != count or checksum(block) != piece.checksum:
        raise Damaged(f"{data_path(rank_dir, slot)} is damaged (leaf {leaf}: checksum or size "
                      "differs from its header)")
    return block.reshape(shape)


def dtype_of(name: str) -> Any:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # bfloat16 and friends, as JAX names them

        return np.dtype(getattr(ml_dtypes, name))


def covers(shape: Sequence[int], boxes: Sequence[tuple[tuple[int, int], ...]]) -> bool:
    """Whether ``boxes`` (each ``((start, stop), ...)``) together cover an array of ``shape``.

    >>> covers((4, 2), [((0, 2), (0, 2)), ((2, 4), (0, 2))]), covers((4,), [((0, 3),)])
    (True, False)
    """
    if not shape:
        return bool(boxes)
    cuts = [sorted({0, n, *(b[d][0] for b in boxes), *(b[d][1] for b in boxes)})
            for d, n in enumerate(shape)]
    cells = [[(c[i], c[i + 1]) for i in range(len(c) - 1) if c[i] < c[i + 1] <= n]
             for c, n in zip(cuts, shape)]
    import itertools

    for cell in itertools.product(*cells):
        if not any(all(b[d][0] <= lo and hi <= b[d][1] for d, (lo, hi) in enumerate(cell))
                   for b in boxes):
            return False
    return True


def contains(outer: tuple[tuple[int, int], ...], inner: tuple[tuple[int, int], ...]) -> bool:
    """Whether box ``inner`` lies inside box ``outer``."""
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner))
