#!/usr/bin/env bash
# bench/lomo.sh: the LOMO paper's memory table (Lv et al. 2023, Table 1:
# parameters, gradients, optimizer states, activations, total), reproduced
# and measured, then the showcase: full-parameter LOMO training of a
# LLaMA-7B-shaped model on this 24 GiB machine.
#
#  (a) measured: TinyLlama-1.1B's shape (the largest LLaMA preset whose AdamW
#      row fits here), bf16, B=1, T=256, block activation checkpointing, on
#      byte tokens of the Brown corpus, for AdamW (fp32 master, m, v), SGD
#      (fp32 master, no momentum), LOMO and AdaLomo:
#        fitlm train --model tinyllama-1.1b --precision bf16 --batch 1 --seq-len 256
#          --activation-checkpointing block --optimizer O --steps 3 --mem-report ...
#      per-tag peaks (GiB) from the memory report, peak RSS, median tokens/s.
#  (b) planned: the llama-7b preset (6.74e9 parameters) from `fitlm plan`
#      with the same flags, beside the paper's figures.
#  (c) the showcase: LOMO on llama-7b, bf16, B=1, T=256, block checkpointing,
#      random weights, byte tokens (any vocabulary holds them), STEPS_7B
#      steps, no clipping (one backward per step); `fitlm plan` first, then
#      the measured run: peak RSS, tagged total against the plan, losses,
#      step time.
#
#   bench/lomo.sh                  # ~25 minutes on 2 cores
#   LOMO_OUT=file bench/lomo.sh    # also writes the tables there
#
# Knobs: BUILD [build], THREADS [2], STEPS [3], STEPS_7B [4], MODEL_A [tinyllama-1.1b], NO_7B=1 (skip
# (c)), LOG [a fresh /tmp dir], NO_BUILD=1.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=${BUILD:-build}
THREADS=${THREADS:-2}
STEPS=${STEPS:-3}
STEPS_7B=${STEPS_7B:-4}
MODEL_A=${MODEL_A:-tinyllama-1.1b}
LOG=${LOG:-$(mktemp -d "${TMPDIR:-/tmp}/fitlm-lomo.XXXXXX")}
mkdir -p "$LOG"

source bench/lib.sh
bench_build
[[ -f data/brown_byte/train_000000.bin ]] || FITLM=$FITLM bash scripts/tokenize.sh >/dev/null

COMMON=(--precision bf16 --batch 1 --seq-len 256 --activation-checkpointing block --tokenizer byte
    --data data/brown_byte --val-data none --eval-every 0 --sample-tokens 0 --out ''
    --threads "$THREADS" --warmup 0)

# gib TAG LOG|PLAN: TAG's peak in a memory report, or its bytes in a plan, in GiB
gib() {
    if [[ $2 == *.plan ]]; then
        awk -v b="$(plan_bytes "$1" "$2")" 'BEGIN { printf "%.2f", b / 1073741824 }'
    else
        awk -v m="$(tag_peak "$1" "$2")" 'BEGIN { printf "%.2f", m / 1024 }'
    fi
}
# median_tok LOG: the median tokens/s of the steps after the first
median_tok() {
    grep -o '[0-9]* tok/s' "$1" | awk 'NR > 1 { print $1 }' | median_min_max | awk '{ print $1 }'
}
opt_flags() {
    case $1 in
        adamw) echo "--optimizer adamw" ;;
        sgd) echo "--optimizer sgd --weight-decay 0" ;;
        lomo) echo "--optimizer lomo --lr 0.01" ;;
        adalomo) echo "--optimizer adalomo --lr 0.001" ;;
    esac
}

echo "$(bench_cpu); $THREADS threads"
echo
echo "(a) measured: $MODEL_A, bf16, B=1, T=256, block checkpointing, $STEPS steps"
echo
echo "| optimizer | params GiB | grads GiB | optimizer states GiB (master + state) | activations GiB | total GiB (tags) | peak RSS GiB | tokens/s (median) |"
echo "|---|---|---|---|---|---|---|---|"
for o in adamw sgd lomo adalomo; do
    read -r -a of <<<"$(opt_flags $o)"
    log=$LOG/tiny_$o.log
    /usr/bin/time -v "$FITLM" train --model "$MODEL_A" "${COMMON[@]}" --steps "$STEPS" "${of[@]}" \
        --mem-report >"$log" 2>"$LOG/tiny_$o.time" || { echo "| $o | failed (see $log) |"; continue; }
    p=$(gib params "$log"); g=$(gib grads "$log"); m=$(gib master "$log")
    s=$(gib optim "$log"); a=$(gib acts "$log"); total=$(gib total "$log")
    rss=$(awk '/Maximum resident set size/ { printf "%.2f", $NF / 1048576 }' "$LOG/tiny_$o.time")
    echo "| $o | $p | $g | $(awk -v a="$m" -v b="$s" 'BEGIN { printf "%.2f", a + b }') | $a | $total | $rss | $(median_tok "$log") |"
done

echo
echo "(b) planned: llama-7b (6,738,415,616 parameters), bf16, B=1, T=256, block checkpointing (fitlm plan)"
echo
echo "| optimizer | params GiB | grads GiB | optimizer states GiB | activations GiB | total GiB | LOMO paper (GB) |"
echo "|---|---|---|---|---|---|---|"
declare -A PAPER=([adamw]="102.20" [sgd]="51.99" [lomo]="14.58" [adalomo]="-")
for o in adamw sgd lomo adalomo; do
    read -r -a of <<<"$(opt_flags $o)"
    plan=$LOG/7b_$o.plan
    "$FITLM" plan --model llama-7b "${COMMON[@]}" "${of[@]}" --mem-limit 1T >"$plan" 2>&1
    ms=$(awk -v a="$(gib master "$plan")" -v b="$(gib optim "$plan")" 'BEGIN { printf "%.2f", a + b }')
    echo "| $o | $(gib params "$plan") | $(gib grads "$plan") | $ms | $(gib acts "$plan") | $(gib total "$plan") | ${PAPER[$o]} |"
done

[[ ${NO_7B:-0} == 1 ]] && exit 0
echo
echo "(c) showcase: LOMO on llama-7b, bf16, B=1, T=256, block checkpointing, $STEPS_7B steps, no clipping"
echo
flags=(--model llama-7b "${COMMON[@]}" --steps "$STEPS_7B" --optimizer lomo --lr 0.01 --grad-clip 0)
"$FITLM" plan "${flags[@]}" >"$LOG/7b_show.plan" 2>&1
planned=$(plan_bytes total "$LOG/7b_show.plan")
echo "command: fitlm train ${flags[*]} --mem-report"
/usr/bin/time -v "$FITLM" train "${flags[@]}" --mem-report >"$LOG/7b_show.log" 2>"$LOG/7b_show.time"
grep -E '^step' "$LOG/7b_show.log" | sed 's/^/    /'
tagged=$(awk -v m="$(tag_peak total "$LOG/7b_show.log")" 'BEGIN { printf "%.0f", m * 1048576 }')
rss=$(awk '/Maximum resident set size/ { printf "%.2f", $NF / 1048576 }' "$LOG/7b_show.time")
echo
echo "planned total $(awk -v b="$planned" 'BEGIN { printf "%.2f", b / 1073741824 }') GiB; measured tagged peak $(awk -v b="$tagged" 'BEGIN { printf "%.2f", b / 1073741824 }') GiB ($(awk -v a="$tagged" -v b="$planned" 'BEGIN { printf "%+.2f%%", 100 * (a - b) / b }') against the plan); peak RSS $rss GiB"
