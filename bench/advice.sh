#!/usr/bin/env bash
# bench/advice.sh: the seeds' advice on which parallelism to pick, measured
# (issue 45). On one machine, DDP when the model fits and ZeRO, TP or PP when
# it does not; across machines with a fast link ZeRO or PP+TP+DP; with a slow
# link DP+TP+PP+ZeRO-1. Each layout trains GPT-2 355M (gpt2-medium) and 774M
# (gpt2-large) on 4 ranks, one thread each (Open MPI; 4 ranks oversubscribe
# this machine's 2 cores), at the same global batch: GLOBAL_BATCH sequences
# of SEQ tokens a step, micro-batch 1, so a layout with d data-parallel
# replicas accumulates m = GLOBAL_BATCH / d micro-batches (the pipeline's m):
#
#   ddp   --zero-stage 0                              d 4, m = G/4
#   z1    --zero-stage 1                              d 4
#   z2    --zero-stage 2                              d 4
#   z3    --zero-stage 3                              d 4
#   tp    --tensor-parallel 4                         d 1, m = G
#   pp    --pipeline-parallel 4                       d 1
#   tppp  --tensor-parallel 2 --pipeline-parallel 2   d 1
#   ppdp  --pipeline-parallel 2 --zero-stage 1        d 2, m = G/2
#
# each run
#
#   nice -n 19 mpirun.openmpi -q --bind-to none -np 4 [NETWORK] [bench/netns.sh rank]
#       fitlm train --model M --batch 1 --seq-len SEQ --grad-accum m --steps S
#       --warmup 0 --eval-every 0 --val-data none --sample-tokens 0 --out ''
#       --threads 1 --precision P --mem-report LAYOUT
#       [--reduce-bucket-size 5e6 --allgather-bucket-size 5e6]   (the DP ones)
#
# over each network of NETS:
#   shm    one machine: Open MPI's shared memory (btl self,vader), as the
#          test suite and bench/dist.sh, bench/tp.sh run;
#   RATE   (e.g. 1gbit, 100mbit) two machines of 2 ranks each on this host:
#          bench/netns.sh's network namespaces, ranks 0-1 in one and 2-3 in
#          the other, over TCP only (btl self,tcp on 10.77.0.0/24): inside a
#          machine the kernel's local path (GB/s), between the machines a link
#          of RATE each way (tbf; no added delay: this kernel has no netem).
#          In Megatron's rank order (TP fastest, then DP, then PP) tppp's TP
#          pairs and ppdp's DP pairs stay inside a machine and only the
#          pipeline's messages (activations, their gradients, and for the tied
#          embedding the head's data to stage 0 and its rows back) cross the
#          link; ddp, ZeRO and tp (t = 4)
#          cross it with everything. The link's rate is measured first (one
#          TCP stream, bench/netns.sh bw) and printed.
# Before each model and layout, `fitlm plan` with the same flags (--ranks 4)
# says whether it fits this machine's memory shared by 4 ranks; what does not,
# or needs more than MEM_MARGIN of it (other people's jobs share the machine,
# and a rank killed for memory can take theirs along), is skipped with the
# plan's numbers. A pipeline layout runs only if a 1-step
# probe (the tiny model, the same layout flags) says pipeline in its header:
# a fitlm that ignores or refuses --pipeline-parallel gets a row saying so.
# Per run it reads, as bench/dist.sh and bench/tp.sh:
#   - tokens/s: GLOBAL_BATCH x SEQ over the median of rank 0's step times
#     after the first (min-max beside it);
#   - per rank, --mem-report's tagged peak (each rank's: pipeline stages
#     differ) and the peak RSS (the ranks' largest);
#   - rank 0's "communication per step and rank" line: MB, collectives and
#     the percent of the step waiting on them;
#   - the other load on the machine during the run (cores), as bench/dist.sh.
# Last, per network, the layouts by tokens/s.
#
#   bench/advice.sh                 # prints the tables (see the timing in
#                                   # bench/results_advice.md)
#   ADVICE_OUT=file bench/advice.sh # ... and writes them to file
#
# Knobs: BUILD [build], MODELS ["gpt2-medium gpt2-large"], LAYOUTS ["ddp z1
# z2 z3 tp pp tppp ppdp"], NETS ["shm 1gbit"], GLOBAL_BATCH [8] (a multiple of
# 4), SEQ [64], STEPS [3], PRECISION [fp32], BUCKET [5e6] (the DP layouts'
# reduce and all-gather buckets, elements: DeepSpeed's default 5e8 would add
# 2.6 GiB of buffers per rank at 355M), SCHEDULE [1f1b] (--pipeline-schedule),
# BW_MB [64] (the link test's transfer), MEM_MARGIN [0.9], IDLE_WAIT [0], MPIEXEC_TIMEOUT
# [900], LOG [a fresh /tmp dir], NO_BUILD=1. Runs as root (mpirun's
# OMPI_ALLOW_RUN_AS_ROOT, and ip netns for the RATE networks).
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=${BUILD:-build}
MODELS=${MODELS:-"gpt2-medium gpt2-large"}
LAYOUTS=${LAYOUTS:-"ddp z1 z2 z3 tp pp tppp ppdp"}
NETS=${NETS:-"shm 1gbit"}
GLOBAL_BATCH=${GLOBAL_BATCH:-8}
SEQ=${SEQ:-64}
STEPS=${STEPS:-3}
PRECISION=${PRECISION:-fp32}
BUCKET=${BUCKET:-5e6}
SCHEDULE=${SCHEDULE:-1f1b}
BW_MB=${BW_MB:-64}
MEM_MARGIN=${MEM_MARGIN:-0.9}
NP=4
((GLOBAL_BATCH % NP == 0)) || { echo "advice.sh: GLOBAL_BATCH $GLOBAL_BATCH is not a multiple of $NP" >&2; exit 1; }
source bench/lib.sh
bench_mpi_setup advice

