"""2 processes x 2 CPU devices: a psum across the processes, compiled with the persistent cache
the environment names; prints the sum and how many compilations the cache served. With
``--plain``: a JAX script that never imports jaxdist (it joins with jax.distributed.initialize
from the launcher's variables)."""

import json
import os
import sys

import jax

seen = {"hits": 0, "misses": 0}


def _count(name, *_, **__):
    if name == "/jax/compilation_cache/cache_hits":
        seen["hits"] += 1
    elif name == "/jax/compilation_cache/cache_misses":
        seen["misses"] += 1


jax.monitoring.register_event_listener(_count)

import numpy as np  # noqa: E402

if "--plain" in sys.argv:
    jax.distributed.initialize(os.environ["JAXDIST_COORDINATOR"],
                               int(os.environ["JAXDIST_NUM_PROCESSES"]),
                               int(os.environ["JAXDIST_PROCESS_ID"]))
else:
    import jaxdist  # noqa: F401  (joins the job the launcher started)

me = jax.process_index()
mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
local = np.arange(2, dtype=np.float32) + 2 * me + 1  # process 0: [1, 2], process 1: [3, 4]
x = jax.make_array_from_process_local_data(jax.NamedSharding(mesh, jax.P("data")), local)
total = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "data"), mesh=mesh,
                              in_specs=jax.P("data"), out_specs=jax.P()))(x)
print(f"psum {float(np.asarray(total.addressable_data(0))[0])} cache {json.dumps(seen)}")
