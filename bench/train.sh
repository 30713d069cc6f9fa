#!/usr/bin/env bash
# bench/train.sh: the training-throughput benchmark, fitlm against PyTorch,
# in one command. Builds the bench programs (Release), measures the fp32 FMA
# peak (bench/peak_fma), then for each GPT-2 124M shape runs fitlm
# (bench/bench_train) and PyTorch (bench/torch_gpt2.py, if /usr/bin/python3
# has torch) one after the other, and prints a markdown table, also written
# to bench/results.md. See bench/README.md for the columns.
#
#   bench/train.sh                      # the default run, ~5 minutes when idle
#   SHAPES="4x64" bench/train.sh        # only B=4,T=64
#
# Environment knobs (defaults in brackets):
#   SHAPES     "BxT ..." shapes to run                  ["4x64 8x256"]
#   STEPS      timed steps per run, ("BxT=N ..." or N)  ["4x64=10 8x256=6"]
#   WARMUP     untimed steps before them                [2]
#   THREADS    threads for every engine                 [2]
#   IDLE_WAIT  seconds to wait, before each run, for the machine to go idle [60]
#   NO_TORCH   1 = skip PyTorch                         [0]
#   RESULTS    where the markdown goes                  [bench/results.md]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

COMMAND="bench/train.sh${*:+ $*}"
for v in SHAPES STEPS WARMUP THREADS IDLE_WAIT NO_TORCH; do
    if [[ -n ${!v+x} ]]; then COMMAND="$v=\"${!v}\" $COMMAND"; fi
done

SHAPES=${SHAPES:-"4x64 8x256"}
STEPS=${STEPS:-"4x64=10 8x256=6"}
WARMUP=${WARMUP:-2}
THREADS=${THREADS:-2}
IDLE_WAIT=${IDLE_WAIT:-60}
NO_TORCH=${NO_TORCH:-0}
RESULTS=${RESULTS:-$ROOT/bench/results.md}
PY=/usr/bin/python3

LOG=$(mktemp -d "${TMPDIR:-/tmp}/fitlm-bench.XXXXXX")
echo "== logs in $LOG"

steps_for() { # steps_for BxT
    local s
    if [[ $STEPS =~ ^[0-9]+$ ]]; then echo "$STEPS"; return; fi
    for s in $STEPS; do
        if [[ ${s%%=*} == "$1" ]]; then echo "${s#*=}"; return; fi
    done
    echo 5
}

# CPU jiffies (busy, total) of the whole machine, from /proc/stat
cpu_jiffies() {
    local _ user nice sys idle iowait irq softirq steal rest
    read -r _ user nice sys idle iowait irq softirq steal rest </proc/stat
    echo "$((user + nice + sys + irq + softirq + steal)) $((user + nice + sys + idle + iowait + irq + softirq + steal))"
}

# Percent of the machine busy over one second.
busy_pct() {
    local b0 t0 b1 t1
    read -r b0 t0 < <(cpu_jiffies)
    sleep 1
    read -r b1 t1 < <(cpu_jiffies)
    echo $(((b1 - b0) * 100 / (t1 - t0 > 0 ? t1 - t0 : 1)))
}

# Waits up to IDLE_WAIT seconds for the machine to be < 10% busy; prints the
# last reading.
wait_idle() {
    local start=$SECONDS b
    b=$(busy_pct)
    while ((b >= 10 && SECONDS - start < IDLE_WAIT)); do
        b=$(busy_pct)
    done
    echo "$b"
}