# layout_flags LAYOUT: its flags in LFLAGS, its data-parallel replicas in DP
layout_flags() {
    local buckets=(--reduce-bucket-size "$BUCKET" --allgather-bucket-size "$BUCKET")
    local pipe=(--pipeline-schedule "$SCHEDULE")
    case $1 in
    ddp) LFLAGS=(--zero-stage 0 "${buckets[@]}") DP=4 ;;
    z[123]) LFLAGS=(--zero-stage "${1#z}" "${buckets[@]}") DP=4 ;;
    tp) LFLAGS=(--tensor-parallel 4) DP=1 ;;
    pp) LFLAGS=(--pipeline-parallel 4 "${pipe[@]}") DP=1 ;;
    tppp) LFLAGS=(--tensor-parallel 2 --pipeline-parallel 2 "${pipe[@]}") DP=1 ;;
    ppdp) LFLAGS=(--pipeline-parallel 2 --zero-stage 1 "${pipe[@]}" "${buckets[@]}") DP=2 ;;
    *) echo "advice.sh: unknown layout '$1' (ddp z1 z2 z3 tp pp tppp ppdp)" >&2; exit 1 ;;
    esac
}

layout_name() {
    case $1 in
    ddp) echo "DDP" ;; z?) echo "ZeRO-${1#z}" ;; tp) echo "TP 4" ;; pp) echo "PP 4" ;;
    tppp) echo "TP 2 x PP 2" ;; ppdp) echo "PP 2 x DP 2, ZeRO-1" ;;
    esac
}

# train_flags MODEL LAYOUT: fitlm train's flags in FLAGS
train_flags() {
    layout_flags "$2"
    FLAGS=(--model "$1" --batch 1 --seq-len "$SEQ" --grad-accum $((GLOBAL_BATCH / DP)) --steps "$STEPS"
        --warmup 0 --eval-every 0 --val-data none --sample-tokens 0 --out '' --threads 1
        --precision "$PRECISION" --mem-report "${LFLAGS[@]}")
}

