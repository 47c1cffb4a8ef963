"""Joins whatever job the environment describes and prints what it formed, as one JSON line.

Used by tests/test_deploy.py with the environment a deployment recipe (SLURM, a Kubernetes
Indexed Job, a TPU VM) would give a process. `--pretend-cloud-tpu-vm` makes JAX's cluster
detection believe it runs on a Cloud TPU VM (the metadata server is a local stand-in).
"""

import json
import os
import sys

if "--pretend-cloud-tpu-vm" in sys.argv:
    from jax._src.clusters import cloud_tpu_cluster, cluster

    cloud_tpu_cluster.running_in_cloud_tpu_vm = True
    cluster.running_in_cloud_tpu_vm = True
    os.environ.pop("TPU_SKIP_MDS_QUERY", None)  # JAX sets it on import when it finds no TPU chip

import jaxdist

environment_spec = jaxdist.cluster.cluster_from_environment()
spec = jaxdist.initialize(timeout_s=60)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

jaxdist.barrier("probe", timeout_s=60)
gathered = multihost_utils.process_allgather(jnp.array([jax.process_index()]), tiled=True)
# One write of the whole line: under a stand-in `srun` both processes share one stdout pipe, and
# print() writes the text and its newline separately, so two reports could interleave. The leading
# newline ends any partial line that gloo's C++ logging (which writes to the same fd 1 through its
# own buffer) left open, so the report always starts a line of its own.
sys.stdout.write("\n" + json.dumps({
    "from_environment": None if environment_spec is None else {
        "coordinator": environment_spec.coordinator_address,
        "num_processes": environment_spec.num_processes,
        "process_id": environment_spec.process_id},
    "coordinator": spec.coordinator_address, "num_processes": spec.num_processes,
    "process_id": spec.process_id, "process_index": jax.process_index(),
    "process_count": jax.process_count(), "local_devices": jax.local_device_count(),
    "global_devices": jax.device_count(), "gathered": [int(v) for v in gathered],
    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "shutdown_at_exit": jaxdist.launch.runtime._shutdown_registered,
}) + "\n")
sys.stdout.flush()
