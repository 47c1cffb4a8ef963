"""Rank 0 exits on SIGTERM; rank 1 ignores it (the launcher must SIGKILL it). Both start a
grandchild whose pid they print, to check that it dies with the group."""
import os
import signal
import subprocess
import sys
import time

rank = int(os.environ["JAXDIST_PROCESS_ID"])


def on_term(signum, frame):
    print(f"rank {rank} got SIGTERM", flush=True)
    sys.exit(0)


signal.signal(signal.SIGTERM, on_term if rank == 0 else signal.SIG_IGN)
grandchild = subprocess.Popen(["sleep", "600"])
print(f"ready grandchild={grandchild.pid}", flush=True)
time.sleep(600)
