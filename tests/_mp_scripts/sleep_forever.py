"""Writes this rank's pid to ``$PID_DIR/<rank>`` and sleeps (a rank that never ends by itself)."""
import os
import time

path = os.path.join(os.environ["PID_DIR"], os.environ["JAXDIST_PROCESS_ID"])
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(path + ".tmp", path)
time.sleep(600)
