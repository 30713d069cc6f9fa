#!/usr/bin/env bash
# bench/train.sh: the training-throughput benchmark, fitlm against PyTorch,
# fp32, bf16 and fp16, in one command. Builds the bench programs (Release),
# measures the peaks (bench/peak_fma: fp32 FMA, bf16 dot product vdpbf16ps,
# AMX-BF16, memory bandwidth), then for each shape (GPT-2 124M at two batch shapes, a LLaMA of
# similar cost) runs, alternating engines, fitlm fp32 (bench/bench_train,
# which also times the step's GEMM shapes with OpenBLAS's and oneDNN's sgemm
# for the GEMM-bound time), PyTorch fp32 (bench/torch_gpt2.py, if
# /usr/bin/python3 has torch), fitlm bf16, PyTorch bf16 autocast, fitlm
# fp16; then fitlm fp32 on one thread (thread scaling, per op family), fitlm
# and PyTorch fp32 beside one busy process (slowdown under load), and the
# bytes/param table (bench/memory.sh). Prints markdown tables, also written
# to bench/results.md. See bench/README.md for the columns.
#
#   bench/train.sh                      # the default run, ~25 minutes when idle
#   SHAPES="4x64" bench/train.sh        # only GPT-2 at B=4,T=64
#   FITLM_ISA=avx2 bench/train.sh       # fitlm capped to its AVX2 paths
#                                       # (OpenBLAS's Haswell kernels, no bf16 GEMM)
#
# Environment knobs (defaults in brackets):
#   SHAPES      "[llama:]BxT ..." shapes to run            ["4x64 8x256 llama:4x64"]
#   LLAMA       bench_train/torch_gpt2.py options of the LLaMA shape
#               ["--arch llama --L 30 --C 576 --NH 9 --kv-heads 3 --I 1536": SmolLM-135M's blocks, untied head]
#   PRECISIONS  fitlm precisions (PyTorch: fp32 and bf16 only)       ["fp32 bf16 fp16"]
#   STEPS       timed steps per fitlm run ("SHAPE=N ..." or N)       ["4x64=10 8x256=6"; 5 otherwise]
#   SCALING     1 = also fitlm fp32 on 1 thread, for each shape      [1]
#   BUSY        1 = also fitlm and PyTorch fp32 beside one busy
#               process, at each of BUSY_SHAPES                      [1]
#   BUSY_SHAPES the shapes of SHAPES run beside the busy process     [GPT-2's]
#   ROUNDS      runs of each engine and precision, the sequence of a
#               shape repeated in turn (the busy runs too); the run with
#               the median ms/step is reported (its range over the runs
#               beside it)                                           [1]
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
for v in SHAPES LLAMA PRECISIONS STEPS ROUNDS SCALING BUSY BUSY_SHAPES TORCH_STEPS WARMUP TORCH_BF16_WARMUP THREADS IDLE_WAIT NO_TORCH NO_MEMORY BUILD; do
    if [[ -n ${!v+x} ]]; then COMMAND="$v=\"${!v}\" $COMMAND"; fi
done

SHAPES=${SHAPES:-"4x64 8x256 llama:4x64"}
LLAMA=${LLAMA:-"--arch llama --L 30 --C 576 --NH 9 --kv-heads 3 --I 1536"}
PRECISIONS=${PRECISIONS:-"fp32 bf16 fp16"}
SCALING=${SCALING:-1}
BUSY=${BUSY:-1}
# by default the GPT-2 shapes: the first one's short parallel regions and the
# second's long ones meet the busy process differently
if [[ -z ${BUSY_SHAPES+x} ]]; then
    BUSY_SHAPES=""
    for s in $SHAPES; do [[ $s == llama:* ]] || BUSY_SHAPES+="${BUSY_SHAPES:+ }$s"; done
fi
STEPS=${STEPS:-"4x64=10 8x256=6"}
ROUNDS=${ROUNDS:-1}
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
for f in avx2 fma f16c avx512f avx512_bf16 amx_bf16; do
    if [[ " $FLAGS " == *" $f "* ]]; then ISA_NOTE+="$f "; fi
