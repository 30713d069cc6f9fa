#!/usr/bin/env bash
# bench/gpu.sh FITLM OUTDIR: bf16 AdamW training speed on one NVIDIA GPU,
# fitlm (`fitlm train --device cuda`) beside PyTorch on the same GPU in the
# same run (bench/torch_gpt2.py --device cuda: the same model in plain
# PyTorch with scaled_dot_product_attention and fused AdamW, eager and
# torch.compile). Called by scripts/gpu_check.sh; each config is short so
# that the whole fits the lease (about 3 minutes).
#
# Configs (T = 1024): GPT-2 124M at B = 16 and 32, SmolLM-135M's shape at
# B = 16 and TinyLlama-1.1B's at B = 4. Data: the repository's docs as
# GPT-2 tokens (.gpu-prefix/data/gpt2 or data/gpt2: encoder.json, vocab.bpe)
# for GPT-2 and as LLaMA-2 tokens (.gpu-prefix/data/llama or data/llama:
# tokenizer.json, vocabulary 32000) for the LLaMA shapes; PyTorch draws random tokens of the
# vocabulary fitlm's model line reports (--data random).
#
# The first config runs once more with FITLM_CUDA_ATTENTION=wmma (row
# fitlm-wmma: the WMMA attention kernels against the default mma.sync ones)
# and with FITLM_CUDA_GELU_FUSION=0, 1 and 2 (rows fitlm-gelu0: the MLP's
# GELU in its own kernels; fitlm-gelu1: in its forward GEMM's epilogue;
# fitlm-gelu2: its backward's too, in the input gradient's GEMM; the
# card's default is one of them) after PyTorch's runs, when time is left.
#
# The runs go in the order of what the comparisons need most, so that a
# short lease measures those first: fitlm's four configs; torch.compile's
# GPT-2 (B 16, 32); the first config's profile and the attention kernels
# alone; PyTorch eager's LLaMA shapes; PyTorch eager's GPT-2;
# torch.compile's LLaMA shapes; fitlm-wmma, fitlm-gelu0, 1 and 2; Nsight
# Compute. bench.tsv keeps one order whatever ran (fitlm's rows, eager's,
# torch.compile's, fitlm-wmma's and the GELU levels').
#
# Per run: tokens/s from the median step time of the timed steps
# (BENCH_STEPS, default 10, after BENCH_WARMUP = 3 untimed ones); MFU
# against the H100/H200 SXM bf16 dense peak, 989 TFLOP/s, with llm.c's
# FLOPs per token 6 N + 6 L C T (N the parameters fitlm reports), and
# against the best cuBLASLt rate on the config's own GEMM shapes measured
# in the same run (mfu_gemm: bench_gpu_gemm, beside fitlm in its build
# directory or BENCH_GEMM, times each linear's three GEMMs under
# cuBLASLt's first 8 algorithms; its table in OUTDIR/gemm_CONFIG_bB.md); peak
# device memory (fitlm: its tagged device allocations, --mem-report's
# "total device"; PyTorch: torch.cuda.max_memory_allocated).
#
# The whole ends by BENCH_DEADLINE (epoch seconds: scripts/gpu_check.sh's
# call's end), else BENCH_SECONDS (default 430) from its start: a run starts
# only while enough is left (fitlm's and PyTorch eager's 20 s,
# torch.compile's 60), its row "skipped: time" otherwise, and runs under a
# timeout of its own cap (fitlm's 150 s, eager's 150, torch.compile's 240)
# or the seconds left before the deadline, less 10 (bench_timeout in
# bench/lib.sh), whichever is less. A run the deadline cuts is
# "skipped: time (cut after N s)", not failed; one that reaches its own cap
# has failed. Each run's output reaches bench.log as it prints, then its
# seconds and start: "-- N s (started at S s; exit RC)".
#
# BENCH_SMOKE=1 (CTest gpu_bench_smoke, with fitlm_emu: the emulated GPU,
# docs/testing.md): the tiny GPT-2 and LLaMA shapes with the same
# tokenizers, B 2, T 64, 1 + 2 steps, PyTorch's runs recorded as skipped:
# the script's runs and parsing checked on any machine.
#
# Writes OUTDIR/bench.log (every run's output), OUTDIR/bench.tsv (one row
# per run: config engine B T tok_s ms_median mfu mfu_gemm peak_mib
# status; "ok (mfu_gemm skipped: time)" where the deadline left no time for
# the config's bench_gpu_gemm),
# OUTDIR/profile_CONFIG.md (the first config's step op by op, timed on the
# GPU, each op's floor beside it: FLOPs at the peak, bytes at the bandwidth)
# OUTDIR/attention.md (the attention kernels alone beside PyTorch's:
# attention_rates below) and, when time is left, OUTDIR/ncu_attention.txt
# (ncu_attention below),
# and prints them; exits 1 when a fitlm run failed (one skipped for time
# has not).
set -uo pipefail
fitlm=${1:?usage: bench/gpu.sh FITLM OUTDIR}
out=${2:?usage: bench/gpu.sh FITLM OUTDIR}
src=$(cd "$(dirname "$0")/.." && pwd)
source "$src/bench/lib.sh" # table, why, bench_deadline, bench_run
smoke=${BENCH_SMOKE:-0}
warmup=${BENCH_WARMUP:-3}
steps=${BENCH_STEPS:-10}
[ "$smoke" = 1 ] && warmup=1 steps=2
peak=989e12
# the card's memory bandwidth, the memory-bound kernels' floor: H100 SXM
# 3.35 TB/s, H100 NVL 3.9, H100 PCIe 2.0, H200 4.8 (BENCH_BANDWIDTH overrides)
card=$(timeout 30 nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case "$card" in
    *H200*) bw=4.8e12 ;;
    *H100*NVL*) bw=3.9e12 ;;
    *H100*PCIe*) bw=2.0e12 ;;
    *) bw=3.35e12 ;;
