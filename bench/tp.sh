#!/usr/bin/env bash
# bench/tp.sh: tensor parallelism (Megatron) measured beside ZeRO-3 at the
# same rank count. For GPT-2 124M (gpt2) and 355M (gpt2-medium), fp32 AdamW,
# one thread per rank (Open MPI, shared memory; 4 ranks oversubscribe 2
# cores), each run
#
#   mpirun.openmpi -q --bind-to none -np t fitlm train --model M --batch 1
#       --seq-len 64 --steps S --warmup 0 --eval-every 0 --val-data none
#       --sample-tokens 0 --out '' --threads 1 --mem-report
#       --tensor-parallel t [--sequence-parallel]      (TP, TP+SP)
#       --zero-stage 3 --reduce-bucket-size 5e6 --allgather-bucket-size 5e6
#           [--prefetch-bucket-size BLOCK]   (ZeRO-3, no TP; BLOCK: one block
#                                             gathered ahead)
#
# at t = 2 and 4, and the same flags without mpirun and the layout ones at
# t = 1 (one process). Each rank runs under /usr/bin/time with its own output
# files. Per run it reads:
#   - per rank, --mem-report's peak of each tag (rank 0's in the table; the
#     ranks' largest tagged peak beside it) and the peak RSS; beside the acts
#     tag, `fitlm plan` with the same flags (--ranks t);
#   - rank 0's "communication per step and rank" line: elements per step (what
#     a ring moves per rank: 2n(t-1)/t for an all-reduce of n, n(t-1)/t for an
#     all-gather or reduce-scatter of n), collectives, percent of the step
#     waiting; against the theory in the same units, with E = B T C (t-1)/t
#     and X = B T (t-1)/t:
#       TP, Megatron: per layer two all-reduces of B T C forward (after the
#         row-parallel attention and MLP projections) and two backward (before
#         the column-parallel c_attn and c_fc): 8E a layer; the embedding's
#         all-reduce 2E (forward) and the LM head's input gradient 2E
#         (backward); the cross-entropy's max (B T) and sum-of-exponentials
#         and target-logit (2 B T) all-reduces, 6X; the gradient norm's
#         per-row sums of squares and the overflow flag over TP, rows + 1
#         scalars (2(t-1)/t each): (8L + 4)E + 6X + 2(rows + 1)(t-1)/t;
#       TP+SP: each all-reduce a reduce-scatter plus an all-gather (the same
#         bytes), plus the all-gathers the backward repeats: the column
#         layers' inputs again (2E a layer; Megatron does not keep them
#         either), the LM head's input (E) and the embedding's output
#         gradient (E, GPT-2 keeps its positions of the all-reduced sum);
#         plus the norms' weight gradients summed over TP (4C a layer, 2C
#         for ln_f): (10L + 6)E + 6X + 2((4L + 2)C + rows + 1)(t-1)/t;
#       ZeRO-3: 3(t-1)/t x P, and what its reuse leaves (bench/dist.sh),
#         with the default prefetch (5e7 elements: 7 GPT-2 124M blocks,
#         3 of 355M, gathered ahead) and with one block (12C^2 + 13C, the
#         memory-lean setting);
#   - step time: the median of rank 0's step times after the first (min-max),
#     and tokens/s: the data-parallel ranks x B x T over it (TP: one
#     replica, B T tokens a step; ZeRO-3: t replicas, t B T);
#   - the other load during the run, as bench/dist.sh.
# Then per model and t the comparison TP+SP against ZeRO-3: memory per rank
# (tagged peak, acts) and time per token. Last, the activations per rank of
# 124M at longer sequences (ACT_SEQS): TP+SP measured over one step against
# ZeRO-3's, which are one process's at the same micro-batch (`fitlm plan`,
# exact there), and the plan's TP+SP figure.
#
#   bench/tp.sh                 # 8-12 minutes on 2 shared cores; prints the tables
#   TP_OUT=file bench/tp.sh     # ... and writes them to file
#
# Knobs: BUILD [build], MODELS ["gpt2 gpt2-medium"], BATCH [1] (per
# data-parallel replica), SEQ [64], STEPS ["gpt2=6 gpt2-medium=4"] (or one
# number), RANKS ["2 4"], LAYOUTS ["tp sp z3 z3p"], BUCKET [5e6] (ZeRO-3's
# reduce and all-gather buckets, elements, as bench/dist.sh: the defaults,
# DeepSpeed's 5e8, allocate buffers the size of the whole model, 1166 MiB of
# comm buffers per rank for 124M), ACT_SEQS ["256 512"] ("": none),
# IDLE_WAIT [0], MPIEXEC_TIMEOUT [900], LOG [a fresh /tmp dir], NO_BUILD=1.
# GPT-2 shapes only (the theory counts GPT-2's rows).
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=${BUILD:-build}
MODELS=${MODELS:-"gpt2 gpt2-medium"}
BATCH=${BATCH:-1}
SEQ=${SEQ:-64}
STEPS=${STEPS:-"gpt2=6 gpt2-medium=4"}
RANKS=${RANKS:-"2 4"}
LAYOUTS=${LAYOUTS:-"tp sp z3 z3p"}
BUCKET=${BUCKET:-5e6}
BUCKETS=(--reduce-bucket-size "$BUCKET" --allgather-bucket-size "$BUCKET")
ACT_SEQS=${ACT_SEQS-"256 512"}
source bench/lib.sh
bench_mpi_setup tp

