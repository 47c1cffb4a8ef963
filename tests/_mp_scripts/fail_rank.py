"""`fail_rank.py exit|kill`: rank 1 exits with code 3 or kills itself with SIGKILL; rank 0
would sleep far longer than any test waits."""
import os
import signal
import sys
import time

rank = int(os.environ["JAXDIST_PROCESS_ID"])
print(f"rank {rank} started", flush=True)
if rank == 1:
    time.sleep(0.5)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(3)
time.sleep(600)