esac
bw=${BENCH_BANDWIDTH:-$bw}
bench_deadline 430
# the minimum seconds left for a run to start: fitlm's (its GEMM bench
# after it), PyTorch eager's, torch.compile's (its compilation)
min_run=20 min_compile=60
mkdir -p "$out"
log=$out/bench.log
: >"$log"
tsv=$out/bench.tsv
printf 'config\tengine\tB\tT\ttok_s\tms_median\tmfu\tmfu_gemm\tpeak_mib\tstatus\n' >"$tsv"
work=$(mktemp -d /tmp/fitlm_bench_gpu.XXXXXX)
trap 'rm -rf "$work"' EXIT
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 # PyTorch's lines reach bench.log as they print

gpt2_tok=$src/.gpu-prefix/data/gpt2
[ -s "$gpt2_tok/encoder.json" ] || gpt2_tok=$src/data/gpt2
llama_tok=$src/.gpu-prefix/data/llama/tokenizer.json
[ -s "$llama_tok" ] || llama_tok=$src/data/llama/tokenizer.json
cat "$src"/docs/*.md "$src"/bench/*.md "$src"/README.md >"$work/text.txt"
"$fitlm" tokenize "$work/text.txt" -o "$work/gpt2" --tokenizer gpt2 --tokenizer-path "$gpt2_tok" \
    --threads 8 >>"$log" 2>&1 || echo "bench/gpu.sh: GPT-2 tokenization failed (see $log)"
"$fitlm" tokenize "$work/text.txt" -o "$work/llama" --tokenizer hf \
    --tokenizer-path "$llama_tok" --threads 8 >>"$log" 2>&1 ||
    echo "bench/gpu.sh: LLaMA tokenization failed (see $log)"

row() { printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$tsv"; }

# gemm_rate CONFIG B T FITLM-FLAGS...: bench_gpu_gemm on the config's GEMM
# shapes (its --model and --arch, the vocabulary V fitlm reported) into
# OUTDIR/gemm_CONFIG_bB.md; sets GEMM_TF, the best cuBLASLt rate over them
# in TFLOP/s (empty when it failed), and GEMM_TIME=1 where the deadline
# left it no time or cut it
gemm_bench=${BENCH_GEMM:-$(dirname "$fitlm")/bench_gpu_gemm}
gemm_rate() {
    local cfg=$1 B=$2 T=$3 model="" arch=()
    shift 3
    while [ $# -gt 0 ]; do
        case $1 in
        --model) model=$2 ;;
        --arch) arch=(--arch "$2") ;;
        esac
        shift
    done
    GEMM_TF="" GEMM_TIME=""
    local f=$out/gemm_${cfg}_b$B.md
    if ! bench_may_start 10; then
        GEMM_TIME=1
        return
    fi
    echo "== bench_gpu_gemm $cfg B $B T $T" >>"$log"
    local rounds=10
    [ "$smoke" = 1 ] && rounds=1
    if bench_run "$log" "$f" 120 "$gemm_bench" --model "$model" "${arch[@]}" --vocab "$V" --B "$B" --T "$T" \
        --precision bf16 --rounds $rounds; then
        GEMM_TF=$(sed -n 's/^RESULT.* gemm_best_tflops=\([^ ]*\).*/\1/p' "$f")
    fi
    [ -z "$BENCH_CUT" ] || GEMM_TIME=1
}