# steps_of MODEL: its entry of STEPS (one number: every model's)
steps_of() {
    [[ $STEPS != *=* ]] && { echo "$STEPS"; return; }
    local w
    for w in $STEPS; do [[ ${w%%=*} == "$1" ]] && { echo "${w#*=}"; return; }; done
    echo 3
}

# set_flags MODEL SEQ STEPS T LAYOUT: fitlm train's flags for one run, in FLAGS
set_flags() {
    FLAGS=(--model "$1" --batch "$BATCH" --seq-len "$2" --steps "$3" --warmup 0 --eval-every 0
        --val-data none --sample-tokens 0 --out '' --threads 1 --mem-report)
    case $5 in
    tp) FLAGS+=(--tensor-parallel "$4") ;;
    sp) FLAGS+=(--tensor-parallel "$4" --sequence-parallel) ;;
    z3) FLAGS+=(--zero-stage 3 "${BUCKETS[@]}") ;;
    z3p) FLAGS+=(--zero-stage 3 "${BUCKETS[@]}" --prefetch-bucket-size "$BLOCK") ;;
    esac
}

# run NAME N FLAG...: one run (N = 1: no mpirun); the load file has the wall
# seconds, the machine's busy CPU seconds and the ranks' CPU seconds
run() {
    local name=$1 n=$2 b0 b1 t0 t1
    shift 2
    local cmd=("$FITLM" train "$@")
    ((n > 1)) && cmd=(mpirun.openmpi -q --bind-to none -np "$n" "${cmd[@]}")
    {
        printf '%q ' "${cmd[@]}" | sed 's/ $//'
        echo
    } >"$LOG/$name.cmd"
    echo "== $(cat "$LOG/$name.cmd")" >&2
    RAN+=("$name")
    idle_wait
    b0=$(busy_s)
    t0=$(date +%s.%N)
    if ((n > 1)); then
        nice mpirun.openmpi -q --bind-to none -np "$n" "$LOG/rank.sh" "$LOG/$name" "$FITLM" train "$@"
    else
        nice "$LOG/rank.sh" "$LOG/$name" "$FITLM" train "$@"
    fi || { tail -n 3 "$LOG/$name".r*.err >&2; return 1; }
    t1=$(date +%s.%N)
    b1=$(busy_s)
    echo "$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }') $(awk -v a="$b0" -v b="$b1" 'BEGIN { print b - a }') \
$(cat "$LOG/$name".r*.time | awk '{ s += $1 + $2 } END { print s }')" >"$LOG/$name.load"
}

# tag_mib TAG LOG: the peak MiB of TAG in a --mem-report
tag_mib() {
    awk -v t="$1" '$0 ~ /^memory by tag/ { on = 1 } on && $1 == t { v = $3 } END { printf "%.1f", v }' "$2"
}

