#!/usr/bin/env bash
# One call on a lent GPU machine: benchmarks/gpt.py's default configuration (GPT decoder, 111 M
# parameters, 1.3 GB of state with AdamW), each part under its own time limit, every figure written
# under $OUT as soon as its part ends.
#
#   OUT=/some/dir bash benchmarks/gpu_session.sh        # from the repository root
#   GPT_ARGS=--tiny OUT=/tmp/x bash benchmarks/gpu_session.sh   # a dry run of the script on a CPU
#
# Needs no network: jax (with CUDA), flax, optax and orbax installed; jaxdist is this checkout
# (PYTHONPATH=$PWD). Files under $OUT:
#   session.log            the machine (nvidia-smi, versions, load) and each part's start, end, exit code
#   gpt_check.{txt,json}   the DETERMINISTIC pass (--xla_gpu_deterministic_ops, XLA attention), few
#                          steps: every loop (hand_fed, @mirrored, fit, zero_stage=3) must end on the
#                          hand-written loop's parameters (exit 3 if not). Numbers only, no speed
#   gpt_kill.{txt,json}    deterministic pass: fit + BackupAndRestore under `jaxdist launch -n 1`,
#                          SIGKILL after step 2/3 of the run, replicated and zero_stage=3: steps
#                          computed again against the announced bound (exit 5 if beyond it or not
#                          from memory), parameters against the uninterrupted run's
#   gpt_launch.{txt,json}  the fast pass: the tier on / off over >= 200 steps (speed; the tier's
#                          announced bounds)
#   gpt_inproc.{txt,json}  the fast pass: tokens/s, MFU of every loop (--timing-only)
#   gpt.md, gpt.json       the timing and kill parts merged: one table
# Budget: the whole call must fit 15 minutes of device time with the machine's start (2-3 min), so
# the parts get about 10 minutes together (BUDGET), most important first; each has its own limit
# and a part that runs out of time still leaves what it finished.
set -u
OUT=${OUT:-$PWD/gpu-out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxdist-gpt-xla-cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
BUDGET=${BUDGET:-600}   # seconds for all parts together (the machine start comes on top)
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

# 1. same numbers, deterministic (XLA attention): short
run_part 120 gpt_check --parts inproc --deterministic --steps 8 --reps 1
# 2. a SIGKILL under the launcher, deterministic: 4 launched runs of 60 steps
run_part 240 gpt_kill --parts kill --deterministic --launch-steps 60 --part-timeout 110
# 3. the tier's cost in the fast pass: on / off alternated, 220 steps each (>= 200 timed)
run_part 200 gpt_launch --parts launch --timing-only --launch-steps 220 --launch-reps 2 \
    --part-timeout 90
# 4. the fast pass's speed of every loop, with what time is left
run_part $(( $(left) - 15 )) gpt_inproc --parts inproc --timing-only --reps 3

parts=()
# The timing parts and the kill part; the same-numbers check stands in gpt_check.txt (its
# config, 8 steps deterministic, is not the timing runs').
for f in "$OUT"/gpt_kill.json "$OUT"/gpt_launch.json "$OUT"/gpt_inproc.json; do [ -s "$f" ] && parts+=("$f"); done
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