done
MEM_GIB=$(awk '/MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo)
# what fitlm runs on: FITLM_ISA caps its kernels (and picks OpenBLAS's AVX2
# kernels, see fl_runtime_env); a figure taken under a cap is that cap's
if [[ -n ${FITLM_ISA:-} && $FITLM_ISA != avx512 ]]; then
    ISA_PATHS="fitlm capped to FITLM_ISA=$FITLM_ISA, OpenBLAS core ${OPENBLAS_CORETYPE:-Haswell}"
else
    ISA_PATHS="fitlm on the CPU's own paths, OpenBLAS core ${OPENBLAS_CORETYPE:-as detected, or SkylakeX/Haswell where it falls back to SSE3 (fitlm and PyTorch alike)}"
fi
# an OPENBLAS_CORETYPE the machine sets for every process (some hosts set
# Haswell on AVX-512 CPUs) holds OpenBLAS, and PyTorch's GEMMs with it, to
# those kernels: the figures are then that setting's
if [[ -n ${OPENBLAS_CORETYPE:-} ]]; then
    ISA_PATHS+=" (OPENBLAS_CORETYPE=$OPENBLAS_CORETYPE from the environment)"
    echo "note: OPENBLAS_CORETYPE=$OPENBLAS_CORETYPE from the environment: OpenBLAS and PyTorch's GEMMs run on those kernels (unset it to let fitlm choose)" >&2
fi

echo "== peaks: fp32 FMA, bf16 dot product, AMX-BF16 (idle wait: $(wait_idle)% busy)"
run_measured peak "./$BUILD/peak_fma" --threads "$THREADS"
cat "$LOG/peak.log"
PEAK_LINE=$(grep '^RESULT peak_fma' "$LOG/peak.log")
PEAK=$(field peak_gflops "$PEAK_LINE")
PEAK_BF16=$(field bf16_peak_gflops "$PEAK_LINE")
PEAK_AMX=$(field amx_peak_gflops "$PEAK_LINE")
[[ $PEAK_BF16 == "?" ]] && PEAK_BF16=0
# the read-modify-write stream's bandwidth, what the optimizer update is bound by
BW=$(field bw_peak_gbs "$PEAK_LINE")
[[ $BW == "?" ]] && BW=0
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

# shape_args SHAPE: the model options of "[llama:]BxT" (GPT-2 124M: the defaults)
shape_args() {
    if [[ $1 == llama:* ]]; then echo "$LLAMA"; fi
}

# shape_label SHAPE: "B=4, T=64" or "LLaMA, B=4, T=64", as the tables name a shape
shape_label() {
    local bt=${1#*:}
    if [[ $1 == llama:* ]]; then echo -n "LLaMA, "; fi
    echo "B=${bt%x*}, T=${bt#*x}"
}

# fair_share_floor U THREADS CPUS: the least slowdown beside one busy
# process of a step that kept U CPUs busy idle, split into a one-thread part
# and a part on all of m = min(THREADS, CPUS), when the scheduler shares the
# CPUs equally among runnable threads (the parallel part then gets g =
# min(THREADS, CPUS * THREADS / (THREADS + 1)) CPUs); "—" when U is unknown
fair_share_floor() {
    awk -v u="$1" -v t="$2" -v c="$3" 'BEGIN {
        if (u !~ /^[0-9.]+$/ || t < 2 || c < 2) { print "—"; exit }
        m = t < c ? t : c; g = c * t / (t + 1); if (g > t) g = t
        p = (u - 1) / (m - 1); if (p < 0) p = 0; if (p > 1) p = 1
        printf "%.2f", (1 - p) + p * m / g }'
}

# run_one NAME ENGINE PREC SHAPE THREADS BUSY: one bench run, its RESULT line
# (or a failed= line) on stdout; the log in $LOG/NAME.log
run_one() {
    local name=$1 eng=$2 prec=$3 shape=$4 threads=$5 busy=$6
    local bt=${shape#*:} N W line pids=() i
    local B=${bt%x*} T=${bt#*x}
    if [[ $eng == fitlm ]]; then
        N=$(steps_for "$shape" "$STEPS") W=$WARMUP
    else
        N=$(steps_for "$shape" "$TORCH_STEPS") W=$WARMUP
        [[ $prec == bf16 ]] && W=$TORCH_BF16_WARMUP
    fi
    # shellcheck disable=SC2046 # the shape's options are words
    local args=(--B "$B" --T "$T" --steps "$N" --warmup "$W" --threads "$threads" --precision "$prec"
        "${PEAKS[@]}" $(shape_args "$shape"))
    for ((i = 0; i < busy; i++)); do
        sh -c 'while :; do :; done' &
        pids+=($!)
    done
    if [[ $eng == fitlm ]]; then
        run_measured "$name" timeout 1800 "./$BUILD/bench_train" "${args[@]}" || true
        # the OpenBLAS kernels fitlm ran on (fl_runtime_env replaces the
        # generic ones OpenBLAS falls back to on a CPU model it does not know)
        grep -o ' openblas=[^ ]*' "$LOG/$name.log" | cut -d= -f2 >"$LOG/openblas_core" || true
    else
        # PyTorch's fp32 GEMMs are the same OpenBLAS's: the same kernels,
        # unless fitlm runs under an ISA cap
        local core=""
        if [[ -z ${FITLM_ISA:-} || $FITLM_ISA == avx512 ]]; then core=$(cat "$LOG/openblas_core" 2>/dev/null || true); fi
        run_measured "$name" timeout 1800 env OMP_WAIT_POLICY=PASSIVE ${core:+OPENBLAS_CORETYPE=$core} "$PY" bench/torch_gpt2.py "${args[@]}" || true
    fi
    if ((${#pids[@]})); then kill "${pids[@]}" 2>/dev/null || true; wait "${pids[@]}" 2>/dev/null || true; fi
    line=$(grep '^RESULT engine' "$LOG/$name.log" || true)
    if [[ -z $line ]]; then
        echo "   FAILED: see $LOG/$name.log" >&2
        tail -5 "$LOG/$name.log" >&2
        line="RESULT engine=$eng precision=$prec B=$B T=$T failed=1"
    fi
    echo "$line steps_run=$N warmup_run=$W"
}

# op_rows LOG: "op<TAB>total ms" for each row of bench_train's per-op table
op_rows() {
    awk -F'|' '/^per-op profile/ { on = 1; next }
               on && !/^\|/ { exit }
               on { op = $2; gsub(/^ +| +$/, "", op); t = $6; gsub(/ /, "", t)
                    if (op != "op" && op !~ /^:/ && op != "total") print op "\t" t }' "$1" |
        LC_ALL=C sort -t $'\t' -k1,1
}

declare -a ROWS NOTES RAW
PROFILES="" GEMM_ROWS="" SCALE_TABLES="" BUSY_ROWS="" BUSY_TARGET=""
declare -A LINE=() FP32_LOG=()
START=$SECONDS
for shape in $SHAPES; do
    bt=${shape#*:}
    B=${bt%x*} T=${bt#*x}
    label=$(shape_label "$shape")
    mapfile -t runs < <(runs_for_shape)
    declare -A ROUND_LINES=() ROUND_NAMES=()
    for ((round = 1; round <= ROUNDS; round++)); do
        for run in "${runs[@]}"; do
            eng=${run%%:*} prec=${run#*:}
            idle=$(wait_idle)
            echo "== $eng $prec $label, round $round of $ROUNDS (machine ${idle}% busy before)"
            name="${eng}_${prec}_${shape/:/_}"
            ((ROUNDS > 1)) && name+="_r$round"
            line=$(run_one "$name" "$eng" "$prec" "$shape" "$THREADS" 0)
            grep '^median' "$LOG/$name.log" || true
            ROUND_LINES[$run]+="$(field ms_median "$line") $name"$'\n'
            ROUND_NAMES[$name]=$line
            RAW+=("$line")
            note="$eng $prec $label, round $round ($(field steps_run "$line") timed steps after $(field warmup_run "$line") warm-up): machine ${idle}% busy before the run; other processes took ~$(cat "$LOG/$name.other")% of the CPUs during it; loss $(field loss_first "$line") -> $(field loss_last "$line"); fwd/bwd/clip+adamw median $(field ms_fwd "$line")/$(field ms_bwd "$line")/$(field ms_opt "$line") ms"
            [[ $prec == fp16 ]] && note+="; fp16 steps skipped for overflow: $(field skipped "$line")"
            NOTES+=("$note")
        done
    done
    # each engine and precision: the run of median ms/step (a failed run's
    # "?" sorts first), and the range of the runs' medians
    declare -A SPREAD=()
    for run in "${runs[@]}"; do
        eng=${run%%:*} prec=${run#*:}
        mapfile -t sorted < <(printf '%s' "${ROUND_LINES[$run]}" | sort -g)
        name=${sorted[$(((${#sorted[@]} - 1) / 2))]#* }
        line=${ROUND_NAMES[$name]}
        SPREAD[$run]="${sorted[0]%% *}-${sorted[${#sorted[@]} - 1]%% *}"
        # bench_train's per-op table: its header line, a blank line (markdown), the table
        if [[ $eng == fitlm ]] && grep -q '^per-op profile' "$LOG/$name.log"; then
            PROFILES+="### fitlm $prec, $label"$'\n\n'
            PROFILES+=$(awk '/^per-op profile/ { print; print ""; on = 1; next }
                             on && /^\|/ { print } on && !/^\|/ { on = 0 }' "$LOG/$name.log")
            PROFILES+=$'\n\n'
        fi
        if [[ $eng == fitlm && $prec == fp32 && $(field gemm_bound_ms "$line") != "?" ]]; then
            GEMM_ROWS+=$(awk -v s="$label" -v ms="$(field ms_median "$line")" -v gb="$(field gemm_bound_ms "$line")" \
                -v gf="$(field gemm_fitlm_ms "$line")" -v best="$(field sgemm_best_gflops "$line")" \
                -v fl="$(field gemm_flops_step "$line")" -v opt="$(field ms_opt "$line")" \
                -v np="$(field params "$line")" 'BEGIN {
                    # clip + AdamW moves 32 bytes per parameter (the norm
                    # reads the gradient; the update reads weight, gradient,
                    # m and v, writes weight, m and v): its GB/s
                    gbs = (np + 0 > 0 && opt > 0) ? sprintf("%.0f", np * 32 / (opt * 1e6)) : "?"
                    # the step holds these GEMMs and more: a step faster than
                    # fitlm'"'"'s GEMMs alone (best of 7 each) means the GEMM
                    # timings were disturbed, and so may the bound be
                    v = ms < gf ? "unreliable: the step ran faster than fitlm'"'"'s GEMMs alone (disturbed GEMM timings)" \
                        : ms / gb <= 1.15 ? "met" : "NOT met"
                    printf "| %s | %.1f | %.0f | %.1f | %.0f | %.0f | %.2f | %s | %.0f | %s | %.2f |\n", s, fl / 1e9, best, gb, gf, ms,
                        ms / gb, v, opt, gbs, (gb + opt) / gb }')$'\n'
        fi
        LINE[$shape:$run]=$line
        # the one-thread run compares with this one's log
        [[ $run == fitlm:fp32 ]] && FP32_LOG[$shape]="$LOG/$name.log"
    done
    for run in "${runs[@]}"; do
        eng=${run%%:*} prec=${run#*:}
        l=${LINE[$shape:$run]}
        if [[ $(field failed "$l") == 1 ]]; then
            ROWS+=("| $label | $eng | $prec | failed | | | | | | | |")
            continue
        fi
        # bf16 (fp16) / fp32 of the same engine; fitlm / PyTorch fp32 and of the same precision
        lowp="—" vs="—"
        f32=${LINE[$shape:$eng:fp32]:-}
        if [[ $prec != fp32 && -n $f32 && $(field failed "$f32") != 1 ]]; then
            lowp=$(awk -v a="$(field tok_s "$l")" -v b="$(field tok_s "$f32")" 'BEGIN { printf "%.2f", a / b }')
        fi
        pt=${LINE[$shape:pytorch:$prec]:-}
        pt32=${LINE[$shape:pytorch:fp32]:-}
        if [[ $eng == fitlm && -n $pt && $(field failed "$pt") != 1 ]]; then
            vs=$(awk -v a="$(field tok_s "$l")" -v b="$(field tok_s "$pt")" 'BEGIN { printf "%.2f", a / b }')
        fi
        vs32="—"
        if [[ $eng == fitlm && -n $pt32 && $(field failed "$pt32") != 1 ]]; then
            vs32=$(awk -v a="$(field tok_s "$l")" -v b="$(field tok_s "$pt32")" 'BEGIN { printf "%.2f", a / b }')
        fi
        # the range: of the run's steps, or with ROUNDS > 1 of the runs' medians
        lo=$(field ms_min "$l") hi=$(field ms_max "$l")
        if ((ROUNDS > 1)); then lo=${SPREAD[$run]%-*} hi=${SPREAD[$run]#*-}; fi
        ROWS+=("$(awk -v s="$label" -v e="$eng" -v p="$prec" -v med="$(field ms_median "$l")" \
            -v lo="$lo" -v hi="$hi" -v tok="$(field tok_s "$l")" \
            -v gf="$(field gflops "$l")" -v mfu="$(field mfu "$l")" -v pk="$(field peak "$l")" \
            -v rss="$(field peak_rss_mib "$l")" \
            -v r1="$lowp" -v r2="$vs" -v r3="$vs32" 'BEGIN {
                printf "| %s | %s | %s | %.0f (%.0f-%.0f) | %.1f | %.1f | %.1f%% (%s) | %.2f GiB | %s | %s | %s |",
                    s, e, p, med, lo, hi, tok, gf, 100 * mfu, pk, rss / 1024, r1, r3, r2 }')")
    done
    # thread scaling: fitlm fp32 on one thread against the run above, per op family
    two=${LINE[$shape:fitlm:fp32]:-}
    if [[ $SCALING == 1 && $THREADS != 1 && -n $two && $(field failed "$two") != 1 ]]; then
        idle=$(wait_idle)
        echo "== fitlm fp32 $label on 1 thread (machine ${idle}% busy before)"
        name="fitlm_fp32_${shape/:/_}_1t"
        one=$(run_one "$name" fitlm fp32 "$shape" 1 0)
        RAW+=("$one")
        if [[ $(field failed "$one") != 1 ]]; then
            SCALE_TABLES+="### fitlm fp32, $label: 1 thread against $THREADS (ms per step)"$'\n\n'
            SCALE_TABLES+="| op family | 1 thread | $THREADS threads | speed-up |"$'\n'"|---|---:|---:|---:|"$'\n'
            SCALE_TABLES+=$(LC_ALL=C join -t $'\t' <(op_rows "$LOG/$name.log") \
                <(op_rows "${FP32_LOG[$shape]}") |
                sort -t $'\t' -k2 -gr | awk -F'\t' '{ printf "| %s | %.1f | %.1f | %.2f |\n", $1, $2, $3, ($3 > 0 ? $2 / $3 : 0) }')
            SCALE_TABLES+=$'\n'$(awk -v a="$(field ms_median "$one")" -v b="$(field ms_median "$two")" \
                'BEGIN { printf "| **step** | %.1f | %.1f | %.2f |", a, b, a / b }')$'\n\n'
        fi
    fi
done
# slowdown beside one busy process, fp32, for both engines, at BUSY_SHAPES
if [[ $BUSY == 1 ]]; then
    # ROUNDS runs per engine and shape, in turn, as for the idle runs: the
    # run of median ms/step, and the range of the runs' medians
    declare -A BUSY_RUNS=() BUSY_LINES=() SLOWDOWN=() FLOOR=()
    for ((round = 1; round <= ROUNDS; round++)); do
        for shape in $BUSY_SHAPES; do
            for eng in fitlm pytorch; do
                [[ $eng == pytorch ]] && ((!TORCH)) && continue
                base=${LINE[$shape:$eng:fp32]:-}
                [[ -z $base || $(field failed "$base") == 1 ]] && continue
                idle=$(wait_idle)
                echo "== $eng fp32 $(shape_label "$shape") beside one busy process, round $round of $ROUNDS (machine ${idle}% busy before)"
                name="${eng}_fp32_${shape/:/_}_busy"
                ((ROUNDS > 1)) && name+="_r$round"
                l=$(run_one "$name" "$eng" fp32 "$shape" "$THREADS" 1)
                RAW+=("$l")
                [[ $(field failed "$l") == 1 ]] && continue
                BUSY_RUNS[$shape:$eng]+="$(field ms_median "$l") $name"$'\n'
                BUSY_LINES[$name]=$l
            done
        done
    done
    for shape in $BUSY_SHAPES; do
        label=$(shape_label "$shape")
        for eng in fitlm pytorch; do
            [[ -z ${BUSY_RUNS[$shape:$eng]:-} ]] && continue
            mapfile -t sorted < <(printf '%s' "${BUSY_RUNS[$shape:$eng]}" | sort -g)
            l=${BUSY_LINES[${sorted[$(((${#sorted[@]} - 1) / 2))]#* }]}
            # the range: of the run's steps, or with ROUNDS > 1 of the runs' medians
            lo=$(field ms_min "$l") hi=$(field ms_max "$l")
            if ((ROUNDS > 1)); then lo=${sorted[0]%% *} hi=${sorted[${#sorted[@]} - 1]%% *}; fi
            a=$(field ms_median "$l") b=$(field ms_median "${LINE[$shape:$eng:fp32]}")
            u=$(field cpus "${LINE[$shape:$eng:fp32]}")
            SLOWDOWN[$eng]=$(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.2f", a / b }')
            FLOOR[$eng]=$(fair_share_floor "$u" "$THREADS" "$(nproc)")
            BUSY_ROWS+=$(awk -v s="$label" -v e="$eng" -v a="$a" -v lo="$lo" -v hi="$hi" -v b="$b" -v r="${SLOWDOWN[$eng]}" -v u="$u" -v f="${FLOOR[$eng]}" \
                'BEGIN { printf "| %s | %s | %.0f | %s | %.0f (%.0f-%.0f) | %s | %s |\n", s, e, b, u, a, lo, hi, r, f }')$'\n'
        done
        if [[ -n ${SLOWDOWN[fitlm]:-} && -n ${SLOWDOWN[pytorch]:-} ]]; then
            BUSY_TARGET+=$(awk -v s="$label" -v f="${SLOWDOWN[fitlm]}" -v p="${SLOWDOWN[pytorch]}" -v ff="${FLOOR[fitlm]}" -v fp="${FLOOR[pytorch]}" \
                'BEGIN { printf "- fitlm slowdown beside a busy process at %s: %.2f, PyTorch %.2f (target <= PyTorch: %s); fair-share floors %s and %s\n", s, f, p, (f <= p ? "met" : "NOT met"), ff, fp }')$'\n'
        fi
        SLOWDOWN=() FLOOR=()
    done
fi
ELAPSED=$((SECONDS - START))

TABLE="| shape | engine | precision | ms/step median (min-max) | tok/s | GFLOP/s | MFU (peak) | peak RSS | 16-bit/fp32 tok/s (same engine) | fitlm/PyTorch fp32 tok/s | fitlm/PyTorch tok/s (same precision) |
|---|---|---|---|---|---|---|---|---|---|---|"
for r in "${ROWS[@]}"; do TABLE+=$'\n'"$r"; done

# the targets: fitlm >= 2x PyTorch fp32; 16-bit >= fp32 (>= 2.5x with a bf16 GEMM)
TARGET=""
for shape in $SHAPES; do
    label=$(shape_label "$shape")
    b=${LINE[$shape:fitlm:fp32]:-} pt=${LINE[$shape:pytorch:fp32]:-}
    [[ -z $b || $(field failed "$b") == 1 ]] && continue
    if [[ -n $pt && $(field failed "$pt") != 1 ]]; then
        TARGET+=$(awk -v s="$label" -v a="$(field tok_s "$b")" -v b="$(field tok_s "$pt")" \
            'BEGIN { r = a / b; printf "- fitlm fp32 / PyTorch fp32 tokens/s at %s: %.2f (target >= 2: %s)\n", s, r, (r >= 2 ? "met" : "NOT met") }')$'\n'
    fi
    for p in bf16 fp16; do
        a=${LINE[$shape:fitlm:$p]:-}
        [[ -z $a || $(field failed "$a") == 1 ]] && continue
        # with a native bf16 GEMM (oneDNN on avx512_bf16/AMX) bf16 must be >= 2.5x fp32, else >= 1x
        want=1
        [[ $p == bf16 && $(field gemm "$a") == onednn ]] && want=2.5
        TARGET+=$(awk -v s="$label" -v p="$p" -v w="$want" -v a="$(field tok_s "$a")" -v b="$(field tok_s "$b")" \
            'BEGIN { r = a / b; printf "- fitlm %s / fitlm fp32 tokens/s at %s: %.2f (target >= %s: %s)\n", p, s, r, w, (r >= w ? "met" : "NOT met") }')$'\n'
    done
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
    echo "# fitlm training throughput vs PyTorch, fp32, bf16 and fp16"
    echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "- CPU: $CPU, $(nproc) CPUs (${ISA_NOTE% }), $MEM_GIB; $ISA_PATHS"
    echo "- command: \`$COMMAND\` (threads $THREADS; timed steps fitlm: $STEPS, PyTorch: $TORCH_STEPS; warm-up steps $WARMUP, PyTorch bf16 $TORCH_BF16_WARMUP); whole run ${TOTAL} s"
    echo "- models: GPT-2 124M (L=12, C=768, NH=12, V=50257 padded to 50304, maxT=1024); LLaMA: \`$LLAMA\` with GPT-2's vocabulary (V=50257, so both engines read the same batch); random weights, one batch of GPT-2 tokens of the Brown corpus (the first B windows of data/brown_gpt2)"
    echo "- fitlm: OMP_WAIT_POLICY ${OMP_WAIT_POLICY:-PASSIVE, the fitlm default}; GEMMs in tiles of fitlm's own GEMM (src/kernels/gemm.c; OpenBLAS sgemm without AVX2), bf16 through oneDNN where its bf16 kernels beat fp32 FMAs: AMX, or avx512_bf16 on AMD (each run's RESULT line: gemm=); bf16/fp16: mixed precision (16-bit weights, activations, gradients; fp32 master weights and AdamW state), converted to fp32 as the GEMM packs them"
    echo "- PyTorch: $TORCH_VERSION ($PY), OMP_WAIT_POLICY=PASSIVE, OPENBLAS_CORETYPE as fitlm ran ($(cat "$LOG/openblas_core" 2>/dev/null || echo "?")), AdamW default (foreach off), attention as masked softmax; fp32, or bf16 = \`torch.autocast('cpu', dtype=torch.bfloat16)\` around forward + loss (fp32 parameters, gradients and AdamW state)"
    echo "- step: zero_grad + forward + backward + clip_grad_norm 1.0 + AdamW (lr 1e-4, betas 0.9/0.95, eps 1e-8, wd 0.1 on matrices)"
    echo "- FLOPs/token = 6 x (the weights of the linear layers, LM head included) + 12*L*T*C (GPT-2: 6*(12*L*C^2 + V*C) + 12*L*T*C; GFLOP/s = FLOPs/token x tok/s)"
    echo "- peaks, measured by bench/peak_fma in this run with $THREADS threads (1 thread in brackets): fp32 FMA $PEAK GFLOP/s ($(field isa "$PEAK_LINE"); $(field gflops_1t "$PEAK_LINE")), bf16 dot product $PEAK_BF16 GFLOP/s (vdpbf16ps; $(field bf16_gflops_1t "$PEAK_LINE")), AMX-BF16 $PEAK_AMX GFLOP/s (tdpbf16ps; $(field amx_gflops_1t "$PEAK_LINE")), memory bandwidth $BW GB/s (read-modify-write stream x = 0.5 x + y; $(field bw_gbs_1t "$PEAK_LINE"))"
    echo "- MFU (peak): against the fp32 FMA peak for fp32 rows, against the bf16 dot-product (vdpbf16ps) peak for 16-bit rows whose GEMMs run on oneDNN's native bf16 (gemm=onednn: AMX, or AVX512_BF16 on AMD), else the fp32 peak; a bf16 step whose GEMMs run on AMX can exceed 100% of the vdpbf16ps peak."
    echo
    echo "$TABLE"
    echo
    [[ -n $TARGET ]] && echo "$TARGET"
    if [[ -n $GEMM_ROWS ]]; then
        echo "## fp32 step against its GEMM-bound time"
        echo
        echo "GEMM-bound time: the step's linear-layer GEMMs (forward, input and weight gradients, N = B*T rows), each timed in this run with OpenBLAS's and oneDNN's sgemm on $THREADS threads, the faster of the two summed (bench_train's table in the log). Attention's products run in fitlm's fused kernel and count as non-GEMM time. Target: step <= 1.15 x GEMM-bound. The last three columns: the step's clip+AdamW phase (median ms), the GB/s at which it moved its 32 bytes per parameter (against the memory bandwidth bench/peak_fma measured at the start, $BW GB/s, a read-modify-write stream: the phase is bound by memory, and a VM's bandwidth can move from run to run), and (GEMM-bound + that phase) / GEMM-bound: the ratio a step would reach with its GEMMs at the best library's rate, that phase as it ran and nothing else."
        echo
        echo "| shape | GEMM GFLOP/step | best sgemm GFLOP/s | GEMM-bound ms | fitlm's GEMMs ms | step ms | step / GEMM-bound | target | clip+AdamW ms | its GB/s | (GEMM-bound + clip+AdamW) / GEMM-bound |"
        echo "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"
        printf '%s' "$GEMM_ROWS"
        echo
    fi
    if [[ -n $SCALE_TABLES ]]; then
        echo "## Thread scaling: 1 thread against $THREADS"
        echo
        echo "fitlm fp32, the same steps on 1 thread, per op family (bench_train's per-op totals per step)."
        echo
        printf '%s' "$SCALE_TABLES"
    fi
    if [[ -n $BUSY_ROWS ]]; then
        echo "## Beside one busy process"
        echo
        echo "fp32 at each of BUSY_SHAPES ($BUSY_SHAPES) with one \`sh -c 'while :; do :; done'\` running on the same $(nproc) CPUs, against the same engine's idle run above."
        echo
        echo "CPUs busy: the idle run's CPU seconds (all its threads) per wall second over its timed steps, u. Fair-share floor: the least slowdown a step that busy can have when the scheduler shares the CPUs equally among runnable threads, for a step made of a one-thread part and a part using all of min(THREADS, CPUs) = m: u = s + m p (s + p = 1), and beside the busy process the parallel part gets min(THREADS, CPUs x THREADS / (THREADS + 1)) = g CPUs, so the floor is s + p m / g (with 2 threads on 2 CPUs, (1 + u) / 2). Above the floor: time the engine's threads lost waiting for each other."
        echo
        echo "| shape | engine | idle ms/step | CPUs busy (idle) | busy ms/step median (min-max) | slowdown | fair-share floor |"
        echo "|---|---|---:|---:|---:|---:|---:|"
        printf '%s' "$BUSY_ROWS"
        echo
        [[ -n $BUSY_TARGET ]] && printf '%s\n' "$BUSY_TARGET"
    fi
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
[[ -n $GEMM_ROWS ]] && printf '%s\n' "$GEMM_ROWS"
[[ -n $SCALE_TABLES ]] && printf '%s' "$SCALE_TABLES"
[[ -n $BUSY_ROWS ]] && printf '%s\n' "$BUSY_ROWS"
[[ -n $BUSY_TARGET ]] && printf '%s\n' "$BUSY_TARGET"
for n in "${NOTES[@]}"; do echo "- $n"; done
if [[ -n $MEMORY ]]; then echo; echo "$MEMORY"; fi
echo
echo "written to ${RESULTS#"$ROOT"/} (logs in $LOG; whole run ${TOTAL} s)"
