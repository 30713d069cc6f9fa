#!/usr/bin/env bash
# A supervised fine-tuning demo: instruction data with loss masks, measured
# before and after with `fitlm eval`, plotted with `fitlm plot`.
#
#   1. a small LLaMA-shaped model is pretrained briefly on the Brown corpus in
#      byte tokens (one per character, so no tokenizer files are needed);
#   2. a synthetic instruction set (questions about the sum of two digits,
#      three phrasings, in the `messages` chat layout; 3000 examples, 10%
#      held out)
#      is tokenized with `fitlm tokenize --format jsonl`: the default chat
#      template, packed into windows of 128+1 bytes, the answers the only
#      targets;
#   3. `fitlm eval` measures the pretrained model on the held-out answers;
#   4. `fitlm train --init-from` fine-tunes it on the training answers
#      (AdamW; the loss is the mean over answer tokens of each batch);
#   5. `fitlm eval` measures the fine-tuned model on the same answers, and
#      `fitlm sample` answers a question, greedily;
#   6. `fitlm plot` draws both runs' curves into OUT/plots.
#
#   bash scripts/sft_demo.sh           # ~2.5 minutes on 2 cores
#
# Everything is written under OUT (default out/sft_demo); a re-run starts it
# afresh. Knobs: OUT [out/sft_demo], BUILD [build], THREADS [2],
# PRETRAIN_STEPS [150], FT_STEPS [900]. Needs data/brown.txt
# (scripts/setup.sh makes it).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-out/sft_demo}
BUILD=${BUILD:-build}
THREADS=${THREADS:-2}
PRETRAIN_STEPS=${PRETRAIN_STEPS:-150}
FT_STEPS=${FT_STEPS:-900}
FITLM=$BUILD/fitlm

[[ -f data/brown.txt ]] || bash scripts/setup.sh
if [[ ! -x $FITLM ]]; then
    cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null
    cmake --build "$BUILD" -j "$(nproc)" --target fitlm >/dev/null
fi
rm -rf "$OUT"
mkdir -p "$OUT/data"
start=$SECONDS

# 1. pretraining data and model: 4 blocks, 192 channels, 6 query / 2 key-value heads
"$FITLM" tokenize data/brown.txt -o "$OUT/data/brown" --tokenizer byte --threads "$THREADS" |
    tail -n 1
MODEL=(--model demo --arch llama --n-layer 4 --n-embd 192 --n-head 6 --n-kv-head 2
    --intermediate-size 512 --max-seq-len 128)
COMMON=(--tokenizer byte --seq-len 128 --threads "$THREADS" --sample-tokens 0)
echo
echo "== pretraining on the Brown corpus ($PRETRAIN_STEPS steps)"
"$FITLM" train "${MODEL[@]}" "${COMMON[@]}" --batch 16 --data "$OUT/data/brown" \
    --steps "$PRETRAIN_STEPS" --lr 3e-3 --warmup 20 --eval-every 0 --eval-iters 8 \
    --out "$OUT/pretrain" | grep -E '^(model|final)|  *[0-9]*0/'

# 2. the instruction set, the same on every run
python3 - "$OUT/data/sums.jsonl" <<'EOF'
import json, random, sys
rng = random.Random(1961)
with open(sys.argv[1], "w") as f:
    for _ in range(3000):
        a, b = rng.randrange(10), rng.randrange(10)
        q = rng.choice(["What is {a} plus {b}?", "Add {a} and {b}.", "Compute {a} + {b}."])
        messages = [{"role": "user", "content": q.format(a=a, b=b)},
                    {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]
        f.write(json.dumps({"messages": messages}) + "\n")
EOF
echo
"$FITLM" tokenize "$OUT/data/sums.jsonl" -o "$OUT/data/sums" --format jsonl --tokenizer byte \
    --seq-len 128 --val-fraction 0.1

# 3-5. eval, fine-tune, eval again
evaluate() { # the held-out answers' loss, from --json
    "$FITLM" eval --checkpoint "$1" --data "$OUT/data/sums" --threads "$THREADS" --json |
        python3 -c 'import json,sys; r=json.load(sys.stdin); print("%.4f nats/token over %d answer tokens (perplexity %.3f)" % (r["loss"], r["tokens"], r["perplexity"]))'
}
echo
echo "== before fine-tuning: $(evaluate "$OUT/pretrain")"
echo
echo "== fine-tuning on the answers ($FT_STEPS steps)"
"$FITLM" train --init-from "$OUT/pretrain" "${COMMON[@]}" --batch 8 --data "$OUT/data/sums" \
    --steps "$FT_STEPS" --lr 1e-3 --warmup 10 --eval-every 50 --eval-iters 8 \
    --out "$OUT/sft" | grep -E '^final|  *[0-9]*0/'
echo
echo "== after fine-tuning: $(evaluate "$OUT/sft")"
echo
echo "== a question (greedy):"
"$FITLM" sample --checkpoint "$OUT/sft" --threads "$THREADS" --temperature 0 --tokens 12 \
    --prompt $'### User:\nWhat is 7 plus 5?\n\n### Assistant:\n' | tail -n 3

# 6. the curves
echo
"$FITLM" plot "$OUT/pretrain" "$OUT/sft" -o "$OUT/plots"
echo "sft demo: done in $((SECONDS - start)) s; figures in $OUT/plots"
