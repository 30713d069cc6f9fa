#!/usr/bin/env bash
# bench/train.sh: the training-throughput benchmark, fitlm against PyTorch,
# fp32 and bf16, in one command. Builds the bench programs (Release),
# measures the peaks (bench/peak_fma: fp32 FMA, bf16 dot product vdpbf16ps,
# AMX-BF16), then for each GPT-2 124M shape runs, alternating engines,
# fitlm fp32 (bench/bench_train), PyTorch fp32 (bench/torch_gpt2.py, if
# /usr/bin/python3 has torch), fitlm bf16, PyTorch bf16 autocast; then the
# bytes/param table (bench/memory.sh). Prints markdown tables, also written
# to bench/results.md. See bench/README.md for the columns.
#
#   bench/train.sh                      # the default run, ~7 minutes when idle
#   SHAPES="4x64" bench/train.sh        # only B=4,T=64
#
# Environment knobs (defaults in brackets):
#   SHAPES      "BxT ..." shapes to run                              ["4x64 8x256"]
#   PRECISIONS  fitlm precisions (PyTorch: fp32 and bf16 only)       ["fp32 bf16"]
#   STEPS       timed steps per fitlm run ("BxT=N ..." or N)         ["4x64=10 8x256=6"]
#   TORCH_STEPS timed steps per PyTorch run (same forms)             [$STEPS]
#   WARMUP      untimed steps before them                            [2]
#   TORCH_BF16_WARMUP  untimed steps for PyTorch bf16 autocast, whose
#               first steps are slow while oneDNN builds its kernels [4]
#   THREADS     threads for every engine                             [2]
#   IDLE_WAIT   seconds to wait, before each run, for the machine to go idle [60]
#   NO_TORCH    1 = skip PyTorch                                     [0]
#   NO_MEMORY   1 = skip the bytes/param table (bench/memory.sh)     [0]
#   BUILD       build directory                                      [build]
#   RESULTS     where the markdown goes                              [bench/results.md]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

COMMAND="bench/train.sh${*:+ $*}"
for v in SHAPES PRECISIONS STEPS TORCH_STEPS WARMUP TORCH_BF16_WARMUP THREADS IDLE_WAIT NO_TORCH NO_MEMORY BUILD; do
    if [[ -n ${!v+x} ]]; then COMMAND="$v=\"${!v}\" $COMMAND"; fi
done

SHAPES=${SHAPES:-"4x64 8x256"}
PRECISIONS=${PRECISIONS:-"fp32 bf16"}
STEPS=${STEPS:-"4x64=10 8x256=6"}
TORCH_STEPS=${TORCH_STEPS:-$STEPS}
WARMUP=${WARMUP:-2}
TORCH_BF16_WARMUP=${TORCH_BF16_WARMUP:-4}
THREADS=${THREADS:-2}
IDLE_WAIT=${IDLE_WAIT:-60}
NO_TORCH=${NO_TORCH:-0}
NO_MEMORY=${NO_MEMORY:-0}
BUILD=${BUILD:-build}
RESULTS=${RESULTS:-$ROOT/bench/results.md}
PY=/usr/bin/python3

LOG=$(mktemp -d "${TMPDIR:-/tmp}/fitlm-bench.XXXXXX")
echo "== logs in $LOG"