# run_measured NAME CMD...: runs CMD with its output in $LOG/NAME.log and
# records, in $LOG/NAME.other, the CPU share other processes took meanwhile
# (machine busy time minus the command's own user+sys, over 2 cores' worth).
HAVE_TIME=0
[[ -x /usr/bin/time ]] && HAVE_TIME=1
run_measured() {
    local name=$1
    shift
    local b0 t0 b1 t1 rc=0
    read -r b0 t0 < <(cpu_jiffies)
    if ((HAVE_TIME)); then
        /usr/bin/time -f "%U %S %e %M" -o "$LOG/$name.time" "$@" >"$LOG/$name.log" 2>&1 || rc=$?
    else
        "$@" >"$LOG/$name.log" 2>&1 || rc=$?
    fi
    read -r b1 t1 < <(cpu_jiffies)
    if ((HAVE_TIME)) && [[ -s $LOG/$name.time ]]; then
        awk -v b="$((b1 - b0))" -v t="$((t1 - t0))" -v hz="$(getconf CLK_TCK)" \
            'END { own = ($1 + $2) * hz; o = (t > 0) ? 100 * (b - own) / t : 0;
                   if (o < 0) o = 0; printf "%.0f\n", o }' "$LOG/$name.time" >"$LOG/$name.other"
    else
        echo "?" >"$LOG/$name.other"
    fi
    return $rc
}

field() { # field KEY RESULT-LINE
    local kv
    for kv in $2; do
        if [[ ${kv%%=*} == "$1" ]]; then echo "${kv#*=}"; return; fi
    done
    echo "?"
}

# ---------------------------------------------------------------------------
echo "== build (Release)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target peak_fma bench_train >"$LOG/build.log" 2>&1 ||
    { cat "$LOG/build.log"; exit 1; }

TORCH=0
TORCH_VERSION="not found"
if [[ $NO_TORCH != 1 ]] && [[ -x $PY ]] && TORCH_VERSION=$($PY -c 'import torch; print(torch.__version__)' 2>/dev/null); then
    TORCH=1
else
    [[ $NO_TORCH == 1 ]] && TORCH_VERSION="skipped (NO_TORCH=1)"
    echo "== PyTorch: $TORCH_VERSION in $PY; fitlm only"
fi

CPU=$(grep -m1 "model name" /proc/cpuinfo | sed 's/.*: //')
FLAGS=$(grep -m1 "^flags" /proc/cpuinfo)
ISA_NOTE=""
for f in avx512f avx512_bf16 amx_bf16; do
    if [[ " $FLAGS " == *" $f "* ]]; then ISA_NOTE+="$f "; fi
done

echo "== peak fp32 FMA (idle wait: $(wait_idle)% busy)"
run_measured peak ./build/peak_fma --threads "$THREADS"
cat "$LOG/peak.log"
PEAK_LINE=$(grep '^RESULT peak_fma' "$LOG/peak.log")
PEAK=$(field peak_gflops "$PEAK_LINE")