# net_mpi NET: mpirun's network flags and the rank prefix, in NETFLAGS and
# PREFIX
net_mpi() {
    if [[ $1 == shm ]]; then
        NETFLAGS=() PREFIX=()
    else
        NETFLAGS=(--mca btl "self,tcp" --mca btl_tcp_if_include 10.77.0.0/24)
        PREFIX=(bench/netns.sh rank)
    fi
}

# fits MODEL LAYOUT: WHY="" if `fitlm plan` says the run fits this machine's
# memory shared by the ranks, else why not
fits() {
    train_flags "$1" "$2"
    local plan="$LOG/plan_$1_$2.txt"
    WHY=
    "$FITLM" plan "${FLAGS[@]}" --ranks "$NP" >"$plan" 2>&1 || { WHY="plan refused it: $(tail -n 1 "$plan")"; return; }
    local total limit
    total=$(awk '$1 == "total" { print $4; exit }' "$plan")
    limit=$(sed -n 's/^memory limit \([0-9.]*\) GiB per rank.*/\1/p' "$plan")
    if grep -q '^memory limit .*: fits' "$plan"; then
        awk -v t="$total" -v l="$limit" -v m="$MEM_MARGIN" 'BEGIN { exit !(t <= m * l) }' && return
        WHY="skipped: plan $total GiB per rank, over $MEM_MARGIN of the limit $limit GiB per rank (the available memory / 4 ranks; MEM_MARGIN: the machine is shared)"
        return
    fi
    WHY="does not fit: plan $(awk '$1 == "total" { printf "%.2f GiB", $4; exit }' "$plan") per rank, $(sed -n 's/^memory limit \([0-9.]* GiB\) per rank.*/limit \1 per rank (the available memory \/ 4 ranks)/p' "$plan")"
}

# pipeline_ok LAYOUT: WHY="" if this fitlm runs LAYOUT's pipeline (a 1-step
# run of the tiny model with 4 blocks, over shared memory, whose header names
# it), else why not; once per layout
declare -A PROBED
pipeline_ok() {
    WHY=
    [[ $1 == pp* || $1 == tppp ]] || return 0
    if [[ -z ${PROBED[$1]+x} ]]; then
        layout_flags "$1"
        local out="$LOG/probe_$1" head
        if mpirun.openmpi -q --bind-to none -np "$NP" "$LOG/rank.sh" "$out" "$FITLM" train --model tiny --n-layer 4 \
            --batch 1 --seq-len 64 --grad-accum $((GLOBAL_BATCH / DP)) --steps 1 --warmup 0 --eval-every 0 \
            --val-data none --sample-tokens 0 --out '' --threads 1 "${LFLAGS[@]}" >/dev/null 2>&1; then
            head=$(grep ' parameters (' "$out.r0.out" | sed 's/; planned.*//')
            if grep -q -i pipeline <<<"$head"; then
                PROBED[$1]=""
            else
                PROBED[$1]="not run: this fitlm ignores --pipeline-parallel (its header: \"$head\")"
            fi
        else
            PROBED[$1]="not run: this fitlm refuses it: $(grep -h -v '^$' "$out".r*.err | head -n 1)"
        fi
    fi
    WHY=${PROBED[$1]}
}