# theory LAYOUT L C B T t rows P Vpad maxT: elements per rank and step, two
# numbers: Megatron's TP (ZeRO-3: 3(t-1)/t P) and the layout's own
theory() {
    local lay=$1 L=$2 C=$3 B=$4 T=$5 t=$6 rows=$7 P=$8 V=$9 maxT=${10}
    if [[ $lay == z3* ]]; then
        local g
        g=$(stage3_gathered "$P" "$L" "$C" "$V" "$maxT" "$([[ $lay == z3p ]] && echo "$BLOCK" || echo 5e7)")
        awk -v P="$P" -v t="$t" -v g="$g" 'BEGIN { printf "%.0f %.0f", 3 * P * (t - 1) / t, (1 + g) * P * (t - 1) / t }'
        return
    fi
    awk -v s="$lay" -v L="$L" -v C="$C" -v B="$B" -v T="$T" -v t="$t" -v rows="$rows" 'BEGIN {
        r = (t - 1) / t; E = B * T * C * r; X = B * T * r
        tp = (8 * L + 4) * E + 6 * X + 2 * (rows + 1) * r
        sp = (10 * L + 6) * E + 6 * X + 2 * ((4 * L + 2) * C + rows + 1) * r
        printf "%.0f %.0f", tp, s == "sp" ? sp : tp }'
}

# measure NAME N LAYOUT: "key=value" words of one run
measure() {
    local name=$1 n=$2 lay=$3 out="$LOG/$1.r0.out" r med lo hi
    for ((r = 0; r < n; r++)); do cat "$LOG/$name.r$r.out" "$LOG/$name.r$r.err" >"$LOG/$name.r$r.all"; done
    read -r med lo hi <<<"$(step_ms "$out")"
    local replicas=1
    [[ $lay == z3* ]] && replicas=$n
    echo "med=$med lo=$lo hi=$hi"
    echo "tps=$(awk -v t="$((replicas * BATCH * SEQ_NOW))" -v m="$med" 'BEGIN { printf "%.0f", (m > 0 ? t * 1000 / m : 0) }')"
    awk '/^communication per step and rank/ {
        gsub(/[(),;%]/, " "); printf "elem=%s coll=%s waitpct=%s\n", $6, $15, $17 }' "$out"
    local tag
    for tag in params grads optim acts workspace comm; do echo "$tag=$(tag_mib "$tag" "$LOG/$name.r0.all")"; done
    local tot=0 rss=0 v
    for ((r = 0; r < n; r++)); do
        v=$(tag_peak total "$LOG/$name.r$r.all")
        tot=$(awk -v a="$tot" -v b="$v" 'BEGIN { print (b > a ? b : a) }')
        v=$(awk '/process peak RSS/ { v = $4 } END { print v + 0 }' "$LOG/$name.r$r.all")
        rss=$(awk -v a="$rss" -v b="$v" 'BEGIN { print (b > a ? b : a) }')
    done
    echo "total=$(printf %.0f "$tot") rss=$(printf %.0f "$rss")"
    awk '{ printf "load=%.2f\n", ($2 - $3) / $1 }' "$LOG/$name.load"
}

# plan_acts MODEL SEQ N LAYOUT: `fitlm plan`'s acts MiB for that run
plan_acts() {
    set_flags "$1" "$2" 1 "$3" "$4"
    "$FITLM" plan "${FLAGS[@]}" --ranks "$3" >"$LOG/plan.txt" 2>&1 || { echo "-"; return; }
    awk '$1 == "acts" { printf "%.1f", $2 / 1048576; exit }' "$LOG/plan.txt"
}

label() {
    case $1 in
    one) echo "1 process" ;;
    tp) echo "TP" ;;
    sp) echo "TP+SP" ;;
    z3) echo "ZeRO-3" ;;
    z3p) echo "ZeRO-3, 1-block prefetch" ;;
    esac
}

