#!/usr/bin/env bash
# Token shards of the default data, made with the built fitlm (after
# scripts/setup.sh and scripts/build.sh):
#   data/brown_gpt2/{train,val}_000000.bin   GPT-2 BPE tokens (the demo's data)
#   data/brown_byte/{train,val}_000000.bin   byte tokens (the tests' small models)
# 30 of the 500 documents (every 1/0.06-th) go to validation. Idempotent:
# shards newer than the text and the tokenizer's sources are left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
FITLM=${FITLM:-build/fitlm}
TEXT=data/brown.txt
fresh() {
    local f=$1/val_000000.bin
    [[ -f $f ]] || return 1
    for src in "$TEXT" src/io/tokenizer.c src/io/encode.c src/io/bpe.c src/io/shard.c src/cli/tokenize.c; do
        [[ $f -nt $src ]] || return 1
    done
}
for tok in gpt2 byte; do
    out=data/brown_$tok
    if fresh "$out"; then
        echo "tokenize: $out up to date"
    else
        "$FITLM" tokenize "$TEXT" -o "$out" --tokenizer "$tok" --val-fraction 0.06
    fi
done
