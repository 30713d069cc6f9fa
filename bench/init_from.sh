#!/usr/bin/env bash
# bench/init_from.sh: the time `fitlm eval --init-from DIR` takes for a GPT-2
# XL-shaped Hugging Face directory (48 layers, 25 heads, 1600 channels,
# vocabulary 50257: 1.56 B parameters, bf16 safetensors written by
# bench/make_hf_gpt2.py), with a fitlm built before the weight source
# (BEFORE) and this tree's, alternated over ROUNDS rounds in one run. The
# command opens the weights (bf16), evaluates one window of 16 tokens and
# exits: its wall time is, all but the forward, the time to open the model.
# Both also print the same loss (the same weights), which is checked.
#
#   git archive 8139f95 | tar -x -C /tmp/fitlm_before
#   (cd /tmp/fitlm_before && cmake -S . -B build && cmake --build build --target fitlm)
#   BEFORE=/tmp/fitlm_before/build/fitlm bash bench/init_from.sh   # ~4 minutes on 2 busy cores
#
# Knobs: BEFORE (required), BUILD [build], ROUNDS [3], THREADS [2],
# HF_DIR [/tmp/fitlm-gpt2xl-hf, written once, 3.1 GB], LOG [a fresh /tmp
# dir], NO_BUILD=1.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=${BUILD:-build}
ROUNDS=${ROUNDS:-3}
THREADS=${THREADS:-2}
HF_DIR=${HF_DIR:-/tmp/fitlm-gpt2xl-hf}
LOG=${LOG:-$(mktemp -d "${TMPDIR:-/tmp}/fitlm-init-from.XXXXXX")}
[[ -x ${BEFORE:-} ]] || { echo "BEFORE must name a fitlm binary built before the change" >&2; exit 1; }
mkdir -p "$LOG"

source bench/lib.sh
bench_build

if [[ ! -f $HF_DIR/model.safetensors ]]; then
    mkdir -p "$HF_DIR"
    free_gb=$(df -P -k "$HF_DIR" | awk 'NR == 2 { print int($4 / 1048576) }')
    ((free_gb >= 4)) || { echo "$HF_DIR: $free_gb GB free, 4 needed" >&2; exit 1; }
    python3 bench/make_hf_gpt2.py "$HF_DIR"
fi
# a text of GPT-2 tokens to evaluate
python3 -c "
import random; random.seed(0)
w = 'the of and to a in is that for it as was with be by on not he this are or his'.split()
print(' '.join(random.choice(w) for _ in range(200)))" >"$LOG/text.txt"
cat "$HF_DIR/model.safetensors" >/dev/null # in the page cache for every run alike

echo "$(bench_cpu); $THREADS threads; load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "fitlm eval --init-from $HF_DIR --precision bf16 --seq-len 16 --batch 1, $ROUNDS rounds"
declare -A TIMES
for ((r = 1; r <= ROUNDS; r++)); do
    for which in before after; do
        bin=$FITLM
        [[ $which == before ]] && bin=$BEFORE
        t0=$(date +%s.%N)
        "$bin" eval --init-from "$HF_DIR" --text "$LOG/text.txt" --seq-len 16 --batch 1 \
            --precision bf16 --threads "$THREADS" >"$LOG/$which.$r.log" 2>&1
        t1=$(date +%s.%N)
        s=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }')
        TIMES[$which]+="$s"$'\n'
        echo "  round $r $which: $s s ($(grep -m1 '^loss' "$LOG/$which.$r.log"))"
    done
done
[[ $(grep -h '^loss' "$LOG"/*.log | sort -u | wc -l) == 1 ]] ||
    { echo "the runs disagree on the loss: not the same weights" >&2; exit 1; }
read -r bm bmin bmax <<<"$(printf "%s" "${TIMES[before]}" | median_min_max)"
read -r am amin amax <<<"$(printf "%s" "${TIMES[after]}" | median_min_max)"
echo
echo "| binary | median s | min s | max s |"
echo "|---|---|---|---|"
echo "| before (BEFORE) | $bm | $bmin | $bmax |"
echo "| after (this tree) | $am | $amin | $amax |"
awk -v b="$bm" -v a="$am" 'BEGIN { printf "speed-up: %.1fx; load average at the end: ", b / a }'
cut -d' ' -f1-3 /proc/loadavg
