#!/usr/bin/env bash
# bench/recompute.sh: activation memory and step time of the activation
# checkpointing policies (none, selective, block), measured side by side in
# one run, for GPT-2 124M and a LLaMA shape (SmolLM-135M: 30 blocks, 576
# channels, 9 heads / 3 KV heads, SwiGLU 1536, tied; with GPT-2's vocabulary,
# since it trains on GPT-2 tokens), at B=8 with T=256 and T=1024:
#
#   fitlm train --model M --batch 8 --seq-len T --steps S --warmup 0 --eval-every 0
#               --val-data none --sample-tokens 0 --out '' --mem-report
#               --activation-checkpointing P [--vocab-size 50257]
#
# For each run: the acts tag's peak from the memory report (exact, and equal
# to what `fitlm plan` predicts for the same flags, which is printed beside
# it), the process's peak RSS, and the median step time over the steps after
# the first (with min and max); the ratio of each policy's median to the
# none policy's of the same shape. Prints the CPU model and ISA.
#
#   bench/recompute.sh                  # ~15 minutes on 2 cores; prints the table
#   RECOMPUTE_OUT=file bench/recompute.sh
#
# Knobs: BUILD [build], THREADS [2], STEPS [4], PRECISION [fp32], SHAPES
# ["256 1024"], MODELS ["gpt2 smollm-135m"], LOG [a fresh /tmp dir], NO_BUILD=1.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=${BUILD:-build}
THREADS=${THREADS:-2}
STEPS=${STEPS:-4}
PRECISION=${PRECISION:-fp32}
SHAPES=${SHAPES:-"256 1024"}
MODELS=${MODELS:-"gpt2 smollm-135m"}
LOG=${LOG:-$(mktemp -d "${TMPDIR:-/tmp}/fitlm-recompute.XXXXXX")}
mkdir -p "$LOG"

source bench/lib.sh
bench_build

ROWS=()
for model in $MODELS; do
    extra=()
    [[ $model == gpt2 ]] || extra=(--vocab-size 50257)
    for T in $SHAPES; do
        none_ms=
        for policy in none selective block; do
            name="${model}_T${T}_${policy}"
            flags=(--model "$model" "${extra[@]}" --batch 8 --seq-len "$T" --steps "$STEPS" --warmup 0
                --eval-every 0 --val-data none --sample-tokens 0 --out '' --threads "$THREADS"
                --precision "$PRECISION" --activation-checkpointing "$policy")
            echo "== fitlm train ${flags[*]} --mem-report" >&2
            /usr/bin/time -v "$FITLM" train "${flags[@]}" --mem-report >"$LOG/$name.log" 2>"$LOG/$name.time" ||
                { tail -5 "$LOG/$name.log" >&2; ROWS+=("| $model | $T | $policy | failed | | | | |"); continue; }
            "$FITLM" plan "${flags[@]}" >"$LOG/$name.plan" 2>&1
            acts=$(awk -v m="$(tag_peak acts "$LOG/$name.log")" 'BEGIN { printf "%.2f", m }')
            planned=$(plan_bytes acts "$LOG/$name.plan")
            rss=$(awk '/Maximum resident set size/ { printf "%.0f", $NF / 1024 }' "$LOG/$name.time")
            read -r med lo hi <<<"$(step_ms "$LOG/$name.log")"
            [[ $policy == none ]] && none_ms=$med
            ratio=$(awk -v a="$med" -v b="$none_ms" 'BEGIN { printf "%.2f", a / b }')
            ROWS+=("| $model | $T | $policy | $acts | $(awk -v b="$planned" 'BEGIN { printf "%.2f", b / 1048576 }') | $rss | $med ($lo–$hi) | $ratio |")
        done
    done
done

{
    echo "$(bench_cpu); $THREADS threads; $PRECISION; B=8; median of $((STEPS - 1)) steps after the first"
    echo
    echo "| model | T | policy | acts MiB (measured) | acts MiB (fitlm plan) | peak RSS MiB | ms/step median (min–max) | step time vs none |"
    echo "|---|---|---|---|---|---|---|---|"
    printf '%s\n' "${ROWS[@]}"
} | tee "${RECOMPUTE_OUT:-/dev/null}"