declare -a ROWS NOTES RAW
START=$SECONDS
for shape in $SHAPES; do
    B=${shape%x*} T=${shape#*x}
    N=$(steps_for "$shape")
    args=(--B "$B" --T "$T" --steps "$N" --warmup "$WARMUP" --threads "$THREADS" --peak "$PEAK")
    engines=(fitlm)
    ((TORCH)) && engines+=(pytorch)
    declare -A LINE=()
    for eng in "${engines[@]}"; do
        idle=$(wait_idle)
        echo "== $eng B=$B T=$T: $N timed steps after $WARMUP warm-up (machine ${idle}% busy before)"
        name="${eng}_${B}x${T}"
        if [[ $eng == fitlm ]]; then
            run_measured "$name" timeout 900 ./build/bench_train "${args[@]}" || true
        else
            run_measured "$name" timeout 900 env OMP_WAIT_POLICY=PASSIVE "$PY" bench/torch_gpt2.py "${args[@]}" || true
        fi
        line=$(grep '^RESULT ' "$LOG/$name.log" || true)
        if [[ -z $line ]]; then
            echo "   FAILED: see $LOG/$name.log"
            tail -5 "$LOG/$name.log"
            line="RESULT engine=$eng failed=1"
        else
            grep '^median' "$LOG/$name.log"
        fi
        LINE[$eng]=$line
        RAW+=("$line")
        NOTES+=("$eng B=$B T=$T: machine ${idle}% busy before the run; other processes took ~$(cat "$LOG/$name.other")% of the CPUs during it; loss $(field loss_first "$line") -> $(field loss_last "$line"); fwd/bwd/clip+adamw median $(field ms_fwd "$line")/$(field ms_bwd "$line")/$(field ms_opt "$line") ms")
    done
    for eng in "${engines[@]}"; do
        l=${LINE[$eng]}
        if [[ $(field failed "$l") == 1 ]]; then
            ROWS+=("| B=$B, T=$T | $eng | failed | | | | | |")
            continue
        fi
        ratio="—"
        if [[ $eng == fitlm ]] && ((TORCH)) && [[ $(field failed "${LINE[pytorch]}") != 1 ]]; then
            ratio=$(awk -v a="$(field tok_s "$l")" -v b="$(field tok_s "${LINE[pytorch]}")" 'BEGIN { printf "%.2f", a / b }')
        fi
        ROWS+=("$(awk -v B="$B" -v T="$T" -v e="$eng" -v med="$(field ms_median "$l")" \
            -v lo="$(field ms_min "$l")" -v hi="$(field ms_max "$l")" -v tok="$(field tok_s "$l")" \
            -v gf="$(field gflops "$l")" -v mfu="$(field mfu "$l")" -v rss="$(field peak_rss_mib "$l")" \
            -v r="$ratio" 'BEGIN { printf "| B=%d, T=%d | %s | %.0f (%.0f-%.0f) | %.1f | %.1f | %.1f%% | %.2f GiB | %s |",
                B, T, e, med, lo, hi, tok, gf, 100 * mfu, rss / 1024, r }')")
    done
    unset LINE
done
ELAPSED=$((SECONDS - START))

TABLE="| shape | engine | ms/step median (min-max) | tok/s | GFLOP/s | MFU | peak RSS | fitlm/PyTorch tok/s |
|---|---|---|---|---|---|---|---|"
for r in "${ROWS[@]}"; do TABLE+=$'\n'"$r"; done

{
    echo "# fitlm training throughput vs PyTorch"
    echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "- CPU: $CPU, $(nproc) CPUs (${ISA_NOTE% }), $(awk '/MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo)"
    echo "- command: \`$COMMAND\` (threads $THREADS, $WARMUP warm-up steps, timed steps: $STEPS)"
    echo "- fitlm: GPT-2 124M (L=12, C=768, NH=12, V=50257 padded to 50304, maxT=1024), fp32, random weights and tokens, OMP_WAIT_POLICY ${OMP_WAIT_POLICY:-unset (libgomp default)}"
    echo "- PyTorch: $TORCH_VERSION ($PY), fp32, OMP_WAIT_POLICY=PASSIVE, AdamW default (foreach off), attention as masked softmax"
    echo "- step: zero_grad + forward + backward + clip_grad_norm 1.0 + AdamW (lr 1e-4, betas 0.9/0.95, eps 1e-8, wd 0.1 on matrices)"
    echo "- FLOPs/token = 6*(12*L*C^2 + V*C) + 12*L*T*C (GFLOP/s = FLOPs/token x tok/s)"
    echo "- peak (MFU denominator): $PEAK GFLOP/s fp32 FMA with $THREADS threads ($(field isa "$PEAK_LINE"); 1 thread: $(field gflops_1t "$PEAK_LINE")), measured by bench/peak_fma in this run"
    echo
    echo "$TABLE"
    echo
    echo "Notes (benchmark time ${ELAPSED} s after the peak measurement):"
    echo
    for n in "${NOTES[@]}"; do echo "- $n"; done
    echo
    echo "Raw result lines:"
    echo
    echo '```'
    echo "$PEAK_LINE"
    for r in "${RAW[@]}"; do echo "$r"; done
    echo '```'
} >"$RESULTS"

echo
echo "$TABLE"
echo
for n in "${NOTES[@]}"; do echo "- $n"; done
echo
echo "written to ${RESULTS#"$ROOT"/} (logs in $LOG)"
