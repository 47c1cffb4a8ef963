"""A torchrun-style script under `jaxdist launch -n 2`: it imports jaxdist, then joins the job itself
with `jax.distributed.initialize(...)` from torchrun's variables, and sums across the processes.
Rank 1 calls the function bound before `import jaxdist` (`from jax.distributed import initialize`),
rank 0 calls it through `jax.distributed`.

Usage: torchrun_style_join.py [other]: `other` names another job (a wrong process count)."""

import os
import sys

import jax
import numpy as np
from jax.distributed import initialize  # bound before jaxdist joins the job

import jaxdist  # noqa: F401, I001  (under the launcher this joins the job already)

count = int(os.environ["WORLD_SIZE"]) + (1 if sys.argv[1:] == ["other"] else 0)
join = initialize if os.environ["RANK"] == "1" else jax.distributed.initialize
join(f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", num_processes=count,
     process_id=int(os.environ["RANK"]))
from jax.experimental import multihost_utils  # noqa: E402

total = multihost_utils.process_allgather(np.int32(jax.process_index() + 1)).sum()
print(f"rank {jax.process_index()} of {jax.process_count()}: sum {total}", flush=True)
