"""`join_corners.py pool|optout`: pool: a spawn pool started before `import jaxdist` whose workers
import jaxdist (they must not join the job as this process's rank); optout: launched with
JAXDIST_JOIN_ON_IMPORT=0, the import joins nothing and the script joins with its own call."""
import multiprocessing as mp
import os
import sys


def work(_):
    import jax

    import jaxdist  # noqa: F401 - what a data worker's import does

    return jax.process_count()


if __name__ == "__main__":
    mode = sys.argv[1]
    pool = mp.get_context("spawn").Pool(1) if mode == "pool" else None
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    import jaxdist

    if mode == "optout":
        joined_on_import = jax.distributed.is_initialized()
        jaxdist.initialize()  # the script's own join, from the launcher's variables
        print("joined on import", joined_on_import, flush=True)
    if pool is not None:
        print("worker process_count", pool.map(work, [0])[0], flush=True)
        pool.close()
        pool.join()
    total = int(multihost_utils.process_allgather(np.array([1])).sum())
    print("rank", os.environ["RANK"], "job of", jax.process_count(), "total", total, flush=True)
