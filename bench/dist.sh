#!/usr/bin/env bash
# bench/dist.sh: data parallelism measured side by side in one run: DDP
# (ZeRO stage 0) and ZeRO stages 1, 2 and 3 over 2 and 4 ranks on one host
# (Open MPI, shared memory), against one rank with 1 and 2 threads, plus a
# ZeRO-3 run with a one-block prefetch. The table of the last run, with its
# analysis, is bench/dist.md. Each run:
#
#   mpirun.openmpi -q --bind-to none -np N fitlm train --zero-stage S
#       --model gpt2 --batch 2 --seq-len 128 --steps 4 --warmup 0
#       --eval-every 0 --val-data none --sample-tokens 0 --out '' --threads 1
#       --reduce-bucket-size 5e6 --allgather-bucket-size 5e6
#       --overlap-comm=true|false --mem-report --profile
#
# (one rank: the same flags without mpirun and the ZeRO ones). Each rank runs
# under /usr/bin/time with its own output files (not a terminal: one plain
# line per step). Per run it reads:
#   - rank 0's "communication per step and rank" line: elements (and x the
#     parameters), MB, collectives, and the percent of the step time spent
#     waiting on collectives; beside it the ring-algorithm theory, 2(N-1)/N x P
#     for stages 0-2 and 3(N-1)/N x P for stage 3, and for stage 3 also what
#     its reuse leaves (the embedding gathered once a step, the last blocks
#     kept from the forward pass to the backward: see src/parallel/zero.c);
#   - tokens/s: N x B x T over the median step time of the steps after the
#     first (rank 0's log), with the min-max of those step times;
#   - per rank, the tagged peak and the tagged total at the end (steady
#     state) of --mem-report, and the process's peak RSS (VmHWM); the max over
#     the ranks is printed, with the min-max of the ranks' peak RSS;
#   - the communication hidden behind computation: each stage and N runs with
#     overlap_comm true and then false, back to back. Two measures of the
#     communication left on rank 0's critical path: waited = (the percent of
#     the step time waiting on collectives) x (mean step time), and comm =
#     the --profile row "communication" (ms per step after the first: the
#     waits, plus staging buckets and the MPI_Test calls that progress
#     collectives in flight, which is CPU time the waits miss). hidden =
#     1 - x(true) / x(false) for each. With overlap off, stages 0/1 start
#     their reductions after the backward pass and 2/3 wait for each unit's,
#     so x(false) is the reductions' whole time (plus stage 3's gathers, which
#     overlap_comm does not change); x(true) is what was left exposed. The
#     ratio of the median step times (true / false) is printed beside them;
#   - the other load on the machine during the run: (machine busy CPU time -
#     the ranks' own CPU time) / wall time, in cores (other people's jobs on a
#     shared machine show here).
# Then an ordering table: the stages 1-3 sorted by tokens/s and by memory per
# rank, against the ZeRO paper's order (speed 1 > 2 > 3, memory the reverse).
#
#   bench/dist.sh                       # ~8 minutes on 2 idle cores; prints the tables
#   DIST_OUT=file bench/dist.sh           # ... and writes them to file
#
# Knobs: BUILD [build], MODEL [gpt2], BATCH [2] (per rank), SEQ [128],
# STEPS [4], PRECISION [fp32], RANKS ["2 4"], STAGES ["0 1 2 3"],
# BUCKET [5e6] (reduce and all-gather bucket, elements), PREFETCH_SMALL
# [7.1e6] (an extra ZeRO-3 run with this stage3_prefetch_bucket_size: one
# GPT-2 124M block, 7,087,872 elements, so one block is gathered ahead
# instead of the default 5e7's seven; "" skips it), IDLE_WAIT [0] (seconds
# to wait before each run for the machine to be under 10% busy),
# NO_OVERLAP_RUNS=1 (skip the overlap_comm false runs), MPIEXEC_TIMEOUT
# [900] (seconds per mpirun), LOG [a fresh /tmp dir], NO_BUILD=1.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=${BUILD:-build}
MODEL=${MODEL:-gpt2}
BATCH=${BATCH:-2}
SEQ=${SEQ:-128}
STEPS=${STEPS:-4}
PRECISION=${PRECISION:-fp32}
RANKS=${RANKS:-"2 4"}
STAGES=${STAGES:-"0 1 2 3"}
BUCKET=${BUCKET:-5e6}
IDLE_WAIT=${IDLE_WAIT:-0}
PREFETCH_SMALL=${PREFETCH_SMALL:-7.1e6}
NO_OVERLAP_RUNS=${NO_OVERLAP_RUNS:-0}
source bench/lib.sh
bench_mpi_setup dist

