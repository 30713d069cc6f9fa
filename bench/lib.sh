# bench/lib.sh: what the benchmark scripts share (sourced, not run): building
# fitlm, the CPU they ran on, reading fitlm's reports, printing a table, the
# GPU scripts' deadline and timed runs.
#   BUILD, LOG, NO_BUILD=1, BENCH_DEADLINE, BENCH_SECONDS as the scripts
#   document them.

# Builds the fitlm target in $BUILD (Release) unless NO_BUILD=1; sets FITLM.
bench_build() {
    if [[ ${NO_BUILD:-0} != 1 ]]; then
        cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null
        cmake --build "$BUILD" -j "$(nproc)" --target fitlm >"$LOG/build.log" 2>&1 ||
            { cat "$LOG/build.log"; exit 1; }
    fi
    FITLM=$BUILD/fitlm
}

# The CPU model and the ISA extensions that choose fitlm's kernels.
bench_cpu() {
    local cpu isa
    cpu=$(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo)
    isa=$(grep -o -w -E 'avx512_bf16|amx_bf16|avx512f|avx2|fma' /proc/cpuinfo | sort -u | tr '\n' ' ')
    echo "CPU: $cpu; ISA: $isa"
}

# tag_peak TAG LOG: the peak (MiB) of TAG in a --mem-report ("total": the peak
# of the tagged total)
tag_peak() {
    awk -v t="$1" '$0 ~ /^memory by tag/ { on = 1 }
        on && $1 == t { v = t == "total" ? $4 : $3 } END { print v + 0 }' "$2"
}

# plan_bytes TAG PLAN: the bytes of TAG in `fitlm plan`'s table
plan_bytes() {
    awk -v t="$1" '$1 == t { print $2; exit }' "$2"
}

# median_min_max: "median min max" of the numbers on stdin, one a line
median_min_max() {
    sort -g | awk '{ v[NR] = $1 } END { if (!NR) { print "- - -"; exit }
        m = NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; print m, v[1], v[NR] }'
}

# step_ms LOG: "median min max" of the per-step times after the first (the
# plain "| 812.3 ms |" of fitlm train's step lines)
step_ms() {
    grep -o '| [0-9.]* ms |' "$1" | awk 'NR > 1 { printf "%.0f\n", $2 }' | median_min_max
}

# mean_ms LOG: the mean of every step's time (the first included: the
# communication line's percent is of all steps)
mean_ms() {
    grep -o '| [0-9.]* ms |' "$1" | awk '{ s += $2; n++ } END { printf "%.1f", n ? s / n : 0 }'
}

# field KEY WORDS...: the value of KEY among "key=value" words ("-": none)
field() {
    local k=$1 w
    shift
    for w in "$@"; do [[ $w == "$k="* ]] && { echo "${w#*=}"; return; }; done
    echo "-"
}

# The test suite's Open MPI environment (shared/reference/mpi.md): root,
# oversubscription, shared memory only, yield when idle, no mmap'd malloc;
# each mpirun ended after MPIEXEC_TIMEOUT seconds (default 900).
bench_mpi_env() {
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl=self,vader OMPI_MCA_mpi_yield_when_idle=1
    export GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967295
    export MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-900}
}

# Writes $LOG/rank.sh: one rank with its own stdout and stderr files and
# /usr/bin/time's report ("user sys maxrss_KiB"), named by
# OMPI_COMM_WORLD_RANK (0 without mpirun): `rank.sh BASE cmd...` writes
# BASE.rR.out, .err and .time. (Under mpirun a rank's stdout is a terminal,
# and fitlm train would print a progress bar instead of its step lines.)
bench_rank_script() {
    cat >"$LOG/rank.sh" <<'EOS'
#!/bin/sh
base=$1; shift
r=${OMPI_COMM_WORLD_RANK:-0}
exec /usr/bin/time -o "$base.r$r.time" -f '%U %S %M' "$@" >"$base.r$r.out" 2>"$base.r$r.err"
EOS
    chmod +x "$LOG/rank.sh"
}

# machine-wide busy CPU seconds (user+nice+sys+irq+softirq+steal) so far
busy_s() {
    awk -v hz="$(getconf CLK_TCK)" '$1 == "cpu" { print ($2 + $3 + $4 + $7 + $8 + $9) / hz; exit }' /proc/stat
}

# Waits up to IDLE_WAIT seconds (default 0) for the machine to be under 10%
# busy over a second (other people's jobs on a shared machine); prints nothing.
idle_wait() {
    local end=$((SECONDS + ${IDLE_WAIT:-0})) b0 b1 t0 t1
    while ((SECONDS < end)); do
        b0=$(busy_s)
        t0=$(date +%s.%N)
        sleep 1
        b1=$(busy_s)
        t1=$(date +%s.%N)
        awk -v b="$(awk -v a="$b0" -v b="$b1" 'BEGIN { print b - a }')" -v t="$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }')" \
            -v n="$(nproc)" 'BEGIN { exit !(b / (t * n) < 0.1) }' && return
    done
}