# train OUT DATA B T STEPS FLAGS...: `fitlm train --device cuda`, bf16
# AdamW, into OUT (and the log, as it prints: bench_run); its exit status,
# BENCH_CUT set where the deadline cut it
train() {
    local f=$1 data=$2 B=$3 T=$4 n=$5
    shift 5
    bench_run "$log" "$f" 150 "$fitlm" train --device cuda "$@" --data "$data" --batch "$B" --seq-len "$T" \
        --precision bf16 --optimizer adamw --steps "$n" --warmup 2 --eval-every 0 --eval-iters 1 \
        --val-data none --sample-tokens 0 --out ""
}

# fitlm_run CONFIG B T DATA FLAGS...: one fitlm run; sets V, N, L, C for torch.
# Its row's engine is $ENGINE (default fitlm); a GEMM_TF already set is kept.
fitlm_run() {
    local cfg=$1 B=$2 T=$3 data=$4 engine=${ENGINE:-fitlm}
    shift 4
    local f=$work/$cfg.$engine.out
    echo "== $engine $cfg B $B T $T" >>"$log"
    train "$f" "$data" "$B" "$T" $((warmup + steps)) "$@" --mem-report
    local rc=$?
    if [ -n "$BENCH_CUT" ]; then
        row "$cfg" "$engine" "$B" "$T" - - - - - "$(cut_status)"
        return
    fi
    V=$(sed -n 's/.*vocab \([0-9]*\).*/\1/p' "$f" | head -1)
    N=$(sed -n 's/^\([0-9]*\) parameters.*/\1/p' "$f" | head -1)
    L=$(sed -n 's/.*n_layer \([0-9]*\).*/\1/p' "$f" | head -1)
    C=$(sed -n 's/.*n_embd \([0-9]*\).*/\1/p' "$f" | head -1)
    if [ $rc != 0 ] || [ -z "$N" ]; then
        row "$cfg" "$engine" "$B" "$T" - - - - - "failed rc $rc$(why "$(grep -m1 -i error "$f")")"
        return
    fi
    GEMM_TIME=""
    [ -n "$GEMM_TF" ] || gemm_rate "$cfg" "$B" "$T" "$@"
    local status=ok
    [ -z "$GEMM_TIME" ] || status="ok (mfu_gemm skipped: time)"
    local ms
    ms=$(awk -v w="$warmup" '$1 == "step" && $2 ~ /\// {
            split($2, s, "/"); if (s[1] + 0 > w) for (i = 1; i < NF; i++) if ($(i + 1) == "ms") print $i }' "$f" |
        sort -g | awk '{ a[NR] = $1 } END { if (NR) print (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2) }')
    local mem
    mem=$(awk '/total device/ { print $(NF - 1) }' "$f" | tail -1)
    if [ -z "$ms" ]; then
        row "$cfg" "$engine" "$B" "$T" - - - - "${mem:--}" "no step times"
        return
    fi
    awk -v cfg="$cfg" -v B="$B" -v T="$T" -v ms="$ms" -v N="$N" -v L="$L" -v C="$C" -v pk=$peak \
        -v mem="${mem:--}" -v gtf="$GEMM_TF" -v eng="$engine" -v st="$status" 'BEGIN { tok = B * T / (ms / 1000); fl = 6 * N + 6 * L * C * T;
            mg = gtf > 0 ? sprintf("%.4f", tok * fl / (gtf * 1e12)) : "-"
            printf "%s\t%s\t%d\t%d\t%.0f\t%.2f\t%.4f\t%s\t%s\t%s\n", cfg, eng, B, T, tok, ms, tok * fl / pk, mg, mem, st }' >>"$tsv"
}

