#!/usr/bin/env bash
# One GPU host, every GPU, one process (MirroredStrategy / @jaxdist.mirrored over all local GPUs).
#
#   pip install "jaxdist[cuda12]"                        # jax[cuda12]: CUDA, cuDNN and NCCL wheels
#   bash examples/deploy/gpu/train_gpu.sh [script.py [args...]]
#
# The settings below are the ones that matter for data parallelism on one host; see
# examples/deploy/README.md ("One GPU host") for what each does and where it is documented.
set -euo pipefail
SCRIPT=${1:-examples/mirrored_digits.py}
shift $(( $# > 0 ? 1 : 0 ))

# Overlap the gradient all-reduce (NCCL) with the backward pass.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"
# JAX preallocates 75% of each GPU's memory; one process per host can take more.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}
# Print NCCL's topology and transport choices once (NVLink / PCIe / network) to check them.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

exec python "$SCRIPT" "$@"
