"""How fast the in-memory tier persists a snapshot: ``jaxdist.checkpoint._slots.write`` of one state
into a slot file, with 1 and with N writing threads (runs interleaved, medians).

    python benchmarks/slot_write.py [--mb 600] [--threads 1 2 4 8] [--reps 5] [--dir /dev/shm]

The state: 150 float32 arrays (as a GPT's parameters and AdamW moments are many arrays), sizes
spread like a model's (a few large, many small), ``--mb`` MB in all.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxdist.checkpoint import _slots  # noqa: E402


def state(total_mb: int, arrays: int = 150) -> list:
    rng = np.random.default_rng(0)
    weights = rng.pareto(1.5, arrays) + 0.01
    sizes = (weights / weights.sum() * total_mb * 1e6 / 4).astype(int) + 1
    return [((int(n),), "float32", [(((0, int(n)),), rng.random(int(n), dtype=np.float32))])
            for n in sizes]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=600)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = ap.parse_args()
    leaves = state(args.mb)
    nbytes = sum(b.nbytes for _, _, blocks in leaves for _, b in blocks)
    where = tempfile.mkdtemp(prefix="jaxdist-slot-write-", dir=args.dir)
    times: dict[int, list[float]] = {t: [] for t in args.threads}
    try:
        _slots.write(where, 0, step=0, data_state=None, fingerprint="x", leaves=leaves)  # first use
        for rep in range(args.reps):
            order = args.threads[rep % len(args.threads):] + args.threads[:rep % len(args.threads)]
            for t in order:
                start = time.perf_counter()
                _slots.write(where, rep % 2, step=rep, data_state=None, fingerprint="x",
                             leaves=leaves, threads=t)
                times[t].append(time.perf_counter() - start)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    print(f"{nbytes / 1e6:.0f} MB, {len(leaves)} arrays, into {args.dir}; {os.cpu_count()} cores; "
          f"median of {args.reps} (interleaved)")
    print("| threads | seconds | GB/s | runs (s) |\n|---|---|---|---|")
    for t in args.threads:
        med = statistics.median(times[t])
        print(f"| {t} | {med:.3f} | {nbytes / med / 1e9:.2f} | "
              + ", ".join(f"{x:.3f}" for x in times[t]) + " |")


if __name__ == "__main__":
    main()
