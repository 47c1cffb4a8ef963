"""Rank 1 exits with code 3; rank 0 would sleep far longer than any test waits."""
import os
import sys
import time

rank = int(os.environ["JAXDIST_PROCESS_ID"])
print(f"rank {rank} started", flush=True)
if rank == 1:
    time.sleep(0.5)
    sys.exit(3)
time.sleep(600)
