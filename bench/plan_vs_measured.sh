#!/usr/bin/env bash
# bench/plan_vs_measured.sh: `fitlm plan`'s prediction against the measured
# peak of every allocator tag, on the GPT-2 124M and 355M shapes, fp32 and
# bf16 AdamW, one training step at batch 4 x 256 tokens:
#
#   fitlm plan  --model M --vocab-size 50257 --batch 4 --seq-len 256 --precision P ...
#   fitlm train (same flags) --steps 1 --eval-every 0 --sample-tokens 0 --out '' --mem-report
#
# Prints a markdown table: per tag, planned MiB, measured peak MiB and the
# difference in percent. BUILD [build], THREADS [2], OUT (also write it there).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
THREADS=${THREADS:-2}
LOG=$(mktemp -d "${TMPDIR:-/tmp}/fitlm-plan.XXXXXX")
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD" -j "$(nproc)" --target fitlm >"$LOG/build.log" 2>&1 || { cat "$LOG/build.log"; exit 1; }

TAGS=(params grads master optim acts workspace other)
TABLE="| model | precision | tag | planned MiB | measured peak MiB | difference |
|---|---|---|---|---|---|"
for model in gpt2 gpt2-medium; do
    for prec in fp32 bf16; do
        flags=(--model "$model" --vocab-size 50257 --batch 4 --seq-len 256 --precision "$prec"
            --threads "$THREADS" --sample-tokens 0)
        name="${model}_$prec"
        echo "== $model $prec" >&2
        "$BUILD/fitlm" plan "${flags[@]}" >"$LOG/$name.plan"
        "$BUILD/fitlm" train "${flags[@]}" --steps 1 --eval-every 0 --out '' --mem-report \
            >"$LOG/$name.log" 2>&1 || { tail -5 "$LOG/$name.log"; exit 1; }
        for tag in "${TAGS[@]}" total; do
            planned=$(awk -v t="$tag" '$1 == t && $2 ~ /^[0-9]+$/ { printf "%.2f", $2 / 1048576 }' "$LOG/$name.plan")
            if [[ $tag == total ]]; then
                measured=$(awk '/^  total tagged/ { print $4 }' "$LOG/$name.log")
            else
                measured=$(awk -v t="$tag" '/^memory by tag/ { on = 1 } on && $1 == t { print $3 }' "$LOG/$name.log")
            fi
            TABLE+=$'\n'$(awk -v m="$model" -v p="$prec" -v t="$tag" -v a="$planned" -v b="$measured" 'BEGIN {
                d = (b > 0) ? 100 * (a - b) / b : 0
                printf "| %s | %s | %s | %.2f | %.2f | %+.2f%% |", m, p, t, a, b, d }')
        done
    done
done
echo "$TABLE"
if [[ -n ${OUT:-} ]]; then echo "$TABLE" >"$OUT"; fi
echo "(logs in $LOG)" >&2
