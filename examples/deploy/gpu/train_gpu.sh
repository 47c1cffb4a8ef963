#!/usr/bin/env bash
# One GPU host, every GPU, one process (MirroredStrategy / @jaxdist.mirrored over all local GPUs).
#
#   pip install "jaxdist[cuda12]"                        # jax[cuda12]: CUDA, cuDNN and NCCL wheels
#   bash examples/deploy/gpu/train_gpu.sh [script.py [args...]]
#
# Without a usable GPU it says so loudly on stderr and trains on the CPU (JAXDIST_REQUIRE_GPU=1:
# exits with status 1 instead).
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

# Say so, loudly, when the job would run on the CPU: no NVIDIA driver, no GPU, or a JAX without
# CUDA (installed without the [cuda12] extra). JAXDIST_REQUIRE_GPU=1 makes that an error.
gpu_problem=""
if ! command -v nvidia-smi >/dev/null 2>&1; then
  gpu_problem="nvidia-smi not found: no NVIDIA driver on this machine"
elif ! nvidia-smi -L 2>/dev/null | grep -q "^GPU "; then
  gpu_problem="nvidia-smi lists no GPU"
else
  backend=$(XLA_PYTHON_CLIENT_PREALLOCATE=false python -c \
    'import jax; print(jax.default_backend())' 2>/dev/null || echo "unknown")
  if [[ "$backend" != "gpu" ]]; then
    gpu_problem="JAX's backend is '$backend', not 'gpu' (pip install \"jaxdist[cuda12]\")"
  fi
fi
if [[ -n "$gpu_problem" ]]; then
  {
    echo "######################################################################"
    echo "# train_gpu.sh: NO GPU FOUND - $gpu_problem"
    echo "# Training runs on the CPU instead (slowly)."
    echo "######################################################################"
  } >&2
  if [[ "${JAXDIST_REQUIRE_GPU:-0}" == "1" ]]; then
    echo "train_gpu.sh: JAXDIST_REQUIRE_GPU=1: stopping" >&2
    exit 1
  fi
fi

exec python "$SCRIPT" "$@"