steps_for() { # steps_for BxT SPEC
    local s
    if [[ $2 =~ ^[0-9]+$ ]]; then echo "$2"; return; fi
    for s in $2; do
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
echo "== build (Release, $BUILD)"
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD" -j "$(nproc)" --target peak_fma bench_train fitlm >"$LOG/build.log" 2>&1 ||
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

echo "== peaks: fp32 FMA, bf16 dot product, AMX-BF16 (idle wait: $(wait_idle)% busy)"
run_measured peak "./$BUILD/peak_fma" --threads "$THREADS"
cat "$LOG/peak.log"
PEAK_LINE=$(grep '^RESULT peak_fma' "$LOG/peak.log")
PEAK=$(field peak_gflops "$PEAK_LINE")
PEAK_BF16=$(field bf16_peak_gflops "$PEAK_LINE")
PEAK_AMX=$(field amx_peak_gflops "$PEAK_LINE")
[[ $PEAK_BF16 == "?" ]] && PEAK_BF16=0
[[ $PEAK_AMX == "?" ]] && PEAK_AMX=0
PEAKS=(--peak "$PEAK" --peak-bf16 "$PEAK_BF16" --peak-amx "$PEAK_AMX")

# the runs of one shape, engines alternating: fitlm P, PyTorch P for each P
runs_for_shape() {
    local p
    for p in $PRECISIONS; do
        echo "fitlm:$p"
        if ((TORCH)) && [[ $p == fp32 || $p == bf16 ]]; then echo "pytorch:$p"; fi
    done
}

declare -a ROWS NOTES RAW
PROFILES=""
declare -A LINE=()
START=$SECONDS
for shape in $SHAPES; do
    B=${shape%x*} T=${shape#*x}
    mapfile -t runs < <(runs_for_shape)
    for run in "${runs[@]}"; do
        eng=${run%%:*} prec=${run#*:}
        if [[ $eng == fitlm ]]; then
            N=$(steps_for "$shape" "$STEPS") W=$WARMUP
        else
            N=$(steps_for "$shape" "$TORCH_STEPS") W=$WARMUP
            [[ $prec == bf16 ]] && W=$TORCH_BF16_WARMUP
        fi
        args=(--B "$B" --T "$T" --steps "$N" --warmup "$W" --threads "$THREADS" --precision "$prec" "${PEAKS[@]}")
        idle=$(wait_idle)
        echo "== $eng $prec B=$B T=$T: $N timed steps after $W warm-up (machine ${idle}% busy before)"
        name="${eng}_${prec}_${B}x${T}"
        if [[ $eng == fitlm ]]; then
            run_measured "$name" timeout 900 "./$BUILD/bench_train" "${args[@]}" || true
        else
            run_measured "$name" timeout 900 env OMP_WAIT_POLICY=PASSIVE "$PY" bench/torch_gpt2.py "${args[@]}" || true
        fi
        line=$(grep '^RESULT ' "$LOG/$name.log" || true)
        if [[ -z $line ]]; then
            echo "   FAILED: see $LOG/$name.log"
            tail -5 "$LOG/$name.log"
            line="RESULT engine=$eng precision=$prec B=$B T=$T failed=1"
        else
            grep '^median' "$LOG/$name.log"
        fi
        # bench_train's per-op table: its header line, a blank line (markdown), the table
        if [[ $eng == fitlm ]] && grep -q '^per-op profile' "$LOG/$name.log"; then
            PROFILES+="### fitlm $prec, B=$B, T=$T"$'\n\n'
            PROFILES+=$(awk '/^per-op profile/ { print; print ""; on = 1; next }
                             on && /^\|/ { print } on && !/^\|/ { on = 0 }' "$LOG/$name.log")
            PROFILES+=$'\n\n'
        fi
        LINE[$shape:$run]=$line
        RAW+=("$line")
        note="$eng $prec B=$B T=$T ($N timed steps after $W warm-up): machine ${idle}% busy before the run; other processes took ~$(cat "$LOG/$name.other")% of the CPUs during it; loss $(field loss_first "$line") -> $(field loss_last "$line"); fwd/bwd/clip+adamw median $(field ms_fwd "$line")/$(field ms_bwd "$line")/$(field ms_opt "$line") ms"
        [[ $prec == fp16 ]] && note+="; fp16 steps skipped for overflow: $(field skipped "$line")"
        NOTES+=("$note")
    done
    for run in "${runs[@]}"; do
        eng=${run%%:*} prec=${run#*:}
        l=${LINE[$shape:$run]}
        if [[ $(field failed "$l") == 1 ]]; then
            ROWS+=("| B=$B, T=$T | $eng | $prec | failed | | | | | | | |")
            continue
        fi
        # bf16 (fp16) / fp32 of the same engine; fitlm / PyTorch of the same precision
        lowp="—" vs="—"
        f32=${LINE[$shape:$eng:fp32]:-}
        if [[ $prec != fp32 && -n $f32 && $(field failed "$f32") != 1 ]]; then
            lowp=$(awk -v a="$(field tok_s "$l")" -v b="$(field tok_s "$f32")" 'BEGIN { printf "%.2f", a / b }')
        fi
        pt=${LINE[$shape:pytorch:$prec]:-}
        if [[ $eng == fitlm && -n $pt && $(field failed "$pt") != 1 ]]; then
            vs=$(awk -v a="$(field tok_s "$l")" -v b="$(field tok_s "$pt")" 'BEGIN { printf "%.2f", a / b }')
        fi
        ROWS+=("$(awk -v B="$B" -v T="$T" -v e="$eng" -v p="$prec" -v med="$(field ms_median "$l")" \
            -v lo="$(field ms_min "$l")" -v hi="$(field ms_max "$l")" -v tok="$(field tok_s "$l")" \
            -v gf="$(field gflops "$l")" -v mfu="$(field mfu "$l")" -v pk="$(field peak "$l")" \
            -v amx="$(field mfu_amx "$l")" -v rss="$(field peak_rss_mib "$l")" \
            -v r1="$lowp" -v r2="$vs" 'BEGIN {
                a = (p != "bf16" || amx + 0 <= 0) ? "—" : sprintf("%.1f%%", 100 * amx)
                printf "| B=%d, T=%d | %s | %s | %.0f (%.0f-%.0f) | %.1f | %.1f | %.1f%% (%s) | %s | %.2f GiB | %s | %s |",
                    B, T, e, p, med, lo, hi, tok, gf, 100 * mfu, pk, a, rss / 1024, r1, r2 }')")
    done
done
ELAPSED=$((SECONDS - START))

TABLE="| shape | engine | precision | ms/step median (min-max) | tok/s | GFLOP/s | MFU (peak) | MFU vs AMX | peak RSS | bf16/fp32 tok/s (same engine) | fitlm/PyTorch tok/s (same precision) |
|---|---|---|---|---|---|---|---|---|---|---|"
for r in "${ROWS[@]}"; do TABLE+=$'\n'"$r"; done

# the issue's target: fitlm bf16 >= 1.5x fitlm fp32 tokens/s (at every shape run)
TARGET=""
for shape in $SHAPES; do
    a=${LINE[$shape:fitlm:bf16]:-} b=${LINE[$shape:fitlm:fp32]:-}
    [[ -z $a || -z $b || $(field failed "$a") == 1 || $(field failed "$b") == 1 ]] && continue
    TARGET+=$(awk -v s="$shape" -v a="$(field tok_s "$a")" -v b="$(field tok_s "$b")" \
        'BEGIN { r = a / b; printf "- fitlm bf16 / fitlm fp32 tokens/s at %s: %.2f (target >= 1.5: %s)\n", s, r, (r >= 1.5 ? "met" : "NOT met") }')$'\n'
done

MEMORY=""
if [[ $NO_MEMORY != 1 ]]; then
    echo "== bytes/param by precision and optimizer (bench/memory.sh)"
    MEM_LOG=$LOG/memory
    mkdir -p "$MEM_LOG"
    if NO_BUILD=1 BUILD=$BUILD THREADS=$THREADS LOG=$MEM_LOG MEM_OUT=$MEM_LOG.md bench/memory.sh >/dev/null; then
        MEMORY=$(cat "$MEM_LOG.md")
    else
        MEMORY="bench/memory.sh failed: see $LOG/memory"
    fi
fi
TOTAL=$SECONDS

{
    echo "# fitlm training throughput vs PyTorch, fp32 and bf16"
    echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "- CPU: $CPU, $(nproc) CPUs (${ISA_NOTE% }), $(awk '/MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo)"
    echo "- command: \`$COMMAND\` (threads $THREADS; timed steps fitlm: $STEPS, PyTorch: $TORCH_STEPS; warm-up steps $WARMUP, PyTorch bf16 $TORCH_BF16_WARMUP); whole run ${TOTAL} s"
    echo "- fitlm: GPT-2 124M (L=12, C=768, NH=12, V=50257 padded to 50304, maxT=1024), random weights, one batch of GPT-2 tokens of the Brown corpus (the first B windows of data/brown_gpt2), OMP_WAIT_POLICY ${OMP_WAIT_POLICY:-unset (libgomp default)}; fp32: OpenBLAS sgemm; bf16: mixed precision (bf16 weights, activations, gradients; fp32 master weights and AdamW state), GEMMs through oneDNN (AMX on this CPU)"
    echo "- PyTorch: $TORCH_VERSION ($PY), OMP_WAIT_POLICY=PASSIVE, AdamW default (foreach off), attention as masked softmax; fp32, or bf16 = \`torch.autocast('cpu', dtype=torch.bfloat16)\` around forward + loss (fp32 parameters, gradients and AdamW state)"
    echo "- step: zero_grad + forward + backward + clip_grad_norm 1.0 + AdamW (lr 1e-4, betas 0.9/0.95, eps 1e-8, wd 0.1 on matrices)"
    echo "- FLOPs/token = 6*(12*L*C^2 + V*C) + 12*L*T*C (GFLOP/s = FLOPs/token x tok/s)"
    echo "- peaks, measured by bench/peak_fma in this run with $THREADS threads (1 thread in brackets): fp32 FMA $PEAK GFLOP/s ($(field isa "$PEAK_LINE"); $(field gflops_1t "$PEAK_LINE")), bf16 dot product $PEAK_BF16 GFLOP/s (vdpbf16ps; $(field bf16_gflops_1t "$PEAK_LINE")), AMX-BF16 $PEAK_AMX GFLOP/s (tdpbf16ps; $(field amx_gflops_1t "$PEAK_LINE"))"
    echo "- MFU (peak): against the fp32 FMA peak for fp32 rows, against the bf16 dot-product (vdpbf16ps) peak for bf16 rows; MFU vs AMX: bf16 rows against the AMX-BF16 peak. On this CPU vdpbf16ps issues at half the fp32 FMA rate, so a bf16 step whose GEMMs run on AMX exceeds 100% of the vdpbf16ps peak."
    echo
    echo "$TABLE"
    echo
    [[ -n $TARGET ]] && echo "$TARGET"
    echo "Notes (benchmark time ${ELAPSED} s after the peak measurement):"
    echo
    for n in "${NOTES[@]}"; do echo "- $n"; done
    echo
    if [[ -n $PROFILES ]]; then
        echo "## Per-op profile of the fitlm runs"
        echo
        echo "Per timed step, by op (bench_train's table, as \`fitlm train --profile\` prints it; columns in bench/README.md)."
        echo
        printf '%s' "$PROFILES"
    fi
    if [[ -n $MEMORY ]]; then
        echo "## Bytes per parameter by precision and optimizer"
        echo
        echo "$MEMORY"
        echo
    fi
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
[[ -n $TARGET ]] && echo "$TARGET"
for n in "${NOTES[@]}"; do echo "- $n"; done
if [[ -n $MEMORY ]]; then echo; echo "$MEMORY"; fi
echo
echo "written to ${RESULTS#"$ROOT"/} (logs in $LOG; whole run ${TOTAL} s)"
