#!/usr/bin/env bash
# bench/pp.sh: the pipeline's bubble, measured against the schedules'
# theory, and each stage's peak memory against `fitlm plan`. A LLaMA shape
# (untied: no tied head's weight gradient on stage 0 to unbalance it) of
# L blocks, fp32 AdamW, one thread per rank (Open MPI, shared memory; 4
# ranks oversubscribe 2 cores), each run
#
#   mpirun.openmpi -q --bind-to none -np p fitlm train --model tiny --arch llama
#       --n-layer L --n-embd C --batch B --seq-len T --grad-accum m --steps S
#       --warmup 0 --eval-every 0 --val-data none --sample-tokens 0 --out ''
#       --threads 1 --profile --pipeline-parallel p
#       --pipeline-schedule 1f1b|gpipe|interleaved [--virtual-stages 2]
#
# for p = 2 and 4, m = 4, 8 and 16, and the same flags without mpirun and
# the pipeline's at p = 1 (one process, every stage's work in a row).
#
# The measured bubble: rank 0's profile (the steps after the first) books
# the time it waits in the pipeline's point-to-point receives (recv_wait,
# communication under the step, and the final wait for its own sends) as
# W ms of a step of S ms. With equal stages every rank idles the same
# (p - 1)(f + b) a step under GPipe and 1F1B, ((p - 1)/v)(f + b) under
# interleaved 1F1B, for f, b one micro-batch's forward and backward of a
# stage; the theory (Narayanan et al. 2021) gives that idle time as a
# fraction of the ideal (busy) time: (p - 1)/m, (p - 1)/(v m). So
#
#   bubble = W / (S - W)      against (p - 1)/m or (p - 1)/(v m)
#
# and a second reading from step times alone: S p / S1 - 1, with S1 the one
# process's step time of the same m micro-batches (ideal: S1 / p a step),
# which also counts the messages' cost and the stages' imbalance (stage 0
# holds the embedding, the last the head and the loss).
#
# Memory: at m = 8 under each schedule, every rank's --mem-report peak (all
# tags, bytes) against `fitlm plan --ranks p --rank r` with the same flags.
#
#   bench/pp.sh                 # 3-6 minutes on 2 shared cores; prints the tables
#   PP_OUT=file bench/pp.sh     # ... and writes them to file
#
# Knobs: BUILD [build], L [8], C [256], BATCH [4], SEQ [64], STEPS [5],
# RANKS ["2 4"], MICRO ["4 8 16"], SCHEDULES ["1f1b gpipe interleaved"],
# MEM_MICRO [8], LOG [a fresh /tmp dir], NO_BUILD=1.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=${BUILD:-build}
L=${L:-8}
C=${C:-256}
BATCH=${BATCH:-4}
SEQ=${SEQ:-64}
STEPS=${STEPS:-5}
RANKS=${RANKS:-"2 4"}
MICRO=${MICRO:-"4 8 16"}
SCHEDULES=${SCHEDULES:-"1f1b gpipe interleaved"}
MEM_MICRO=${MEM_MICRO:-8}
source bench/lib.sh
bench_mpi_setup pp

# flags M: fitlm train's flags at m = M, without the pipeline's
flags() {
    FLAGS=(--model tiny --arch llama --data data/brown_byte --tokenizer byte --n-layer "$L" --n-embd "$C" --batch "$BATCH" --seq-len "$SEQ"
        --grad-accum "$1" --steps "$STEPS" --warmup 0 --eval-every 0 --val-data none
        --sample-tokens 0 --out '' --threads 1)
}

# pp_flags P SCHEDULE: the pipeline's flags
pp_flags() {
    PP=(--pipeline-parallel "$1" --pipeline-schedule "$2")
    [[ $2 == interleaved ]] && PP+=(--virtual-stages 2)
    return 0
}

# profile_ms NAME: rank 0's "communication total" and "step" ms (the profile's
# mean over the steps after the first)
profile_ms() {
    awk '/^per-op profile:/ { for (i = 1; i <= NF; i++) if ($i == "ms/step") s = $(i - 1) }
        /^\| communication / { split($0, f, "|"); w = f[6] + 0 }
        END { printf "%s %s\n", w + 0, s + 0 }' "$LOG/$1.r0.out"
}