# fitlm_profile CONFIG B T DATA FLAGS...: `fitlm train --profile` (each op
# between two timed events on the GPU) of 1 + 3 steps into
# OUTDIR/profile_CONFIG.md, with each op's floor: a GEMM's and attention's
# FLOPs at the bf16 dense peak (ms x GFLOP/s / 989e3), a memory-bound
# kernel's least bytes (the profile's GB/step) at the card's bandwidth
fitlm_profile() {
    local cfg=$1 B=$2 T=$3 data=$4
    shift 4
    local f=$work/$cfg.profile.out
    echo "== fitlm $cfg B $B T $T --profile" >>"$log"
    train "$f" "$data" "$B" "$T" 4 "$@" --profile
    local rc=$?
    if [ -n "$BENCH_CUT" ]; then
        echo "bench/gpu.sh: the profiled run of $cfg: $(cut_status)"
        return 0
    fi
    if [ $rc != 0 ] || ! grep -q '^per-op profile' "$f"; then
        echo "bench/gpu.sh: the profiled run of $cfg failed (rc $rc; see $log)"
        return 1
    fi
    {
        echo "# fitlm's step, op by op: $cfg, B $B, T $T, bf16 AdamW ($(date -u '+%Y-%m-%d'))"
        echo
        awk -F'|' -v pk=$peak -v bw=$bw '/^per-op profile/ { print; print ""; next }
            /^\|:/ { print $0 "----------:|"; next }
            /^\| op / { print $0 " floor ms |"; next }
            /^\| / { fl = ($4 + 0) * ($8 + 0) + ($5 + 0) * ($9 + 0); gb = $10 + 0
                     floor = fl / (pk / 1e9) + gb / (bw / 1e9) * 1e3
                     printf "%s %s |\n", $0, (floor > 0 ? sprintf("%8.2f", floor) : "") }' "$f"
        # the host's waits behind the GPU's queued work (1 a step: the verdict's read)
        grep -m1 'host waited behind' "$f" | sed 's/^/\n/'
    } >"$out/profile_$cfg.md"
}

# attention_rates: the attention kernels alone (bench_gpu_attention, beside
# fitlm in its build directory or BENCH_ATTENTION: fitlm's mma and wmma
# versions) beside PyTorch's scaled_dot_product_attention (its
# FlashAttention where it has it) at each config's attention shape, one
# layer at B and T = 1024, and a 128-value head (the llama-7b's) at B 4,
# into OUTDIR/attention.md: forward and backward ms and causal TFLOP/s; a
# shape starts while 20 s are left
att_bench=${BENCH_ATTENTION:-$(dirname "$fitlm")/bench_gpu_attention}
attention_rates() {
    local f=$out/attention.md shapes
    shapes=("gpt2-124m 16 1024 12 12 64" "smollm-135m 16 1024 9 3 64"
        "tinyllama-1.1b 4 1024 32 4 64" "llama-7b 4 1024 32 32 128")
    local rounds=20
    if [ "$smoke" = 1 ]; then
        shapes=("tiny 1 64 2 1 64")
        rounds=1
    fi
    {
        echo "# Causal attention alone, one layer, bf16 (${card:-the GPU nvidia-smi did not name}, $(date -u '+%Y-%m-%d'))"
        echo
        echo "FLOPs as FlashAttention's benchmarks count them: 2 B NH T^2 HS forward, 2.5x that backward."
        echo
        echo "| shape | B | T | NH | NKV | HS | engine | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s |"
        echo "|---|---|---|---|---|---|---|---|---|---|---|"
    } >"$f"
    local sh name B T NH NKV HS r
    for sh in "${shapes[@]}"; do
        read -r name B T NH NKV HS <<<"$sh"
        if ! bench_may_start $min_run; then
            echo "| $name | $B | $T | $NH | $NKV | $HS | skipped: time | | | | |" >>"$f"
            continue
        fi
        echo "== attention $name B $B T $T NH $NH NKV $NKV HS $HS" >>"$log"
        bench_run "$log" "$work/att.out" 60 "$att_bench" --B "$B" --T "$T" --NH "$NH" --NKV "$NKV" --HS "$HS" \
            --rounds $rounds
        r=$(grep '^RESULT' "$work/att.out")
        if [ "$smoke" != 1 ] && bench_may_start 10; then
            echo "== torch attention $name B $B T $T NH $NH NKV $NKV HS $HS" >>"$log"
            bench_run "$log" "$work/att.out" 90 "$py" "$src/bench/torch_attention.py" --B "$B" --T "$T" --NH "$NH" \
                --NKV "$NKV" --HS "$HS" --rounds $rounds
            r+=$'\n'$(grep '^RESULT' "$work/att.out")
        fi
        echo "$r" | awk -v s="| $name | $B | $T | $NH | $NKV | $HS" '/^RESULT/ {
            for (i = 2; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
            eng = v["kernels"] != "" ? "fitlm " v["kernels"] : v["engine"] " (" v["backend"] ")"
            printf "%s | %s | %s | %s | %s | %s |\n", s, eng, v["fwd_ms"], v["fwd_tflops"], v["bwd_ms"], v["bwd_tflops"]
            delete v }' >>"$f"
    done
}