# run NAME N STAGE OVERLAP THREADS [FLAG...]: one run (N = 1: no mpirun)
run() {
    local name=$1 n=$2 stage=$3 overlap=$4 threads=$5 b0 b1 t0 t1
    shift 5
    local flags=(--model "$MODEL" --batch "$BATCH" --seq-len "$SEQ" --steps "$STEPS" --warmup 0
        --eval-every 0 --val-data none --sample-tokens 0 --out '' --threads "$threads"
        --precision "$PRECISION" --mem-report --profile)
    [[ $MODEL == gpt2 ]] || flags+=(--vocab-size 50257)
    if ((n > 1)); then
        flags+=(--zero-stage "$stage" --reduce-bucket-size "$BUCKET"
            --allgather-bucket-size "$BUCKET" --overlap-comm="$overlap" "$@")
    fi
    local cmd=("$FITLM" train "${flags[@]}")
    ((n > 1)) && cmd=(mpirun.openmpi -q --bind-to none -np "$n" "${cmd[@]}")
    echo "== ${cmd[*]}" >&2
    echo "${cmd[*]}" >"$LOG/$name.cmd"
    idle_wait
    b0=$(busy_s)
    t0=$(date +%s.%N)
    if ((n > 1)); then
        mpirun.openmpi -q --bind-to none -np "$n" "$LOG/rank.sh" "$LOG/$name" "$FITLM" train "${flags[@]}"
    else
        "$LOG/rank.sh" "$LOG/$name" "$FITLM" train "${flags[@]}"
    fi || { tail -n 3 "$LOG/$name".r*.err >&2; return 1; }
    t1=$(date +%s.%N)
    b1=$(busy_s)
    # wall seconds, the machine's busy CPU seconds, the ranks' CPU seconds
    echo "$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }') $(awk -v a="$b0" -v b="$b1" 'BEGIN { print b - a }') \
$(cat "$LOG/$name".r*.time | awk '{ s += $1 + $2 } END { print s }')" >"$LOG/$name.load"
}

# the fields of one run, "key=value" words
measure() { # NAME N
    local name=$1 n=$2 out="$LOG/$1.r0.out" r med lo hi
    read -r med lo hi <<<"$(step_ms "$out")"
    local toks=$((n * BATCH * SEQ))
    echo "med=$med lo=$lo hi=$hi mean=$(mean_ms "$out")"
    echo "tps=$(awk -v t="$toks" -v m="$med" 'BEGIN { printf "%.0f", t * 1000 / m }')"
    awk '/^communication per step and rank/ {
        gsub(/[(),;%]/, " "); printf "elem=%s x=%s mb=%s coll=%s waitpct=%s\n", $6, $8, $13, $15, $17 }' "$out"
    # per rank: tagged peak, tagged at the end, peak RSS (all MiB)
    local peak=0 endv=0 rss_lo= rss_hi=0
    for ((r = 0; r < n; r++)); do
        local f="$LOG/$name.r$r.all"
        cat "$LOG/$name.r$r.out" "$LOG/$name.r$r.err" >"$f"
        local p e s
        p=$(tag_peak total "$f")
        e=$(awk '$0 ~ /^memory by tag/ { on = 1 } on && $1 == "total" { v = $3 } END { print v + 0 }' "$f")
        s=$(awk '/process peak RSS/ { v = $4 } END { print v + 0 }' "$f")
        peak=$(awk -v a="$peak" -v b="$p" 'BEGIN { print (b > a ? b : a) }')
        endv=$(awk -v a="$endv" -v b="$e" 'BEGIN { print (b > a ? b : a) }')
        rss_hi=$(awk -v a="$rss_hi" -v b="$s" 'BEGIN { print (b > a ? b : a) }')
        rss_lo=$(awk -v a="${rss_lo:-$s}" -v b="$s" 'BEGIN { print (b < a ? b : a) }')
    done
    # the profile's communication row (rank 0, the steps after the first):
    # staging, progressing and waiting on collectives, ms per step
    awk -F'|' '$2 ~ /^ *communication *$/ { gsub(/ /, "", $6); print "comm=" $6 }' "$out"
    echo "peak=$(printf %.0f "$peak") end=$(printf %.0f "$endv") rss_hi=$(printf %.0f "$rss_hi") rss_lo=$(printf %.0f "$rss_lo")"
    awk '{ printf "load=%.2f\n", ($2 - $3) / $1 }' "$LOG/$name.load"
}