# run NAME NET MODEL LAYOUT: one run under mpirun; the load file has the wall
# seconds, the machine's busy CPU seconds and the ranks' CPU seconds
run() {
    local name=$1 net=$2 b0 b1 t0 t1
    train_flags "$3" "$4"
    net_mpi "$net"
    local cmd=(mpirun.openmpi -q --bind-to none -np "$NP" "${NETFLAGS[@]}" "${PREFIX[@]}" "$FITLM" train "${FLAGS[@]}")
    {
        printf '%q ' "${cmd[@]}" | sed 's/ $//'
        echo
    } >"$LOG/$name.cmd"
    echo "== $(cat "$LOG/$name.cmd")" >&2
    CMDS+=("$name")
    idle_wait
    b0=$(busy_s)
    t0=$(date +%s.%N)
    nice -n 19 mpirun.openmpi -q --bind-to none -np "$NP" "${NETFLAGS[@]}" "${PREFIX[@]}" \
        "$LOG/rank.sh" "$LOG/$name" "$FITLM" train "${FLAGS[@]}" || {
        tail -n 3 "$LOG/$name".r*.err >&2
        return 1
    }
    t1=$(date +%s.%N)
    b1=$(busy_s)
    echo "$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }') $(awk -v a="$b0" -v b="$b1" 'BEGIN { print b - a }') \
$(cat "$LOG/$name".r*.time | awk '{ s += $1 + $2 } END { print s }')" >"$LOG/$name.load"
}

# failure NAME: WHY = why a run failed: a rank killed by a signal
# (/usr/bin/time's line; 9 is often the kernel's OOM killer), else fitlm's
# first error, else the first line any rank wrote to stderr
failure() {
    local r sig
    WHY=
    for ((r = 0; r < NP; r++)); do
        sig=$(sed -n 's/^Command terminated by signal \([0-9]*\).*/\1/p' "$LOG/$1.r$r.time" 2>/dev/null)
        if [[ -n $sig ]]; then
            WHY="rank $r killed by signal $sig$([[ $sig == 9 ]] && echo " (out of memory? dmesg)") at $(awk 'NR == 2 { printf "%.0f", $3 / 1024 }' "$LOG/$1.r$r.time") MiB peak RSS"
            return
        fi
    done
    WHY=$(cat "$LOG/$1".r*.err 2>/dev/null | grep -m 1 '^fitlm' || true)
    [[ -n $WHY ]] || WHY=$(cat "$LOG/$1".r*.err 2>/dev/null | grep -v -e '^$' -e '^==>' | head -n 1 || true)
}

# measure NAME: "key=value" words of one run
measure() {
    local name=$1 out="$LOG/$1.r0.out" r med lo hi peaks=() rss=0
    read -r med lo hi <<<"$(step_ms "$out")"
    echo "med=$med lo=$lo hi=$hi"
    echo "tps=$(awk -v t="$((GLOBAL_BATCH * SEQ))" -v m="$med" 'BEGIN { printf "%.0f", (m > 0 ? t * 1000 / m : 0) }')"
    awk '/^communication per step and rank/ {
        gsub(/[(),;%]/, " "); printf "mb=%.1f coll=%s waitpct=%s\n", $13, $15, $17 }' "$out"
    for ((r = 0; r < NP; r++)); do
        cat "$LOG/$name.r$r.out" "$LOG/$name.r$r.err" >"$LOG/$name.r$r.all"
        peaks+=("$(printf %.0f "$(tag_peak total "$LOG/$name.r$r.all")")")
        rss=$(awk -v a="$rss" -v b="$(awk '/process peak RSS/ { v = $4 } END { print v + 0 }' "$LOG/$name.r$r.all")" \
            'BEGIN { print (b > a ? b : a) }')
    done
    echo "peaks=$(
        IFS=/
        echo "${peaks[*]}"
    ) rss=$(printf %.0f "$rss")"
    awk '{ printf "load=%.2f\n", ($2 - $3) / $1 }' "$LOG/$name.load"
}

