"""Writing a snapshot's blocks into a slot file from several threads (``jaxdist.checkpoint._slots``).

One thread writes a GB to /dev/shm at about 1.2 GB/s (a memory copy into the page cache, page by
page); several threads writing disjoint byte ranges with ``os.pwrite`` (which releases the GIL)
scale with the cores (measured on an H100 host: 1.3 GB in 1.1 s from one thread, 0.115 s from
eight). Each range's checksum is summed in the thread that writes it, while its bytes are hot in
the cache; a block's checksum is put together from its ranges' sums (:func:`_range_sum`), the same
value :func:`jaxdist.checkpoint._slots.checksum` gives for the whole block, so the file format and
its readers do not change.
"""

from __future__ import annotations

import concurrent.futures
import os
import time

import numpy as np

_CHUNK_BYTES = 8 << 20  # the checksum's chunk: 8 MiB (``_slots._CHUNK_WORDS`` words)
_RANGE_CHUNKS = 4  # a thread's unit of work: 32 MiB, whole checksum chunks
_MASK = (1 << 64) - 1


def _range_sum(raw: np.ndarray, lo: int, hi: int) -> int:
    """The part of ``_slots.checksum`` of the bytes ``raw`` that comes from ``raw[lo:hi]``
    (``lo`` a multiple of the chunk; ``hi`` one too, or the end): the parts of a block's ranges
    add up (modulo 2**64) to its checksum, less the size term."""
    n = raw.size // 8 * 8
    total = 0
    with np.errstate(over="ignore"):
        for start in range(lo, min(hi, n), _CHUNK_BYTES):
            stop = min(start + _CHUNK_BYTES, n, hi)
            part = int(raw[start:stop].view(np.uint64).sum(dtype=np.uint64))
            total += part * (2 * (start // _CHUNK_BYTES) + 3)
        if hi >= raw.size and n < raw.size:  # the tail: bytes past the last whole word
            tail = raw[n:].astype(np.uint64)
            total += int((tail * (np.arange(tail.size, dtype=np.uint64) + np.uint64(7))).sum(
                dtype=np.uint64))
    return total & _MASK


def _write_range(fd: int, raw: np.ndarray, lo: int, hi: int, offset: int) -> tuple[int, float]:
    cpu0 = time.thread_time()
    view = memoryview(raw[lo:hi])  # type: ignore[arg-type]  # numpy's stubs: Buffer on 3.12+ only
    done = 0
    while done < hi - lo:
        done += os.pwrite(fd, view[done:], offset + lo + done)
    return _range_sum(raw, lo, hi), time.thread_time() - cpu0


def _write_blocks(fd: int, blocks: list[tuple[int, np.ndarray]], threads: int,
                  stats: dict | None) -> list[str]:
    """Writes each ``(file offset, contiguous block)``; returns each block's checksum.

    Raises:
      OSError: a write failed (a full directory, say).
    """
    units = []  # (block number, raw bytes, lo, hi, file offset of the block)
    raws = []
    for b, (offset, block) in enumerate(blocks):
        raw = block.reshape(-1).view(np.uint8)
        raws.append(raw)
        step = _CHUNK_BYTES * _RANGE_CHUNKS
        for lo in range(0, max(raw.size, 1), step):
            units.append((b, raw, lo, min(lo + step, raw.size), offset))
    sums = [0] * len(blocks)
    cpu = 0.0
    if threads <= 1 or len(units) <= 1:
        for b, raw, lo, hi, offset in units:  # on the caller's thread: its own CPU time
            part, _ = _write_range(fd, raw, lo, hi, offset)
            sums[b] = (sums[b] + part) & _MASK
    else:
        with concurrent.futures.ThreadPoolExecutor(min(threads, len(units)),
                                                   thread_name_prefix="jaxdist-slot-write") as pool:
            futures = [(b, pool.submit(_write_range, fd, raw, lo, hi, offset))
                       for b, raw, lo, hi, offset in units]
            for b, future in futures:
                part, spent = future.result()
                sums[b] = (sums[b] + part) & _MASK
                cpu += spent
    if stats is not None:
        stats["cpu_s"] = cpu
    return [f"{(s + raw.size) & _MASK:016x}" for s, raw in zip(sums, raws)]
