"""A torchrun-style script under `jaxdist launch -n 2`: it imports jaxdist, then joins the job itself
with `jax.distributed.initialize(...)` from torchrun's variables, and sums across the processes.

Usage: torchrun_style_join.py [other]: `other` names another job (a wrong process count)."""

import os
import sys

import jax
import numpy as np

import jaxdist  # noqa: F401  (under the launcher this joins the job already)

count = int(os.environ["WORLD_SIZE"]) + (1 if sys.argv[1:] == ["other"] else 0)
jax.distributed.initialize(f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                           num_processes=count, process_id=int(os.environ["RANK"]))
from jax.experimental import multihost_utils  # noqa: E402

total = multihost_utils.process_allgather(np.int32(jax.process_index() + 1)).sum()
print(f"rank {jax.process_index()} of {jax.process_count()}: sum {total}", flush=True)
