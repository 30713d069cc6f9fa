#!/usr/bin/env bash
# A fine-tuning demo: a pretrained model fine-tuned with LoRA and QLoRA.
#
# A small LLaMA-shaped model is pretrained briefly on the non-fiction genres
# of the Brown corpus (a-j: news, editorials, reviews, religion, hobbies, lore,
# belles-lettres, government, learned; 374 documents), exported as a Hugging
# Face directory, then fine-tuned on the fiction genres (k-r: general fiction,
# mystery, science fiction, adventure, romance, humor; 126 documents) twice:
# with LoRA on its bf16/fp32 weights, and with QLoRA on an NF4 copy of them.
# Byte tokens (one per character), so no tokenizer files are needed.
#
#   1. scripts/prepare_brown.py --genres writes the two texts;
#   2. `fitlm tokenize --tokenizer byte` makes shards of each (6% / 10% of the
#      documents held out for validation);
#   3. `fitlm train` pretrains PRETRAIN_STEPS steps of 16 x 256 bytes on the
#      non-fiction (fp32, AdamW);
#   4. `fitlm export` writes it as a Hugging Face LLaMA directory (base/);
#   5. `fitlm train --init-from base --lora` fine-tunes FT_STEPS steps of
#      8 x 256 bytes on the fiction (r LORA_R, alpha LORA_ALPHA, all linear
#      layers), evaluating the fiction validation loss at step 0 (the base)
#      and at the end; the adapter is written in PEFT's format (adapter/);
#   6. the same with --quantize nf4 --double-quant (QLoRA);
#   7. a summary: the fiction validation loss of the base, after LoRA and after
#      QLoRA, the adapters' size on disk against the base's, and the
#      trainable parameters.
#
#   bash scripts/lora_demo.sh          # ~4 minutes on 2 cores
#
# Everything is written under OUT (default out/lora_demo): data/, pretrain/,
# base/, lora/, qlora/ and the logs; a re-run starts them afresh.
# Knobs: OUT [out/lora_demo], BUILD [build], THREADS [2], PRETRAIN_STEPS [200],
# FT_STEPS [60], LORA_R [16], LORA_ALPHA [32], FT_LR [2e-3]. Needs
# data/.cache/package (scripts/setup.sh fetches it).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-out/lora_demo}
BUILD=${BUILD:-build}
THREADS=${THREADS:-2}
PRETRAIN_STEPS=${PRETRAIN_STEPS:-200}
FT_STEPS=${FT_STEPS:-60}
LORA_R=${LORA_R:-16}
LORA_ALPHA=${LORA_ALPHA:-32}
FT_LR=${FT_LR:-2e-3}
FITLM=$BUILD/fitlm

[[ -d data/.cache/package ]] || bash scripts/setup.sh
if [[ ! -x $FITLM ]]; then
    cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null
    cmake --build "$BUILD" -j "$(nproc)" --target fitlm >/dev/null
fi
rm -rf "$OUT"
mkdir -p "$OUT/data"
start=$SECONDS

# 1-2. the two texts and their byte-token shards
python3 scripts/prepare_brown.py --genres abcdefghj --out "$OUT/data/nonfiction.txt"
python3 scripts/prepare_brown.py --genres klmnpr --out "$OUT/data/fiction.txt"
"$FITLM" tokenize "$OUT/data/nonfiction.txt" -o "$OUT/data/nonfiction" --tokenizer byte \
    --val-fraction 0.06 --threads "$THREADS"
"$FITLM" tokenize "$OUT/data/fiction.txt" -o "$OUT/data/fiction" --tokenizer byte \
    --val-fraction 0.1 --threads "$THREADS"

# 3. pretraining: 4 blocks, 256 channels, 8 query / 4 key-value heads, SwiGLU 704
MODEL=(--model demo --arch llama --n-layer 4 --n-embd 256 --n-head 8 --n-kv-head 4
    --intermediate-size 704 --max-seq-len 256)
COMMON=(--tokenizer byte --seq-len 256 --threads "$THREADS" --sample-tokens 0
    --eval-iters 16)
echo
echo "== pretraining on non-fiction ($PRETRAIN_STEPS steps)"
"$FITLM" train "${MODEL[@]}" "${COMMON[@]}" --batch 16 --data "$OUT/data/nonfiction" \
    --steps "$PRETRAIN_STEPS" --lr 3e-3 --warmup 30 --eval-every 0 \
    --out "$OUT/pretrain" | tee "$OUT/pretrain.log" | grep -E '^(model|[0-9]+ param|final)|00/'

# 4. the pretrained model as a Hugging Face directory
"$FITLM" export "$OUT/pretrain" -o "$OUT/base"

# 5-6. LoRA and QLoRA on the fiction; eval at step 0 (the base) and the end
FT=(--init-from "$OUT/base" "${COMMON[@]}" --batch 8 --data "$OUT/data/fiction" --steps "$FT_STEPS"
    --eval-every "$FT_STEPS" --lr "$FT_LR" --warmup 10 --scheduler constant
    --lora --lora-r "$LORA_R" --lora-alpha "$LORA_ALPHA" --lora-target-modules all-linear)
for run in lora qlora; do
    extra=()
    [[ $run == qlora ]] && extra=(--quantize nf4 --double-quant --nf4-blocksize 64)
    echo
    echo "== $run on fiction ($FT_STEPS steps)"
    "$FITLM" train "${FT[@]}" "${extra[@]}" --out "$OUT/$run" | tee "$OUT/$run.log" |
        grep -E 'LoRA adapters|^NF4|val loss|adapter written'
done

# 7. summary
val0() { awk '/^step +0 \| val loss/ { print $6; exit }' "$1"; }
valf() { awk '/^final val loss/ { print $4; exit }' "$1"; }
size() { du -sb "$1" | cut -f1; }
trainable() { grep -m1 -o -E '[0-9]+ in LoRA adapters' "$1" | cut -d' ' -f1; }
base_params=$(grep -m1 -o -E '^[0-9]+ parameters' "$OUT/lora.log" | cut -d' ' -f1)
echo
echo "== summary (fiction validation loss, nats per byte token; $((SECONDS - start)) s in all)"
printf '  %-40s %s\n' \
    "base (pretrained on non-fiction)" "$(val0 "$OUT/lora.log")" \
    "base, NF4 (QLoRA's step 0)" "$(val0 "$OUT/qlora.log")" \
    "after LoRA ($FT_STEPS steps)" "$(valf "$OUT/lora.log")" \
    "after QLoRA ($FT_STEPS steps)" "$(valf "$OUT/qlora.log")" \
    "non-fiction val loss after pretraining" "$(valf "$OUT/pretrain.log")"
echo "  trainable: $(trainable "$OUT/lora.log") adapter parameters (r $LORA_R, all linear" \
    "layers) against $base_params in the base"
echo "  on disk: adapter $(size "$OUT/lora/adapter") bytes ($OUT/lora/adapter), QLoRA adapter" \
    "$(size "$OUT/qlora/adapter") bytes; base $(size "$OUT/base") bytes ($OUT/base, fp32)"