# run NAME N FLAG...: one run over N ranks (1: no mpirun), each rank's output
# in NAME.rR.out/.err
run() {
    local name=$1 n=$2
    shift 2
    local cmd=("$FITLM" train "$@")
    ((n > 1)) && cmd=(mpirun.openmpi -q --bind-to none -np "$n" "${cmd[@]}")
    printf '%q ' "${cmd[@]}" | sed 's/ $//' >"$LOG/$name.cmd"
    echo "== $(cat "$LOG/$name.cmd")" >&2
    if ((n > 1)); then
        nice -n 19 mpirun.openmpi -q --bind-to none -np "$n" "$LOG/rank.sh" "$LOG/$name" "$FITLM" \
            train "$@"
    else
        nice -n 19 "$LOG/rank.sh" "$LOG/$name" "$FITLM" train "$@"
    fi
}

{
    echo "# bench/pp.sh: $(date -u '+%Y-%m-%d %H:%M UTC')"
    bench_cpu
    echo "LLaMA shape: L $L, C $C, vocab 257 (byte), fp32 AdamW, micro-batch $BATCH x $SEQ," \
        "$STEPS steps (the profile's mean over the steps after the first), one thread per rank"
    echo
    echo "## bubble"
    echo
    echo "| p | schedule | m | step ms | rank 0 waits ms | bubble W/(S-W) | theory | one process ms | S p/S1 - 1 |"
    echo "|--:|:--|--:|--:|--:|--:|--:|--:|--:|"
} >"$LOG/table.md"

for m in $MICRO; do
    flags "$m"
    run "one_m$m" 1 "${FLAGS[@]}" --profile
    read -r _ s1 < <(profile_ms "one_m$m")
    for p in $RANKS; do
        for sched in $SCHEDULES; do
            pp_flags "$p" "$sched"
            name="p${p}_${sched}_m$m"
            run "$name" "$p" "${FLAGS[@]}" --profile "${PP[@]}"
            read -r w s < <(profile_ms "$name")
            v=1
            [[ $sched == interleaved ]] && v=2
            awk -v p="$p" -v sc="$sched" -v m="$m" -v w="$w" -v s="$s" -v v="$v" -v s1="$s1" \
                'BEGIN { printf "| %d | %s%s | %d | %.1f | %.1f | %.3f | %.3f | %.1f | %.3f |\n",
                    p, sc, (v > 1 ? " v 2" : ""), m, s, w, w / (s - w), (p - 1) / (v * m), s1,
                    s * p / s1 - 1 }' >>"$LOG/table.md"
        done
    done
done

{
    echo
    echo "## per-stage peak memory against the plan (m = $MEM_MICRO; bytes, every tag)"
    echo
    echo "| p | schedule | rank | planned total | measured (sum of tag peaks) | tags that differ |"
    echo "|--:|:--|--:|--:|--:|:--|"
} >>"$LOG/table.md"
flags "$MEM_MICRO"
for p in $RANKS; do
    for sched in $SCHEDULES; do
        pp_flags "$p" "$sched"
        name="mem_p${p}_$sched"
        run "$name" "$p" "${FLAGS[@]}" --mem-report "${PP[@]}"
        for ((r = 0; r < p; r++)); do
            "$FITLM" plan "${FLAGS[@]}" "${PP[@]}" --ranks "$p" --rank "$r" >"$LOG/$name.plan$r"
            report=$LOG/$name.r$r.out
            ((r > 0)) && report=$LOG/$name.r$r.err
            awk -v p="$p" -v sc="$sched" -v r="$r" '
                FNR == NR && $1 ~ /^(params|grads|master|optim|acts|workspace|comm|offload|other)$/ &&
                    !($1 in plan) { plan[$1] = $2; ptotal += $2; next }
                FNR != NR && /^memory by tag/ { on = 1; next }
                FNR != NR && on && ($1 in plan) && !($1 in got) { got[$1] = $4; mtotal += $4 }
                END { diff = ""
                    for (t in plan) if (plan[t] != got[t]) diff = diff " " t
                    printf "| %d | %s | %d | %d | %d | %s |\n", p, sc, r, ptotal, mtotal,
                        (diff == "" ? "none" : diff) }' "$LOG/$name.plan$r" "$report" >>"$LOG/table.md"
        done
    done
done

cat "$LOG/table.md"
if [[ -n ${PP_OUT:-} ]]; then cp "$LOG/table.md" "$PP_OUT"; fi