START=$(date +%s)
ROWS=()
declare -A TPS MEM

# one rank, 1 and 2 threads: the baseline
for threads in 1 2; do
    name="r1_t$threads"
    run "$name" 1 0 true "$threads" || { ROWS+=("| 1 rank | 1 | $threads | failed ||||||||||||"); continue; }
    f=($(measure "$name" 1))
    ROWS+=("| 1 rank, no MPI | 1 | $threads | - | - | - | - | $(field tps "${f[@]}") | $(field med "${f[@]}") ($(field lo "${f[@]}")–$(field hi "${f[@]}")) | - | - | - | - | $(field peak "${f[@]}") | $(field end "${f[@]}") | $(field rss_hi "${f[@]}") | $(field load "${f[@]}") |")
done

P= L= C= V= T=
hdr="$LOG/r1_t1.r0.out"
if [[ -f $hdr ]]; then
    P=$(awk '/ parameters \(/ { print $1; exit }' "$hdr")
    read -r L C V T <<<"$(sed -n 's/.*n_layer \([0-9]*\),.*n_embd \([0-9]*\),.*(padded \([0-9]*\)), max_seq_len \([0-9]*\).*/\1 \2 \3 \4/p' "$hdr" | head -1)"
fi

VARIANTS=()
for stage in $STAGES; do
    VARIANTS+=("$stage")
    [[ $stage == 3 && -n $PREFETCH_SMALL ]] && VARIANTS+=(3p)
done
for n in $RANKS; do
    for variant in "${VARIANTS[@]}"; do
        stage=${variant%p}
        name="n${n}_s${variant}"
        extra=() label=$stage pf=5e7
        if [[ $variant == 3p ]]; then
            extra=(--prefetch-bucket-size "$PREFETCH_SMALL") label="3, prefetch $PREFETCH_SMALL" pf=$PREFETCH_SMALL
        fi
        run "${name}_ov" "$n" "$stage" true 1 "${extra[@]}" || { ROWS+=("| $label | $n | 1 | failed ||||||||||||"); continue; }
        f=($(measure "${name}_ov" "$n"))
        wait_ov=$(awk -v p="$(field waitpct "${f[@]}")" -v m="$(field mean "${f[@]}")" 'BEGIN { printf "%.0f", p / 100 * m }')
        comm_ov=$(printf %.0f "$(field comm "${f[@]}")")
        wait_no=- comm_no=- hidden=- ratio=-
        # the small-prefetch variant: overlap_comm true only
        if [[ $NO_OVERLAP_RUNS != 1 && $variant != 3p ]] && run "${name}_no" "$n" "$stage" false 1; then
            g=($(measure "${name}_no" "$n"))
            wait_no=$(awk -v p="$(field waitpct "${g[@]}")" -v m="$(field mean "${g[@]}")" 'BEGIN { printf "%.0f", p / 100 * m }')
            comm_no=$(printf %.0f "$(field comm "${g[@]}")")
            hidden=$(awk -v a="$wait_ov" -v b="$wait_no" 'BEGIN { printf "%.0f%%", (b > 0 ? 100 * (1 - a / b) : 0) }')
            hidden="$hidden / $(awk -v a="$comm_ov" -v b="$comm_no" 'BEGIN { printf "%.0f%%", (b > 0 ? 100 * (1 - a / b) : 0) }')"
            ratio=$(awk -v a="$(field med "${f[@]}")" -v b="$(field med "${g[@]}")" 'BEGIN { printf "%.2f", a / b }')
        fi
        k=$((stage == 3 ? 3 : 2))
        theory=$(awk -v k="$k" -v n="$n" 'BEGIN { printf "%.3f", k * (n - 1) / n }')
        if ((stage == 3)) && [[ -n $P && $MODEL == gpt2* ]]; then
            g3=$(stage3_gathered "$P" "$L" "$C" "$V" "$T" "$pf")
            theory="$theory (reuse: $(awk -v g="$g3" -v n="$n" 'BEGIN { printf "%.3f", (1 + g) * (n - 1) / n }'))"
        fi
        TPS[$n,$variant]=$(field tps "${f[@]}")
        MEM[$n,$variant]=$(field end "${f[@]}")
        ROWS+=("| $label | $n | 1 | $(field elem "${f[@]}") | $(field x "${f[@]}") | $theory | $(field mb "${f[@]}") / $(field coll "${f[@]}") | $(field tps "${f[@]}") | $(field med "${f[@]}") ($(field lo "${f[@]}")–$(field hi "${f[@]}")) | $wait_ov / $wait_no | $comm_ov / $comm_no | $hidden | $ratio | $(field peak "${f[@]}") | $(field end "${f[@]}") | $(field rss_hi "${f[@]}") ($(field rss_lo "${f[@]}")–$(field rss_hi "${f[@]}")) | $(field load "${f[@]}") |")
    done
