"""Rank 1 fails on the first attempt only; the restarted group succeeds."""
import os
import sys

rank = int(os.environ["JAXDIST_PROCESS_ID"])
attempt = int(os.environ["JAXDIST_RESTART_COUNT"])
if rank == 1 and attempt == 0:
    sys.exit(5)
print(f"rank {rank} attempt {attempt} ok coordinator={os.environ['JAXDIST_COORDINATOR']}")
