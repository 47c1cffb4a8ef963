"""2 processes x 2 devices: initialize, psum across processes, barrier timeout naming the absent."""

import numpy as np

import jaxdist.cluster as cluster
import jaxdist.launch.runtime as runtime

spec = runtime.initialize(timeout_s=60)  # from JAXDIST_* (the launcher) or JAX's detection
print(f"spec {spec.coordinator_address} {spec.num_processes} {spec.process_id}")

import jax  # noqa: E402  (the backend must start after initialize)

me = jax.process_index()
assert runtime.initialize() is spec, "a second initialize() must be a no-op"
try:
    runtime.initialize(cluster.ClusterSpec("127.0.0.1:1", 2, 1 - me))
except RuntimeError as e:
    print("conflict:", e)

mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
local = np.arange(2, dtype=np.float32) + 2 * me + 1  # process 0: [1, 2], process 1: [3, 4]
x = jax.make_array_from_process_local_data(jax.NamedSharding(mesh, jax.P("data")), local)
total = jax.shard_map(lambda v: jax.lax.psum(v, "data"), mesh=mesh, in_specs=jax.P("data"),
                      out_specs=jax.P())(x)
print(f"process {me}/{jax.process_count()} devices={jax.device_count()} "
      f"psum={float(np.asarray(total.addressable_data(0))[0])}")

runtime.barrier("after-psum", timeout_s=30)
if me == 0:
    try:
        runtime.barrier("only-process-0", timeout_s=2)
    except cluster.BarrierTimeoutError as e:
        print(f"missing={list(e.missing)} message: {e}")
runtime.barrier("solo", timeout_s=30, process_ids=[me])  # a subset of one: no waiting
try:
    runtime.barrier("pair", process_ids=[1 - me])
except ValueError as e:
    print("subset:", e)
runtime.barrier("done", timeout_s=30)
print(f"process {me} finished")