# ncu_attention CONFIG B T DATA FLAGS...: Nsight Compute on one launch of
# each attention kernel of the config's first step (after skipping 11 of
# them: the last layer's forward, then its dK/dV and dQ) into
# OUTDIR/ncu_attention.txt: their throughput against the tensor cores and
# shared memory, occupancy, registers. The attention kernels (never yet
# timed on a GPU) are the step's likeliest gap to its floor; this says by
# how much and why. Without ncu it says so; its failure fails nothing.
ncu_attention() {
    local cfg=$1 B=$2 T=$3 data=$4
    shift 4
    local f=$out/ncu_attention.txt ncu
    ncu=$(command -v ncu || { [ -x /usr/local/cuda/bin/ncu ] && echo /usr/local/cuda/bin/ncu; })
    if [ -z "$ncu" ]; then
        echo "ncu: not found" >"$f"
        return 0
    fi
    echo "== ncu attention $cfg B $B T $T" >>"$log"
    bench_run "$log" "$f" 120 "$ncu" --clock-control none --kernel-name 'regex:^attention_(forward|dkdv|dq)' \
        --launch-skip 11 --launch-count 3 --section SpeedOfLight --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        "$fitlm" train --device cuda "$@" --data "$data" --batch "$B" --seq-len "$T" \
        --precision bf16 --optimizer adamw --steps 1 --eval-every 0 --eval-iters 1 --val-data none \
        --sample-tokens 0 --out ""
    echo "ncu: exit $? ($cfg, B $B, T $T${BENCH_CUT:+; cut by the deadline after $BENCH_CUT s})" >>"$f"
}

# torch_run CONFIG B T COMPILE FLAGS...: bench/torch_gpt2.py on the GPU
# (eager at most 150 s, torch.compile 240)
torch_run() {
    local cfg=$1 B=$2 T=$3 comp=$4
    shift 4
    local eng=pytorch-eager f=$work/$cfg.torch.out cap=150
    [ "$comp" = 1 ] && eng=pytorch-compile cap=240
    echo "== $eng $cfg B $B T $T" >>"$log"
    bench_run "$log" "$f" $cap "$py" "$src/bench/torch_gpt2.py" --device cuda --data random --precision bf16 \
        --B "$B" --T "$T" --maxT "$T" --steps "$steps" --warmup "$warmup" \
        $([ "$comp" = 1 ] && echo --compile) "$@"
    local rc=$?
    if [ -n "$BENCH_CUT" ]; then
        row "$cfg" "$eng" "$B" "$T" - - - - - "$(cut_status)"
        return
    fi
    local r
    r=$(grep '^RESULT' "$f" | tail -1)
    if [ $rc != 0 ] || [ -z "$r" ]; then
        row "$cfg" "$eng" "$B" "$T" - - - - - "failed rc $rc$(why "$(tail -1 "$f")")"
        return
    fi
    # the FLOPs per token as fitlm's row counts them, for one MFU (and the
    # same best cuBLASLt rate as fitlm's row)
    echo "$r" | tr ' ' '\n' | awk -F= -v cfg="$cfg" -v eng="$eng" -v B="$B" -v T="$T" -v N="$N" \
        -v L="$L" -v C="$C" -v pk=$peak -v gtf="$GEMM_TF" '{ v[$1] = $2 } END { fl = 6 * N + 6 * L * C * T;
            mg = gtf > 0 ? sprintf("%.4f", v["tok_s"] * fl / (gtf * 1e12)) : "-"
            printf "%s\t%s\t%d\t%d\t%.0f\t%.2f\t%.4f\t%s\t%s\tok\n", cfg, eng, B, T, v["tok_s"],
                v["ms_median"], v["tok_s"] * fl / pk, mg, v["peak_gpu_mib"] }' >>"$tsv"
}

