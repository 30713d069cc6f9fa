#!/usr/bin/env bash
# bench/memory.sh: measured memory per parameter by precision and optimizer.
# For each of {fp32, bf16, fp16} x {adamw, sgd --momentum 0.9, sgd} it runs
# one training step of GPT-2 124M at batch 1 x 64 tokens,
#
#   fitlm train --model gpt2 --vocab-size 50257 --batch 1 --seq-len 64 --steps 1
#               --eval-every 0 --sample-tokens 0 --out '' --mem-report
#               --precision P --optimizer O [--momentum 0.9]
#
# parses the per-tag peaks of its memory report (MiB) and its process peak
# RSS, runs `fitlm plan` with the same flags for the prediction, and prints a
# markdown table of MiB and bytes/param: the model states (params + grads +
# master + optim), everything tagged, the plan's total and the peak RSS.
#
#   bench/memory.sh                     # ~2 minutes; prints the table
#   MEM_OUT=file bench/memory.sh        # also writes the table (markdown) there
#
# Environment knobs: BUILD (build directory, [build]; the script builds the
# fitlm target there), THREADS [2], PRECISIONS ["fp32 bf16 fp16"], MEM_OUT,
# LOG (directory for the logs [a fresh /tmp/fitlm-mem.*]), NO_BUILD=1 (use
# $BUILD/fitlm as it is). bench/train.sh runs it and puts the table in
# bench/results.md.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=${BUILD:-build}
THREADS=${THREADS:-2}
PRECISIONS=${PRECISIONS:-"fp32 bf16 fp16"}
LOG=${LOG:-$(mktemp -d "${TMPDIR:-/tmp}/fitlm-mem.XXXXXX")}
mkdir -p "$LOG"

if [[ ${NO_BUILD:-0} != 1 ]]; then
    cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null
    cmake --build "$BUILD" -j "$(nproc)" --target fitlm >"$LOG/build-fitlm.log" 2>&1 ||
        { cat "$LOG/build-fitlm.log"; exit 1; }
fi
FITLM=$BUILD/fitlm

BASE=(--model gpt2 --vocab-size 50257 --batch 1 --seq-len 64 --steps 1 --eval-every 0
    --sample-tokens 0 --out '' --threads "$THREADS")
SHOWN="fitlm train --model gpt2 --vocab-size 50257 --batch 1 --seq-len 64 --steps 1 --eval-every 0 --sample-tokens 0 --out '' --threads $THREADS"
OPTIMIZERS=("adamw" "sgd --momentum 0.9" "sgd")

# tag_peak TAG LOG: the peak column (MiB) of TAG's line in a memory report
tag_peak() {
    awk -v t="$1" '$0 ~ /^memory by tag/ { on = 1 } on && $1 == t { v = $3 } END { print v + 0 }' "$2"
}

ROWS=()
for prec in $PRECISIONS; do
    for o in "${OPTIMIZERS[@]}"; do
        read -r -a oargs <<<"--optimizer $o"
        name="mem_${prec}_${o// /_}"
        flags=("${BASE[@]}" --precision "$prec" "${oargs[@]}")
        echo "== $SHOWN --precision $prec --optimizer $o --mem-report" >&2
        "$FITLM" train "${flags[@]}" --mem-report >"$LOG/$name.log" 2>&1 ||
            { tail -5 "$LOG/$name.log" >&2; ROWS+=("| $prec | $o | failed | | | | | | | | |"); continue; }
        "$FITLM" plan "${flags[@]}" >"$LOG/$name.plan" 2>&1 || true
        log=$LOG/$name.log
        np=$(awk '/ parameters \(/ { print $1; exit }' "$log")
        p=$(tag_peak params "$log") g=$(tag_peak grads "$log")
        m=$(tag_peak master "$log") s=$(tag_peak optim "$log")
        tot=$(awk '/^  total tagged/ { print $4 }' "$log")
        rss=$(awk '/^  process peak RSS/ { print $4 }' "$log")
        plan=$(awk '$1 == "total" && $2 ~ /^[0-9]+$/ { print $2 / 1048576 }' "$LOG/$name.plan")
        ROWS+=("$(awk -v P="$prec" -v O="$o" -v n="$np" -v p="$p" -v g="$g" -v m="$m" -v s="$s" \
            -v tot="$tot" -v rss="$rss" -v plan="${plan:-0}" 'BEGIN {
                st = p + g + m + s; b = 1048576 / n
                printf "| %s | %s | %.1f | %.1f | %.1f | %.1f | %.1f (%.2f) | %.1f | %.1f (%.2f) | %.1f (%+.1f) | %.1f (%.2f) |",
                    P, O, p, g, m, s, st, st * b, tot - st, tot, tot * b, plan, plan - tot, rss, rss * b }')")
        NP=$np
    done
done

TABLE="| precision | optimizer | params MiB | grads MiB | master MiB | optim MiB | model states MiB (B/param) | acts+workspace+other MiB | total tagged MiB (B/param) | \`fitlm plan\` total MiB (plan - measured) | peak RSS MiB (B/param) |
|---|---|---|---|---|---|---|---|---|---|---|"
for r in "${ROWS[@]}"; do TABLE+=$'\n'"$r"; done

OUT="GPT-2 124M (${NP:-?} parameters, padded vocabulary included), one training step at batch 1 x 64 tokens, $THREADS threads: \`$SHOWN --precision P --optimizer O [--momentum 0.9] --mem-report\`. MiB are the per-tag peaks of the memory report; bytes/param = bytes / parameters. Model states = params + grads + master + optim; total tagged = the peak of the sum of all tags; peak RSS = the process's VmHWM (tagged memory plus code, libraries, BLAS/oneDNN buffers). The plan column is \`fitlm plan\` with the same flags.

$TABLE"
echo "$OUT"
if [[ -n ${MEM_OUT:-} ]]; then echo "$OUT" >"$MEM_OUT"; fi
echo "(logs in $LOG)" >&2
