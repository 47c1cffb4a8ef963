#!/usr/bin/env bash
# One call on a lent GPU machine: benchmarks/gpt.py's default configuration (GPT decoder, 111 M
# parameters), each part under its own time limit, every figure written under $OUT.
#
#   OUT=/some/dir bash benchmarks/gpu_session.sh        # from the repository root
#   GPT_ARGS=--tiny OUT=/tmp/x bash benchmarks/gpu_session.sh   # a dry run of the script on a CPU
#
# Needs no network: jax (with CUDA), flax, optax and orbax installed; jaxdist is this checkout
# (PYTHONPATH=$PWD). At most 7 files under $OUT:
#   session.log         the machine (nvidia-smi, versions, load) and each part's start, end, exit code
#   gpt_inproc.{txt,json}  hand-written, hand_fed, @mirrored, fit, zero_stage=3 (one process)
#   gpt_launch.{txt,json}  fit + BackupAndRestore under `jaxdist launch -n 1`, memory tier on / off
#   gpt.md, gpt.json    the two parts merged: the table (tokens/s, ratios, MFU, the tier's cost)
# Budget: about 8 minutes at most (the 111 M model compiles in ~30-60 s, five times in all; the
# launched runs read the in-process part's compilations from a shared cache where they match).
# A part that runs out of time still leaves its output; the launch part's JSON keeps every run that
# ended. If the in-process part fails for another reason with cuDNN attention chosen, it is run
# again with XLA's attention (and the launch part uses XLA's too).
set -u
OUT=${OUT:-$PWD/gpu-out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxdist-gpt-xla-cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
BUDGET=${BUDGET:-470}   # seconds for both parts together
LOG=$OUT/session.log

say() { echo "[$(date -u +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$LOG"; }
left() { echo $(( BUDGET - SECONDS )); }
# run_part SECONDS NAME ARGS...: the benchmark under `timeout`, its output to $OUT/NAME.txt
run_part() {
    local limit=$1 name=$2; shift 2
    [ "$limit" -lt 60 ] && limit=60   # the budget is spent: a last, short try
    say "$name: start (limit ${limit}s): $PY benchmarks/gpt.py ${GPT_ARGS:-} $*"
    # shellcheck disable=SC2086  # GPT_ARGS: words on purpose
    timeout -k 10 "$limit" "$PY" benchmarks/gpt.py ${GPT_ARGS:-} "$@" --json "$OUT/$name.json" \
        > "$OUT/$name.txt" 2>&1
    local rc=$?
    say "$name: exit code $rc$([ $rc = 124 ] && echo ' (time limit)')"
    return $rc
}

{
    date -u
    nvidia-smi 2>&1 | head -15
    "$PY" -c 'import sys, jax, flax, optax, orbax.checkpoint as ocp, numpy
print("python", sys.version.split()[0], "jax", jax.__version__, "flax", flax.__version__,
      "optax", optax.__version__, "numpy", numpy.__version__)
print(jax.devices())' 2>&1
    uptime
} >> "$LOG" 2>&1

ATTENTION=auto
run_part $(( $(left) * 53 / 100 )) gpt_inproc --parts inproc --attention $ATTENTION
rc=$?
# 3: the loops disagree, 124: the time limit; anything else with cuDNN's attention: try XLA's.
if [ $rc != 0 ] && [ $rc != 3 ] && [ $rc != 124 ] && grep -q "^attention: cudnn" "$OUT/gpt_inproc.txt"; then
    ATTENTION=xla
    tail -40 "$OUT/gpt_inproc.txt" >> "$LOG"   # the failure's log, before the rerun replaces it
    run_part $(( $(left) * 53 / 100 )) gpt_inproc --parts inproc --attention $ATTENTION
fi
run_part $(( $(left) - 10 )) gpt_launch --parts launch --attention $ATTENTION --part-timeout 150

parts=()
for f in "$OUT/gpt_inproc.json" "$OUT/gpt_launch.json"; do [ -s "$f" ] && parts+=("$f"); done
if [ ${#parts[@]} -gt 0 ]; then
    "$PY" benchmarks/gpt.py --merge "${parts[@]}" --json "$OUT/gpt.json" > "$OUT/gpt.md" 2>&1
    say "merged ${#parts[@]} part(s): exit code $? ($OUT/gpt.md)"
    cat "$OUT/gpt.md"
fi
# ---- issue 35: the input path (benchmarks/overhead.py) ------------------------------------------
# The MLP 784-256-128-10 at batch 512 and the tiny MLP 64-32-10 at batch 32 on one device: fit
# (dataset on the device), fit_host (gathered on the host, sent each epoch), fit_iter (an iterable
# streamed by the producer thread), fit_k (steps_per_execution=9) against the hand-written loop on
# placed batches. Their agreement is checked in a separate pass at the highest matmul precision.
# Its own limits (OVERHEAD_LIMIT, 150 s each), outside BUDGET; OVERHEAD=0 skips it. Writes
# $OUT/overhead_gpu_{mlp,tiny}.{txt,json} (4 files), and the tables go to session.log's end.
if [ "${OVERHEAD:-1}" != 0 ]; then
    for model in mlp tiny; do
        extra=()
        [ "$model" = mlp ] && extra=(--devices 1 --reps 12 --steps 64)
        [ "$model" = tiny ] && extra=(--reps 12 --steps 72)
        say "overhead_gpu_$model: start (limit ${OVERHEAD_LIMIT:-150}s)"
        timeout -k 10 "${OVERHEAD_LIMIT:-150}" "$PY" benchmarks/overhead.py --model "$model" \
            "${extra[@]}" ${OVERHEAD_ARGS:-} --loops hand hand_fed distribute fit fit_k fit_host fit_iter \
            --json "$OUT/overhead_gpu_$model.json" > "$OUT/overhead_gpu_$model.txt" 2>&1
        say "overhead_gpu_$model: exit code $?"
        grep -A12 '^| loop |' "$OUT/overhead_gpu_$model.txt" >> "$LOG"
    done
fi
# ---- end issue 35 --------------------------------------------------------------------------------

uptime >> "$LOG"
say "done"