# The configs: NAME B T DATA, fitlm's flags, torch_gpt2.py's flags
gpt2_f=(--model gpt2 --tokenizer gpt2 --tokenizer-path "$gpt2_tok")
gpt2_t=(--arch gpt2 --L 12 --C 768 --NH 12)
llama_f=(--tokenizer hf --tokenizer-path "$llama_tok")
names=(gpt2-124m gpt2-124m smollm-135m tinyllama-1.1b)
batches=(16 32 16 4)
datas=("$work/gpt2" "$work/gpt2" "$work/llama" "$work/llama")
fflags=("${gpt2_f[*]}" "${gpt2_f[*]}" "--model smollm-135m ${llama_f[*]}"
    "--model tinyllama-1.1b ${llama_f[*]}")
tflags=("${gpt2_t[*]}" "${gpt2_t[*]}" "--arch llama --L 30 --C 576 --NH 9 --kv-heads 3 --I 1536 --tie 1"
    "--arch llama --L 22 --C 2048 --NH 32 --kv-heads 4 --I 5632")
T=1024
if [ "$smoke" = 1 ]; then
    names=(gpt2-tiny llama-tiny)
    batches=(2 2)
    datas=("$work/gpt2" "$work/llama")
    fflags=("--model tiny --arch gpt2 --tokenizer gpt2 --tokenizer-path $gpt2_tok"
        "--model llama-tiny ${llama_f[*]}")
    T=64
fi

# the rows' order in bench.tsv, whatever order the runs took: fitlm's,
# PyTorch eager's, torch.compile's, the first config's variants
for e in fitlm pytorch-eager pytorch-compile; do
    for k in "${!names[@]}"; do printf '%s\t%s\t%s\n' "${names[$k]}" $e "${batches[$k]}"; done
done >"$work/order"
for e in fitlm-wmma fitlm-gelu0 fitlm-gelu1 fitlm-gelu2; do printf '%s\t%s\t%s\n' "${names[0]}" $e "${batches[0]}"; done >>"$work/order"

# fitlm's runs first
declare -A VS NS LS CS GS
for k in "${!names[@]}"; do
    if ! bench_may_start $min_run; then
        row "${names[$k]}" fitlm "${batches[$k]}" $T - - - - - "skipped: time"
        continue
    fi
    V='' N='' L='' C='' GEMM_TF=''
    # shellcheck disable=SC2086 # the flags are words
    fitlm_run "${names[$k]}" "${batches[$k]}" $T "${datas[$k]}" ${fflags[$k]}
    VS[$k]=${V:-50257} NS[$k]=${N:-0} LS[$k]=${L:-0} CS[$k]=${C:-0} GS[$k]=$GEMM_TF
done

# torch_configs COMPILE KIND: PyTorch's runs of the GPT-2 configs (KIND
# gpt2) or of the LLaMA shapes (llama), eager or torch.compile (COMPILE 1),
# each while time is left (60 s for torch.compile, 20 for eager)
torch_configs() {
    local comp=$1 kind=$2 k eng=pytorch-eager min=$min_run
    [ "$comp" = 1 ] && eng=pytorch-compile min=$min_compile
    for k in "${!names[@]}"; do
        case ${names[$k]} in gpt2-*) [ "$kind" = gpt2 ] || continue ;; *) [ "$kind" = llama ] || continue ;; esac
        if [ "$smoke" = 1 ]; then
            row "${names[$k]}" $eng "${batches[$k]}" $T - - - - - "skipped: smoke"
            continue
        fi
        if ! bench_may_start "$min"; then
            row "${names[$k]}" $eng "${batches[$k]}" $T - - - - - "skipped: time"
            continue
        fi
        V=${VS[$k]:-50257} N=${NS[$k]:-0} L=${LS[$k]:-0} C=${CS[$k]:-0} GEMM_TF=${GS[$k]:-}
        # shellcheck disable=SC2086 # the flags are words
        torch_run "${names[$k]}" "${batches[$k]}" $T "$comp" ${tflags[$k]} --V "$V"
    done
}
# what the comparisons need most: GPT-2 beside torch.compile, then where
# its step's time goes, then the LLaMA shapes beside PyTorch eager
torch_configs 1 gpt2
# the first config's step op by op, when time is left
if bench_may_start $min_run; then
    # shellcheck disable=SC2086
    fitlm_profile "${names[0]}" "${batches[0]}" $T "${datas[0]}" ${fflags[0]} || profile_failed=1
