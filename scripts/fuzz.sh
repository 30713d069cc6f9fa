#!/usr/bin/env bash
# Fuzzes the model-file and checkpoint parsers with libFuzzer (ASan + UBSan): builds
# tests/fuzz/fuzz_*.c with clang into build-fuzz/ (-DFITLM_FUZZ=ON) and runs
# each target for N seconds (default 60), seeded with the test fixtures.
# Not part of the CTest suite; test_formats runs a deterministic mutation
# test of the same parsers.
#   scripts/fuzz.sh [seconds] [target...]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
shift || true
# clang, and libFuzzer's runtime (Debian 12: libclang-rt-14-dev)
if ! command -v clang >/dev/null || ! compgen -G '/usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a' >/dev/null; then
    apt-get update && apt-get install -y clang libclang-rt-14-dev
fi
CC=clang cmake -S . -B build-fuzz -DFITLM_FUZZ=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build-fuzz -j "$(nproc)"

fx=tests/fixtures
seed() { # target files...: a fresh seed directory
    local d=build-fuzz/seeds/$1
    shift
    rm -rf "$d" && mkdir -p "$d" && cp "$@" "$d"/
}
seed fuzz_safetensors $fx/gpt2_tiny_hf/model.safetensors
seed fuzz_hf_config $fx/gpt2_tiny_hf/config.json
cp $fx/llama_tiny_hf/config.json build-fuzz/seeds/fuzz_hf_config/llama_config.json
printf '{"metadata": {"total_size": 128}, "weight_map": {"transformer.wte.weight": "model-00001-of-00002.safetensors", "transformer.wpe.weight": "model-00002-of-00002.safetensors"}}' \
    >build-fuzz/seeds/fuzz_hf_config/index.json
seed fuzz_llmc_header $fx/gpt2_tiny_llmc_v3.bin $fx/gpt2_tiny_llmc_v5.bin
seed fuzz_ckpt $fx/ckpt_tiny.fitlm $fx/ckpt_tp_shard.fitlm

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(fuzz_safetensors fuzz_hf_config fuzz_llmc_header fuzz_ckpt)
mkdir -p build-fuzz/crashes
for t in "${targets[@]}"; do
    mkdir -p "build-fuzz/corpus/$t"
    echo "== $t: ${secs}s"
    "build-fuzz/$t" -max_total_time="$secs" -print_final_stats=1 -max_len=65536 \
        -artifact_prefix="build-fuzz/crashes/$t-" "build-fuzz/corpus/$t" "build-fuzz/seeds/$t" \
        2>"build-fuzz/$t.log" || { tail -40 "build-fuzz/$t.log"; exit 1; }
    grep -E 'stat::number_of_executed_units|stat::new_units_added' "build-fuzz/$t.log"
done