# the ZeRO-3 gathers that reuse leaves, as a multiple of P, for a GPT-2
# shape (tied embedding: the embedding unit, L blocks, the final norm), with
# a prefetch bucket PF (fitlm's default 5e7) and the default live limit
# (1e9): the resident units (embedding, final norm) once a step, every block
# in the forward pass, and in the backward pass the blocks the ring (1 +
# the prefetch depth) did not keep
stage3_gathered() { # P L C Vpad maxT PF
    awk -v P="$1" -v L="$2" -v C="$3" -v V="$4" -v T="$5" -v PF="$6" 'BEGIN {
        E = V * C + T * C; lnf = 2 * C; Bk = (P - E - lnf) / L
        d = int(PF / Bk); live = int((1e9 - E - lnf) / Bk - 1); if (live < d) d = live
        if (d > L) d = L; if (d > 63) d = 63; ring = d + 1
        back = L - ring; if (back < 0) back = 0
        printf "%.4f", (E + lnf + Bk * (L + back)) / P }'
}

# The set-up of a benchmark over ranks (dist.sh, tp.sh): its log directory
# ($LOG, else a new fitlm-NAME.XXXXXX under $TMPDIR), Open MPI's
# environment, the build and the per-rank script.
bench_mpi_setup() {
    LOG=${LOG:-$(mktemp -d "${TMPDIR:-/tmp}/fitlm-$1.XXXXXX")}
    mkdir -p "$LOG"
    echo "== logs in $LOG" >&2
    bench_mpi_env
    bench_build
    bench_rank_script
}

# The deadline of bench/gpu.sh and bench/gpu_memory.sh: BENCH_DEADLINE, the
# epoch second by which the script must be done (scripts/gpu_check.sh
# passes its call's end, less a few seconds), else BENCH_SECONDS from now
# (default DEFAULT, the script's own). Sets BENCH_T0 (now: the log's start
# offsets count from it) and BENCH_END.
bench_deadline() { # DEFAULT
    BENCH_T0=$(date +%s)
    local s=${BENCH_SECONDS:-$1}
    case $s in '' | *[!0-9]*) echo "BENCH_SECONDS=$s: a whole number of seconds" >&2 && exit 2 ;; esac
    BENCH_END=${BENCH_DEADLINE:-$((BENCH_T0 + s))}
    case $BENCH_END in '' | *[!0-9]*) echo "BENCH_DEADLINE=$BENCH_END: epoch seconds" >&2 && exit 2 ;; esac
}

# bench_left: the seconds left before the deadline (negative past it)
bench_left() { echo $((BENCH_END - $(date +%s))); }

# bench_may_start MIN: whether a run that needs MIN seconds may still start
bench_may_start() { [ "$(bench_left)" -ge "$1" ]; }

# bench_timeout CAP: a run's timeout: its own CAP or, where the deadline is
# nearer, the seconds left before it less BENCH_MARGIN (default 10: the
# kill's grace, 5 s, and what the script does after its last run); at
# least 1
bench_timeout() {
    local t=$(($(bench_left) - ${BENCH_MARGIN:-10}))
    ((t < $1)) || t=$1
    ((t >= 1)) || t=1
    echo "$t"
}

# bench_run LOG OUT CAP CMD...: CMD under a timeout of bench_timeout CAP
# (SIGKILL 5 s after the SIGTERM), its stdout and stderr streamed into OUT
# and onto LOG as it prints (a run killed midway, by the deadline or by a
# caller's guard, still shows how far it got), then a line
# "-- N s (started at S s; exit RC)" on LOG (S counted from BENCH_T0).
# BENCH_CUT: the seconds it ran where the deadline cut it (timed out, 124,
# or killed after the grace, 137, under a timeout shorter than CAP), else
# empty: a run that reaches its own CAP is no cut. Returns CMD's exit status
# (timeout's).
bench_run() {
    local log=$1 f=$2 cap=$3 to start rc s note=""
    shift 3
    to=$(bench_timeout "$cap")
    start=$(date +%s)
    timeout -k 5 "$to" "$@" 2>&1 | tee "$f" >>"$log"
    rc=${PIPESTATUS[0]}
    s=$(($(date +%s) - start))
    BENCH_CUT=""
    if { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && [ "$to" -lt "$cap" ] && [ "$s" -ge "$to" ]; then
        # shellcheck disable=SC2034 # the scripts read it
        BENCH_CUT=$s
        note=": cut by the deadline (timeout $to s, not its $cap)"
    fi
    echo "-- $s s (started at $((start - BENCH_T0)) s; exit $rc$note)" >>"$log"
    return "$rc"
}

# cut_status: a table's status for the run the deadline cut (bench_run's
# BENCH_CUT)
cut_status() { echo "skipped: time (cut after $BENCH_CUT s)"; }

# why LINE: ": LINE" for a failed run's status in a table (its reader sees
# why without the log): cut to 120 characters, no tabs or | (the TSV's and
# markdown's separators); nothing for an empty LINE
why() { [ -n "$1" ] && printf ': %s' "$(echo "$1" | tr -d '\t' | tr '|' '/' | cut -c1-120)"; }

# table TSV: the file in aligned columns; column(1) is util-linux's (Debian's
# bsdextrautils), which a minimal image (a GPU lease's) may lack: awk then
table() {
    if command -v column >/dev/null; then
        column -t -s $'\t' "$1"
    else
        awk -F'\t' 'NR == FNR { for (i = 1; i <= NF; i++) if (length($i) > w[i]) w[i] = length($i); next }
            { s = ""; for (i = 1; i < NF; i++) s = s sprintf("%-" (w[i] + 2) "s", $i); print s $NF }' "$1" "$1"
    fi
}
