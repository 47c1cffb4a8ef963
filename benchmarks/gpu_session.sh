#!/usr/bin/env bash
# One call on a lent GPU machine (at most 600 s, at most 8 files back): every GPU figure this
# project asks for, cheapest evidence first, each part under its own time limit inside BUDGET, then
# every target printed PASS or MISS (benchmarks/gpu_verdict.py).
#
#   OUT=/some/dir bash benchmarks/gpu_session.sh             # from the repository root, on a GPU
#   OUT=/some/dir bash benchmarks/gpu_session.sh --dry-run   # every part at tiny sizes on a CPU
#
# Parts, in order (a part that runs out of time still leaves what it finished):
#   input   benchmarks/overhead.py, one device: fit against the hand-written loop on placed
#           batches, the MLP 784-256-128-10 at batch 512 and the MLP 64-32-10 at batch 32 with
#           steps_per_execution=9; windows of 1024 steps; every parameter leaf compared
#   tier    benchmarks/gpt.py (GPT, 111 M parameters, 1.3 GB of state with AdamW): fit +
#           BackupAndRestore under `jaxdist launch -n 1`, the memory tier on and off, 220 steps
#           each (>= 200 timed); the bounds the tier announces; whether it ran
#   kill    the same, deterministic pass: SIGKILL after step 2/3 of the run, replicated and
#           zero_stage=3: steps computed again against the bound announced before the kill,
#           parameters against the uninterrupted run's (bit-exact: 1e-6)
#   gpt     the deterministic pass's agreement of every loop (8 steps), then the fast pass's
#           tokens/s of every loop (hand-written, hand_fed, @mirrored, fit, zero_stage=3)
# Files under $OUT (3): summary.txt (the verdict: one PASS/MISS line per target, and each part's
# table), session.log (the machine, each part's command, limit, exit code and time), and
# gpu_session.tar.gz (every part's output and JSON). Exit code: 0 when every target passes, 6 when
# one is missed or its part left no figure (the last line of summary.txt names the parts), 2 for
# a bad argument.
#
# BUDGET (default 540 s) bounds all parts together, well inside the call's 600 s; the machine's
# start (2-3 min) comes on top, from the session's 15 minutes. GPU_TARGETS="tier.steps_per_s=0.99"
# sets a target's threshold for a run (a target set out of reach shows that its check fails).
# Needs no network: jax (with CUDA), flax, optax and orbax installed; jaxdist is this checkout.
set -u
DRY=${GPU_DRY_RUN:-0}
for arg in "$@"; do
    case $arg in
        --dry-run) DRY=1 ;;
        -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
        *) echo "gpu_session.sh: unknown argument '$arg' (expected --dry-run or nothing)" >&2
           exit 2 ;;
    esac
done
OUT=${OUT:-$PWD/gpu-out}
PY=${PYTHON:-python3}
BUDGET=${BUDGET:-540}
mkdir -p "$OUT/parts"
PARTS=$OUT/parts
LOG=$OUT/session.log
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$OUT/xla-cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0

if [ "$DRY" = 1 ]; then   # the same parts at sizes a CPU runs in seconds: plumbing, no figure
    GPT=(--tiny --devices 2)
    MLP=(--steps 16 --reps 2); TINY=(--steps 18 --reps 2)
    TIER=(--launch-steps 12 --launch-reps 1); KILL=(--launch-steps 24)
    CHECK=(--steps 4 --reps 1); TIMING=(--reps 2)
    LIMITS=(150 120 150 240 120 120)
else
    GPT=()
    MLP=(--steps 1024 --reps 6); TINY=(--steps 1026 --reps 6)
    TIER=(--launch-steps 220 --launch-reps 1); KILL=(--launch-steps 48)
    CHECK=(--steps 8 --reps 1); TIMING=(--reps 3)
    LIMITS=(70 50 120 170 60 150)
fi

say() { echo "[$(date -u +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$LOG"; }
# part LIMIT NAME COMMAND...: COMMAND under `timeout`, at most LIMIT s and what the budget has
# left, its output to $PARTS/NAME.txt; skipped when under 20 s are left.
part() {
    local limit=$1 name=$2; shift 2
    local left=$(( BUDGET - SECONDS - 15 ))   # 15 s for the verdict and the archive
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 20 ]; then
        say "$name: not run (the budget is spent)"
        return
    fi
    say "$name: start (limit ${limit}s): $*"
    timeout -k 5 "$limit" "$@" > "$PARTS/$name.txt" 2>&1
    local rc=$?
    say "$name: exit code $rc$([ $rc = 124 ] && echo ' (time limit)')"
}

{
    date -u
    command -v nvidia-smi > /dev/null && nvidia-smi 2>&1 | head -15
    "$PY" -c 'import sys, jax, flax, optax, orbax.checkpoint, numpy
print("python", sys.version.split()[0], "jax", jax.__version__, "flax", flax.__version__,
      "optax", optax.__version__, "numpy", numpy.__version__)
print(jax.devices())' 2>&1
    uptime
} >> "$LOG" 2>&1
say "budget ${BUDGET}s$([ "$DRY" = 1 ] && echo ', dry run (tiny sizes)')"

loops=(--loops hand fit fit_k)
part "${LIMITS[0]}" overhead_mlp "$PY" benchmarks/overhead.py --model mlp --devices 1 "${MLP[@]}" \
    "${loops[@]}" --json "$PARTS/overhead_mlp.json"
part "${LIMITS[1]}" overhead_tiny "$PY" benchmarks/overhead.py --model tiny "${TINY[@]}" \
    "${loops[@]}" --json "$PARTS/overhead_tiny.json"
part "${LIMITS[2]}" gpt_launch "$PY" benchmarks/gpt.py "${GPT[@]}" --parts launch --timing-only \
    "${TIER[@]}" --part-timeout 100 --json "$PARTS/gpt_launch.json"
part "${LIMITS[3]}" gpt_kill "$PY" benchmarks/gpt.py "${GPT[@]}" --parts kill --deterministic \
    "${KILL[@]}" --part-timeout 100 --json "$PARTS/gpt_kill.json"
part "${LIMITS[4]}" gpt_check "$PY" benchmarks/gpt.py "${GPT[@]}" --parts inproc --deterministic \
    "${CHECK[@]}" --json "$PARTS/gpt_check.json"
part "${LIMITS[5]}" gpt_inproc "$PY" benchmarks/gpt.py "${GPT[@]}" --parts inproc --timing-only \
    "${TIMING[@]}" --json "$PARTS/gpt_inproc.json"

uptime >> "$LOG"
"$PY" benchmarks/gpu_verdict.py "$PARTS" $([ "$DRY" = 1 ] && echo --dry-run) > "$PARTS/verdict.txt" 2>&1
rc=$?
{
    cat "$PARTS/verdict.txt"
    for name in overhead_mlp overhead_tiny; do
        [ -s "$PARTS/$name.txt" ] && { echo; echo "## $name"; grep -A6 '^| loop |' "$PARTS/$name.txt"; }
    done
    for name in gpt_launch gpt_kill gpt_check gpt_inproc; do
        [ -s "$PARTS/$name.txt" ] && { echo; echo "## $name"
            grep -E '^\| |tier cost|SIGKILL|same numbers' "$PARTS/$name.txt"; }
    done
} > "$OUT/summary.txt" 2>&1
say "done: $(tail -1 "$PARTS/verdict.txt")"
cp "$LOG" "$PARTS/"
tar -czf "$OUT/gpu_session.tar.gz" -C "$OUT" parts
rm -rf "$PARTS" "$OUT/xla-cache"
cat "$OUT/summary.txt"
exit "$rc"
