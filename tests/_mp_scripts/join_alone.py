"""Joins a 2-process job alone: `join_alone.py PROCESS_ID PORT` (nobody else ever comes)."""
import sys

import jaxdist.cluster as cluster
import jaxdist.launch.runtime as runtime

process_id, port = int(sys.argv[1]), int(sys.argv[2])
try:
    runtime.initialize(cluster.ClusterSpec(f"127.0.0.1:{port}", 2, process_id), timeout_s=3)
except cluster.CoordinatorTimeoutError as e:
    print(f"CoordinatorTimeoutError: {e}")
    sys.exit(2)
print("joined (unexpected)")