START=$(date +%s)
ROWS=() CMDS=() LINKS=() ORDER=()
NETNS_UP=0
# the namespaces go when the script ends, however it ends
cleanup() { if ((NETNS_UP)); then bench/netns.sh down; fi; }
trap cleanup EXIT
for net in $NETS; do
    if [[ $net != shm ]]; then
        bench/netns.sh up "$net" 2 >&2
        NETNS_UP=1
        LINKS+=("$net: $(bench/netns.sh bw "$BW_MB" | tr '\n' ';' | sed 's/;$//; s/;/; /')")
        echo "== ${LINKS[-1]}" >&2
    fi
    declare -A TPS=()
    for model in $MODELS; do
        for lay in $LAYOUTS; do
            label="| $model | $net | $(layout_name "$lay") |"
            pipeline_ok "$lay"
            [[ -z $WHY ]] && fits "$model" "$lay"
            if [[ -n $WHY ]]; then
                echo "== skipped $model $lay over $net: $WHY" >&2
                ROWS+=("$label - | $WHY |||||||")
                continue
            fi
            name="${model}_${net}_$lay"
            run "$name" "$net" "$model" "$lay" || {
                failure "$name"
                ROWS+=("$label - | failed: ${WHY:-no message (killed?)}; logs in $LOG/$name.* |||||||")
                continue
            }
            read -r -a f <<<"$(measure "$name" | tr '\n' ' ')"
            TPS[$model,$lay]=$(field tps "${f[@]}")
            ROWS+=("$label $DP x $((GLOBAL_BATCH / DP)) | $(field tps "${f[@]}") | $(field med "${f[@]}") ($(field lo "${f[@]}")–$(field hi "${f[@]}")) | $(field peaks "${f[@]}") | $(field rss "${f[@]}") | $(field mb "${f[@]}") | $(field coll "${f[@]}") | $(field waitpct "${f[@]}") | $(field load "${f[@]}") |")
        done
        line=$(for lay in $LAYOUTS; do if [[ -n ${TPS[$model,$lay]:-} ]]; then echo "${TPS[$model,$lay]} $lay"; fi; done |
            sort -g -r | while read -r v lay; do printf '%s (%s) > ' "$(layout_name "$lay")" "$v"; done | sed 's/ > $//')
        ORDER+=("| $model | $net | ${line:--} |")
    done
    if [[ $net != shm ]]; then
        bench/netns.sh down
        NETNS_UP=0
    fi
done
ELAPSED=$(($(date +%s) - START))

{
    echo "$(bench_cpu); $(nproc) cores; $(awk '/MemTotal/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo) memory"
    echo "Open MPI: $(mpirun.openmpi --version 2>/dev/null | head -1); $(date -u '+%Y-%m-%d %H:%M UTC'); $ELAPSED s in all"
    echo "$PRECISION AdamW, global batch $GLOBAL_BATCH x $SEQ tokens a step (micro-batch 1 x $SEQ; d data-parallel replicas x m micro-batches), $STEPS steps (median of those after the first), $NP ranks of 1 thread; pipeline schedule $SCHEDULE"
    echo "networks: shm = one machine, shared memory (btl self,vader)"
    for l in "${LINKS[@]}"; do
        echo "- ${l%%:*} = two machines of 2 ranks (network namespaces, TCP, btl self,tcp), link ${l%%:*} each way (tbf), no added delay; measured:${l#*:}"
    done
    echo
    echo "| model | network | layout | d x m | tokens/s | ms/step median (min–max) | tagged peak MiB, ranks 0/1/2/3 | peak RSS MiB (largest rank) | MB moved/step (rank 0) | collectives/step | % of step waiting | other load (cores) |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
    printf '%s\n' "${ROWS[@]}"
    echo
    echo "| model | network | layouts by tokens/s (fastest first) |"
    echo "|---|---|---|"
    printf '%s\n' "${ORDER[@]}"
    echo
    echo "The runs (fitlm is $FITLM; the logs are in $LOG):"
    echo
    echo '```sh'
    for name in "${CMDS[@]}"; do sed "s|$FITLM|fitlm|" "$LOG/$name.cmd"; done
    echo '```'
} | tee "${ADVICE_OUT:-/dev/null}"