done
ELAPSED=$(($(date +%s) - START))

stage_name() {
    case $1 in
    0) echo DDP ;;
    3p) echo "ZeRO-3 with prefetch $PREFETCH_SMALL" ;;
    *) echo "ZeRO-$1" ;;
    esac
}
# order N KIND: the ZeRO variants measured, sorted (tokens/s: fastest first;
# memory: least first)
order() {
    local n=$1 kind=$2 s line=()
    for s in "${VARIANTS[@]}"; do
        [[ $s == 0 ]] && continue
        if [[ $kind == speed ]]; then line+=("${TPS[$n,$s]:-0} $s"); else line+=("${MEM[$n,$s]:-0} $s"); fi
    done
    printf '%s\n' "${line[@]}" | if [[ $kind == speed ]]; then sort -g -r; else sort -g; fi |
        while read -r v s; do printf '%s (%s) ' "$(stage_name "$s")" "$v"; done |
        sed -E "s/ \$//; s/(\([0-9.]+\)) /\1 $([[ $kind == speed ]] && echo '>' || echo '<') /g"
}

{
    echo "$(bench_cpu); $(nproc) cores"
    echo "Open MPI: $(mpirun.openmpi --version 2>/dev/null | head -1); btl self,vader (shared memory); $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "model: $MODEL ($P parameters = P), $PRECISION, AdamW, batch $BATCH x $SEQ tokens per rank, $STEPS steps (median of the $((STEPS - 1)) after the first); buckets $BUCKET elements; $ELAPSED s in all"
    echo "2 and 4 ranks run 1 thread each: 4 ranks oversubscribe the 2 cores"
    echo
    echo "| ZeRO stage | ranks | threads/rank | elements/step/rank | x P | theory x P | MB / collectives per step | tokens/s | ms/step median (min–max) | waited ms/step, overlap on / off | comm ms/step, on / off | hidden: by waited / by comm | step time overlap / no overlap | tagged peak MiB/rank | tagged at end MiB/rank | peak RSS MiB/rank (ranks min–max) | other load (cores) |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    printf '%s\n' "${ROWS[@]}"
    echo
    echo "| ranks | by tokens/s (fastest first) | by tagged MiB/rank at the end (least first) | the ZeRO paper's order |"
    echo "|---|---|---|---|"
    for n in $RANKS; do
        echo "| $n | $(order "$n" speed) | $(order "$n" memory) | speed ZeRO-1 > ZeRO-2 > ZeRO-3; memory ZeRO-3 < ZeRO-2 < ZeRO-1 |"
    done
} | tee "${DIST_OUT:-/dev/null}"