fi
# the attention kernels alone beside PyTorch's, when time is left
if bench_may_start $min_run; then
    attention_rates
fi
torch_configs 0 llama
# then the other pairs: GPT-2 beside PyTorch eager, the LLaMA shapes
# beside torch.compile
torch_configs 0 gpt2
torch_configs 1 llama

# variant_skip: why a variant of the first config does not run ("" where
# it may): no time left, or the first config's own run gave no row to set
# it beside
variant_skip() {
    if ! bench_may_start $min_run; then
        echo "skipped: time"
    elif [ -z "${NS[0]:-}" ] || [ "${NS[0]}" = 0 ]; then
        echo "skipped: ${names[0]}'s fitlm run failed"
    fi
}
# variant ENGINE VAR VALUE: the first config again with the environment's
# VAR=VALUE, when time is left, after PyTorch's runs (row ENGINE)
variant() {
    local why_not
    why_not=$(variant_skip)
    if [ -z "$why_not" ]; then
        # shellcheck disable=SC2086 # the flags are words
        (
            export "$2=$3"
            ENGINE=$1 GEMM_TF=${GS[0]} fitlm_run "${names[0]}" "${batches[0]}" $T "${datas[0]}" ${fflags[0]}
        )
    else
        row "${names[0]}" "$1" "${batches[0]}" $T - - - - - "$why_not"
    fi
}
# the WMMA version of the tensor-core attention (attention_tc.cu; the
# default is attention_mma.cu's mma.sync: which is faster on this card),
# and GPT-2's MLP GELU in its own kernels or in its GEMMs' cuBLASLt
# epilogues, llm.c's gelu_fusion 0, 1 and 2 (the card's default one of
# them: 2 on Hopper, 0 before)
variant fitlm-wmma FITLM_CUDA_ATTENTION wmma
for level in 0 1 2; do variant fitlm-gelu$level FITLM_CUDA_GELU_FUSION $level; done
# the attention kernels under Nsight Compute, when time is left
if bench_may_start 30; then
    # shellcheck disable=SC2086
    ncu_attention "${names[0]}" "${batches[0]}" $T "${datas[0]}" ${fflags[0]}
fi
# bench.tsv's rows in their order (a row the order does not list, last)
awk -F'\t' 'NR == FNR { rank[$1 FS $2 FS $3] = NR; next }
    FNR == 1 { print "0\t" $0; next }
    { r = ($1 FS $2 FS $3) in rank ? rank[$1 FS $2 FS $3] : 1000; print r "\t" $0 }' "$work/order" "$tsv" |
    sort -s -t$'\t' -k1,1n | cut -f2- >"$work/tsv" && cat "$work/tsv" >"$tsv"
echo "== done at $(($(date +%s) - BENCH_T0)) s ($(bench_left) s before the deadline)" >>"$log"
# the profile first: the table of runs is what a caller's tail shows
[ -s "$out/profile_${names[0]}.md" ] && cat "$out/profile_${names[0]}.md"
[ -s "$out/attention.md" ] && cat "$out/attention.md"
echo "bf16 AdamW, tokens/s (median of $steps steps after $warmup), MFU of 989 TFLOP/s and of the best cuBLASLt rate on the config's GEMM shapes (mfu_gemm), peak device MiB"
table "$tsv"
[ -z "${profile_failed:-}" ] || exit 1
# a fitlm row failed: neither ok nor skipped for time, or ok without its
# mfu_gemm (bench_gpu_gemm failed)
awk -F'\t' 'NR > 1 && $2 == "fitlm" && ($10 !~ /^ok/ && $10 !~ /^skipped: time/ || $10 == "ok" && $8 == "-") { bad = 1 }
    END { exit bad }' "$tsv"
