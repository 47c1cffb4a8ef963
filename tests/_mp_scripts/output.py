"""Writes lines to stdout and stderr, one of them in pieces, plus the job environment."""
import os
import sys
import time

import jax

rank = os.environ["JAXDIST_PROCESS_ID"]
print(f"env {os.environ['JAXDIST_NUM_PROCESSES']} {rank} {os.environ['JAXDIST_COORDINATOR']} "
      f"devices={jax.local_device_count()}")
for piece in ("a partial", " line from ", f"rank {rank}\n"):
    sys.stdout.write(piece)
    sys.stdout.flush()
    time.sleep(0.05)
sys.stdout.write(f"progress 1\rprogress 2 of rank {rank}\r\n")  # a progress bar's updates
print(f"to stderr from rank {rank}", file=sys.stderr)
sys.stdout.write(f"no newline at the end from rank {rank}")