START=$(date +%s)
RAN=() # the runs' names, in order
FIRST=${MODELS%% *}
ROWS=()
CMP=()
declare -A R # R[model,t,layout,key]
SEQ_NOW=$SEQ
for model in $MODELS; do
    steps=$(steps_of "$model")
    L='' C='' P='' V='' maxT='' BLOCK=''
    for t in 1 $RANKS; do
        lays=$([[ $t == 1 ]] && echo one || echo "$LAYOUTS")
        for lay in $lays; do
            name="${model}_t${t}_$lay"
            set_flags "$model" "$SEQ" "$steps" "$t" "$lay"
            if ! run "$name" "$t" "${FLAGS[@]}"; then
                ROWS+=("| $model | $(label "$lay") | $t | failed (see $LOG/$name.r*.err) ||||||||||||||")
                continue
            fi
            if [[ -z $L ]]; then # the shape, from the first run's start-up lines
                read -r L C V maxT <<<"$(sed -n 's/.*n_layer \([0-9]*\),.*n_embd \([0-9]*\),.*(padded \([0-9]*\)), max_seq_len \([0-9]*\).*/\1 \2 \3 \4/p' "$LOG/$name.r0.out" | head -1)"
                P=$(awk '/ parameters \(/ { print $1; exit }' "$LOG/$name.r0.out")
                BLOCK=$((12 * C * C + 13 * C)) # a GPT-2 block's elements
            fi
            read -r -a m <<<"$(measure "$name" "$t" "$lay" | tr '\n' ' ')"
            for w in "${m[@]}"; do R[$model,$t,$lay,${w%%=*}]=${w#*=}; done
            pa=$(plan_acts "$model" "$SEQ" "$t" "$([[ $lay == one ]] && echo none || echo "$lay")")
            comm="-" ratio="-" th="-"
            if ((t > 1)); then
                read -r th_full th_own <<<"$(theory "$lay" "$L" "$C" "$BATCH" "$SEQ" "$t" $((4 + 12 * L)) "$P" "$V" "$maxT")"
                el=$(field elem "${m[@]}")
                [[ $el == - ]] && el=0 # no communication line: shows as 0 against the theory
                if [[ $lay == z3* ]]; then
                    th="3(t-1)/t P = $th_full; with reuse $th_own"
                elif [[ $lay == sp ]]; then
                    th="Megatron TP $th_full; with SP's re-gathers $th_own"
                else
                    th="$th_own"
                fi
                comm="$(printf '%.0f' "$el") / $(field coll "${m[@]}") / $(field waitpct "${m[@]}")%"
                ratio=$(awk -v a="$el" -v b="$th_own" 'BEGIN { printf "%.4f", a / b }')
            fi
            ROWS+=("| $model | $(label "$lay") | $t | $(field params "${m[@]}") | $(field grads "${m[@]}") | $(field optim "${m[@]}") | $(field acts "${m[@]}") ($pa) | $(field workspace "${m[@]}") | $(field comm "${m[@]}") | $(field total "${m[@]}") | $(field rss "${m[@]}") | $comm | $th | $ratio | $(field med "${m[@]}") ($(field lo "${m[@]}")–$(field hi "${m[@]}")) | $(field tps "${m[@]}") | $(field load "${m[@]}") |")
        done
        ((t == 1)) && continue
        k="$model,$t"
        [[ -n ${R[$k,sp,total]:-} && -n ${R[$k,z3,total]:-} ]] || {
            CMP+=("| $model | $t | not measured (a run failed) ||||||")
            continue
        }
        CMP+=("$(awk -v m="$model" -v t="$t" -v ts="${R[$k,sp,total]}" -v tz="${R[$k,z3,total]}" \
            -v tzp="${R[$k,z3p,total]:-0}" -v as="${R[$k,sp,acts]}" -v az="${R[$k,z3,acts]}" \
            -v ps="${R[$k,sp,tps]}" -v pz="${R[$k,z3,tps]}" -v pzp="${R[$k,z3p,tps]:-0}" \
            -v pt="${R[$k,tp,tps]:-0}" 'BEGIN {
            zmin = (tzp > 0 && tzp < tz ? tzp : tz); zfast = (pzp > pz ? pzp : pz)
            printf "| %s | %d | %.0f vs %.0f / %s (%s) | %.1f vs %.1f (%.2fx) | %s vs %s / %s (%s) | %s |",
                m, t, ts, tz, (tzp > 0 ? sprintf("%.0f", tzp) : "-"),
                (ts < zmin ? "TP+SP less" : "ZeRO-3 less"), as, az, (az > 0 ? as / az : 0),
                ps, pz, (pzp > 0 ? pzp : "-"),
                (ps < zfast ? sprintf("TP+SP costs more time: %.2fx", ps / zfast) : sprintf("TP+SP faster: %.2fx", ps / zfast)),
                (pt > 0 ? sprintf("%.2fx", ps / pt) : "-") }')")
    done
done

# the activations per rank of 124M at longer sequences: TP+SP measured (one
# step), ZeRO-3's from the plan (one process's, exact), the plan's TP+SP
ACTS=()
for seq in $ACT_SEQS; do
    SEQ_NOW=$seq
    z=$(plan_acts gpt2 "$seq" 1 none)
    for t in $RANKS; do
        name="gpt2_acts_s${seq}_t$t"
        set_flags gpt2 "$seq" 1 "$t" sp
        if run "$name" "$t" "${FLAGS[@]}"; then
            cat "$LOG/$name.r0.out" "$LOG/$name.r0.err" >"$LOG/$name.r0.all"
            a=$(tag_mib acts "$LOG/$name.r0.all")
            ACTS+=("| $seq | $t | $a | $z | $(awk -v a="$a" -v z="$z" 'BEGIN { printf "%.3f (1/%.2f)", a / z, z / a }') | $(plan_acts gpt2 "$seq" "$t" sp) |")
        else
            ACTS+=("| $seq | $t | failed (see $LOG/$name.r*.err) | $z |||")
        fi
    done
done
ELAPSED=$(($(date +%s) - START))

{
    echo "$(bench_cpu); $(nproc) cores"
    echo "Open MPI: $(mpirun.openmpi --version 2>/dev/null | head -1); btl self,vader (shared memory); $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "fp32 AdamW, micro-batch $BATCH x $SEQ tokens per data-parallel replica (TP: one replica of t ranks; ZeRO-3: t replicas), steps: $STEPS (median of those after the first), 1 thread per rank; $ELAPSED s in all"
    echo
    echo "The runs of $FIRST, in order (the other models' differ in --model, --steps and the block size; fitlm is $FITLM):"
    echo
    echo '```sh'
    for name in "${RAN[@]}"; do [[ $name == "${FIRST}"_t* ]] && sed "s|$FITLM|fitlm|" "$LOG/$name.cmd"; done
    echo '```'
    echo
    echo "Per rank (rank 0's tags; MiB, peaks of --mem-report). acts: measured (\`fitlm plan\`'s). tagged peak: the ranks' largest. comm: elements per step and rank as a ring moves them / collectives / percent of the step waiting on them; theory in the same units (the script's header); measured / theory: of the layout's own theory."
    echo
    echo "| model | layout | t | params | grads | optim | acts (plan) | workspace | comm buffers | tagged peak | peak RSS | elements / collectives / waiting | theory (elements) | measured / theory | ms/step median (min–max) | tokens/s | other load (cores) |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    printf '%s\n' "${ROWS[@]}"
    echo
    echo "TP+SP against ZeRO-3 at the same rank count (same micro-batch per replica: ZeRO-3 runs t x the tokens a step, so time is compared per token):"
    echo
    echo "| model | t | tagged peak MiB/rank, TP+SP vs ZeRO-3 / ZeRO-3 1-block prefetch | acts MiB/rank, TP+SP vs ZeRO-3 | tokens/s, TP+SP vs ZeRO-3 / 1-block prefetch (TP+SP / the faster) | TP+SP / TP tokens/s |"
    echo "|---|---|---|---|---|---|"
    printf '%s\n' "${CMP[@]}"
    if ((${#ACTS[@]})); then
        echo
        echo "Activations (acts tag) per rank, GPT-2 124M, micro-batch $BATCH: TP+SP measured over one step; ZeRO-3 holds one process's (\`fitlm plan\`, exact for it) on each rank:"
        echo
        echo "| seq | t | TP+SP MiB/rank | ZeRO-3 MiB/rank | TP+SP / ZeRO-3 | plan's TP+SP |"
        echo "|---|---|---|---|---|---|"
        printf '%s\n' "${ACTS[@]}"
    fi
} | tee "${TP_OUT:-/dev/null}"
