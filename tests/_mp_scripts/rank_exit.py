"""`rank_exit.py OUT_DIR raise|hook|exit`: both ranks write a CSV and a JSON-lines file (opened
once, never closed, as training scripts do), log to a file and register an atexit handler, then
meet in a collective every step; at step 3 rank 1 raises (with Python's excepthook, or with one
the script installed, as rich.traceback.install() does) or calls sys.exit(3), while rank 0 waits
in the next collective."""
import atexit
import json
import logging
import os
import sys
import traceback

import numpy as np
from jax.experimental import multihost_utils

import jaxdist  # joins the launched job

out, mode = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
csv = open(os.path.join(out, f"metrics{rank}.csv"), "a")
jsonl = open(os.path.join(out, f"metrics{rank}.jsonl"), "a")
log = logging.getLogger("user")
log.addHandler(logging.FileHandler(os.path.join(out, f"log{rank}.txt")))
log.setLevel(logging.INFO)
atexit.register(lambda: open(os.path.join(out, f"atexit{rank}"), "w").write("ran"))
if mode == "hook":
    sys.excepthook = lambda kind, value, tb: print("custom hook:", "".join(
        traceback.format_exception(kind, value, tb)), file=sys.stderr, flush=True)
for step in range(1, 100):
    total = multihost_utils.process_allgather(np.array([step]))
    csv.write(f"{step},{int(total.sum())}\n")
    jsonl.write(json.dumps({"step": step}) + "\n")
    log.info("step %d", step)
    if rank == 1 and step == 3:
        if mode == "exit":
            sys.exit(3)
        raise ValueError(f"rank 1 fails at step {step} ({jaxdist.__name__})")
