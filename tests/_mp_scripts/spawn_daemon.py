"""Each rank starts a daemon in its own session (setsid) that keeps the rank's stdout open, writes
the daemon's pid to PID_DIR/<rank>, and sleeps: after SIGTERM to the launcher, no daemon may be
left and the launcher must not wait for the pipes they hold. With CLEAR_ENV=1 the daemon starts
with an empty environment (no JAXDIST_LAUNCH_ID tag)."""
import os
import subprocess
import sys
import time

rank = os.environ["JAXDIST_PROCESS_ID"]
daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                          start_new_session=True,  # stdout/stderr: the launcher's pipes
                          env={} if os.environ.get("CLEAR_ENV") == "1" else None)
path = os.path.join(os.environ["PID_DIR"], rank)
with open(path + ".tmp", "w") as f:
    f.write(str(daemon.pid))
os.replace(path + ".tmp", path)
print(f"rank {rank} started daemon {daemon.pid}", flush=True)
time.sleep(600)
