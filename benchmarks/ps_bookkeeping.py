"""Issue 19 item 4: what a parameter server's exactly-once bookkeeping costs as history grows.

Applies N updates to a 4-float shard (no checkpoints), then times 100 more pushes that include one
synchronous checkpoint, and reports the process's RSS growth. Before issue 19 every applied
update was kept (and rewritten by every checkpoint) forever.

Usage: python benchmarks/ps_bookkeeping.py [N ...]    (default: 0 300000)
       python benchmarks/ps_bookkeeping.py --quick   (0 3000: the plumbing, seconds)
Prints one JSON line per N; ``100_pushes_vs_first`` is its 100 pushes' time over the first N's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time

import numpy as np

from jaxdist.ps import optimizer
from jaxdist.ps.server import ParameterServer, ServerConfig


def rss_mb() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20


def run(n: int) -> dict:
    g = {"w": np.ones(4, np.float32)}
    with tempfile.TemporaryDirectory() as d:
        ps = ParameterServer(0, {"w": np.zeros(4, np.float32)}, optimizer("sgd", learning_rate=0.0),
                             ServerConfig(checkpoint_dir=None))
        rss0 = rss_mb()
        t = time.perf_counter()
        for i in range(n):
            ps.push(worker=i % 8, step_id=i, version=ps.version, grads=g)
        fill_s = time.perf_counter() - t
        rss1 = rss_mb()
        # from here on, a checkpoint every 100 updates (the default), in the server's directory
        ps.config = dataclasses.replace(ps.config, checkpoint_dir=d, checkpoint_every=100)
        ps.push(worker=0, step_id=n, version=ps.version, grads=g)  # warm up
        start = n + 1
        while ps.version % 100:  # end just after a checkpoint, so the next 100 include one
            ps.push(worker=0, step_id=start, version=ps.version, grads=g)
            start += 1
        t = time.perf_counter()
        for i in range(start, start + 100):
            ps.push(worker=i % 8, step_id=i, version=ps.version, grads=g)
        push100_s = time.perf_counter() - t
    return {"updates": n, "fill_s": round(fill_s, 2), "rss_growth_mb": round(rss1 - rss0, 1),
            "100_pushes_with_1_checkpoint_s": round(push100_s, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("updates", nargs="*", type=int, default=[0, 300000],
                    help="history sizes N to measure, the first one the baseline of the ratio")
    ap.add_argument("--quick", action="store_true",
                    help="a check of the plumbing in seconds: N = 0 and 3000")
    args = ap.parse_args(argv)
    if args.quick:  # sizes given explicitly still win
        ap.set_defaults(updates=[0, 3000])
        args = ap.parse_args(argv)
    first = None
    for n in args.updates:
        row = run(n)
        if first is None:
            first = row["100_pushes_with_1_checkpoint_s"]
        row["100_pushes_vs_first"] = round(row["100_pushes_with_1_checkpoint_s"] / first, 2)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
