#!/usr/bin/env bash
# Cloud TPU VM or multi-host TPU slice: the same command on every host of the slice.
#
#   TPU_NAME=my-tpu ZONE=us-central2-b ACCELERATOR=v4-32 bash examples/deploy/tpu/tpu_vm.sh create
#   TPU_NAME=my-tpu ZONE=us-central2-b bash examples/deploy/tpu/tpu_vm.sh run [script.py [args...]]
#   TPU_NAME=my-tpu ZONE=us-central2-b bash examples/deploy/tpu/tpu_vm.sh delete
#
# `run` copies this checkout to every host, installs it with the [tpu] extra and starts the
# script on all hosts at once (--worker=all). jaxdist.initialize() finds the hosts through the TPU
# VM's metadata (worker id and worker addresses; coordinator port 8482 on worker 0), and
# TPUStrategy() spans every core of every host. A single-host VM (v4-8, v5litepod-8, ...) is
# the same with one worker.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
SCRIPT=${2:-examples/tpu.py}
case "${1:-run}" in
  create)
    gcloud compute tpus tpu-vm create "$TPU_NAME" --zone "$ZONE" \
      --accelerator-type "${ACCELERATOR:-v4-8}" --version "${RUNTIME:-tpu-ubuntu2204-base}" ;;
  run)
    shift $(( $# > 1 ? 2 : $# ))
    gcloud compute tpus tpu-vm scp --recurse --zone "$ZONE" --worker=all . "$TPU_NAME":jaxdist
    gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command \
      "cd jaxdist && pip install -q -e '.[tpu]' && python $SCRIPT $*" ;;
  delete)
    gcloud compute tpus tpu-vm delete "$TPU_NAME" --zone "$ZONE" --quiet ;;
  *)
    echo "usage: tpu_vm.sh {create|run [script.py args...]|delete}" >&2; exit 2 ;;
esac
