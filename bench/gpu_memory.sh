#!/usr/bin/env bash
# bench/gpu_memory.sh FITLM OUTDIR: the memory techniques on one NVIDIA GPU,
# each held to a 24 GB card's budget with --mem-limit 24GiB (the device's
# budget under --device cuda: docs/devices.md). Called by
# `scripts/gpu_check.sh OUTDIR --memory [SHOWCASES]`; BENCH_SHOWCASES picks
# (default "lomo offload lora"). The whole (every showcase named) ends by
# BENCH_DEADLINE (epoch seconds: scripts/gpu_check.sh's call's end), else
# BENCH_SECONDS (default 450 a showcase named) from its start: a run starts
# while 20 s are left (else its row is "skipped: time") and runs under a
# timeout of 150 s or the seconds left before the deadline, less 10
# (bench_timeout in bench/lib.sh), whichever is less; a run the deadline
# cuts is "skipped: time (cut after N s)", not failed, with what it
# measured before. Each run's output reaches memory.log as it prints, then
# its seconds and start: "-- N s (started at S s; exit RC)".
#
#  lomo:    full-parameter fine-tuning of the llama-7b shape with LOMO (lr
#           BENCH_LOMO_LR, default 1e-1: from random weights, where the
#           paper's 1e-2 for a trained model moved the loss 11.14 to 11.13
#           in 8 steps on the H200; BENCH_LOMO_STEPS steps, default 20, the
#           first BENCH_WARMUP untimed), bf16,
#           block checkpointing, B 1, T 512: peak device memory (the LOMO
#           paper: 14.58 GB on an RTX 3090), tokens/s, the first and last
#           loss on real text (the repository's docs as LLaMA-2 tokens).
#  offload: the largest of a few LLaMA shapes whose plan fits 24 GiB of
#           device memory with mixed-precision AdamW and
#           zero_optimization.offload_optimizer.device cpu (`fitlm plan
#           --device cuda --mem-limit 24GiB` picks it), its tokens/s, and
#           the same model all on the GPU, uncapped; the share of the step
#           the GPU waits on the CPU (each step's "waited on the cpu N%",
#           timed on the device: docs/offload.md), the median over the
#           timed steps. First the 1B scale, the issue's target (under 2x
#           the all-on-GPU step): TinyLlama-1.1B at 32 sequences of 1024 a
#           step (B 4, accumulation 8) offloaded under the cap, with
#           clipping (the update after the backward pass, as DeepSpeed's),
#           with the micro-batches' fp32 sum on the device
#           (offload_optimizer.accumulate_on_device) alone, with it and
#           the delayed update (offload_optimizer.delayed_update: the
#           update during the next step; also the delayed update at B 32
#           without accumulation), without clipping (the update
#           overlapping the last backward pass), and all on the GPU,
#           uncapped. The larger shape's pair at --lr 3e-4.
#  lora:    LoRA and QLoRA (NF4, double quantisation), rank 16 on every
#           linear of the blocks, on the tinyllama-1.1b and llama-7b shapes,
#           B 4, T 512, block checkpointing: fitlm beside Hugging Face
#           transformers + PEFT (bench/peft_baseline.py: random weights, no
#           downloads; QLoRA needs bitsandbytes, else its row is skipped);
#           and llama-7b's LoRA under PEFT's one-GPU recipe, ZeRO-3 with the
#           optimizer and the weights offloaded to the cpu (the frozen base
#           in pinned host memory, each block up ahead of use), run right
#           after llama-7b's LoRA on the GPU, its comparison.
#
# Peak device memory: fitlm's tagged device allocations (--mem-report's
# "total device"), PyTorch's torch.cuda.max_memory_allocated. Tokens/s from
# the median step time after BENCH_WARMUP (3) untimed steps, of BENCH_STEPS
# (5) timed ones.
#
# BENCH_SMOKE=1: every fitlm command with the llama-tiny shape, 2 steps, on
# --device cpu (so the host holds the --mem-limit), and the baseline on the
# cpu when torch and peft are there (else skipped): checks that the commands
# parse and run, on any machine. The offload showcase still plans the real
# shapes (a plan allocates nothing), and runs on --device test: a device's
# offload, whose wait it reports.
#
# Writes OUTDIR/memory.log (every run's output) and OUTDIR/memory.tsv (one
# row per run: showcase config engine B T tok_s peak_mib loss_first
# loss_last gpu_wait status), and prints the table; exits 1 when a run failed
# (CTest runs the smoke as gpu_memory_smoke).
set -uo pipefail
fitlm=${1:?usage: bench/gpu_memory.sh FITLM OUTDIR}
out=${2:?usage: bench/gpu_memory.sh FITLM OUTDIR}
src=$(cd "$(dirname "$0")/.." && pwd)
source "$src/bench/lib.sh" # table, why, bench_deadline, bench_run
smoke=${BENCH_SMOKE:-0}
warmup=${BENCH_WARMUP:-3}
steps=${BENCH_STEPS:-5}
showcases=${BENCH_SHOWCASES:-lomo offload lora}
# shellcheck disable=SC2086 # the showcases are words
set -- $showcases
bench_deadline $((450 * $#))
device=cuda
run_timeout=150 threads=16
lomo_steps=${BENCH_LOMO_STEPS:-20}
if [ "$smoke" = 1 ]; then
    device=cpu warmup=1 steps=1 run_timeout=60 threads=2 lomo_steps=2
fi
mkdir -p "$out"
log=$out/memory.log
: >"$log"
tsv=$out/memory.tsv
printf 'showcase\tconfig\tengine\tB\tT\ttok_s\tpeak_mib\tloss_first\tloss_last\tgpu_wait\tstatus\n' >"$tsv"
work=$(mktemp -d /tmp/fitlm_bench_memory.XXXXXX)
trap 'rm -rf "$work"' EXIT
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 # PyTorch's lines reach memory.log as they print
row() { printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$tsv"; }

# the docs as LLaMA-2 tokens, as bench/gpu.sh makes them
llama_tok=$src/.gpu-prefix/data/llama/tokenizer.json
[ -s "$llama_tok" ] || llama_tok=$src/data/llama/tokenizer.json
cat "$src"/docs/*.md "$src"/bench/*.md "$src"/README.md >"$work/text.txt"
"$fitlm" tokenize "$work/text.txt" -o "$work/llama" --tokenizer hf --tokenizer-path "$llama_tok" \
    --threads $threads >>"$log" 2>&1 || echo "bench/gpu_memory.sh: tokenization failed (see $log)"
data=(--data "$work/llama" --val-data none --tokenizer hf --tokenizer-path "$llama_tok")
echo '{"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}' >"$work/offload.json"
# the micro-batches' fp32 sum made on the device
echo '{"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "accumulate_on_device": true}}}' >"$work/devsum.json"
# the delayed update from the second step on (the timed steps are delayed);
# and with the micro-batches' fp32 sum made on the device
echo '{"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "delayed_update": true, "delayed_update_warmup": 1}}}' >"$work/delayed.json"
echo '{"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "delayed_update": true, "delayed_update_warmup": 1, "accumulate_on_device": true}}}' >"$work/delayed_devsum.json"
echo '{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}' >"$work/z3_offload.json"

# shape FLAGS...: the model flags a run gets (the smoke's tiny shape instead)
shape() { if [ "$smoke" = 1 ]; then echo --model llama-tiny; else echo "$@"; fi; }

# fitlm_run SHOWCASE CONFIG B T FLAGS...: one `fitlm train` on $device; a row
# (B the micro-batch; tokens/s counts every micro-batch of --grad-accum's)
fitlm_run() {
    local sc=$1 cfg=$2 B=$3 T=$4 accum=1 prev="" a
    shift 4
    for a in "$@"; do
        [ "$prev" = --grad-accum ] && accum=$a
        prev=$a
    done
    local f=$work/$sc.$cfg.out
    [ "$smoke" = 1 ] && T=32
    echo "== fitlm $sc $cfg B $B T $T: $*" >>"$log"
    bench_run "$log" "$f" $run_timeout "$fitlm" train --device $device "${data[@]}" --batch "$B" --seq-len "$T" \
        --precision bf16 --steps $((warmup + steps)) --warmup 0 --scheduler constant --eval-every 0 \
        --eval-iters 1 --sample-tokens 0 --out "" --mem-report --threads $threads "$@"
    local rc=$?
    local ms loss0 loss1 mem wait
    ms=$(awk -v w="$warmup" '$1 == "step" && $2 ~ /\// {
            split($2, s, "/"); if (s[1] + 0 > w) for (i = 1; i < NF; i++) if ($(i + 1) == "ms") print $i }' "$f" |
        sort -g | awk '{ a[NR] = $1 } END { if (NR) print (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2) }')
    loss0=$(sed -n 's/^step .*| loss \([0-9.]*\) |.*/\1/p' "$f" | head -1)
    loss1=$(sed -n 's/^step .*| loss \([0-9.]*\) |.*/\1/p' "$f" | tail -1)
    # the device's peak; on the cpu (the smoke) the host's tagged peak
    mem=$(awk '/total device/ { print $(NF - 1) }' "$f" | tail -1)
    [ -n "$mem" ] || mem=$(awk '/total tagged/ { print $NF }' "$f" | tail -1)
    # ZeRO-Offload on a device: the share of the step the device waited on
    # the cpu (timed on the device), the median over the timed steps
    wait=$(awk -v w="$warmup" '$1 == "step" && $2 ~ /\// && match($0, /waited on the cpu [0-9.]+%/) {
            split($2, s, "/"); if (s[1] + 0 > w) print substr($0, RSTART + 18, RLENGTH - 19) }' "$f" |
        sort -g | awk '{ a[NR] = $1 } END { if (NR) printf "%.1f%%\n", (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2) }')
    local status=ok
    if [ -n "$BENCH_CUT" ]; then
        status=$(cut_status)
    elif [ $rc != 0 ]; then
        status="failed rc $rc$(why "$(grep -m1 'error' "$f")")"
    fi
    local tok=-
    [ -n "$ms" ] && tok=$(awk -v B="$B" -v T="$T" -v n="$accum" -v ms="$ms" 'BEGIN { printf "%.0f", B * T * n / (ms / 1000) }')
    row "$sc" "$cfg" fitlm "$B" "$T" "$tok" "${mem:--}" "${loss0:--}" "${loss1:--}" "${wait:--}" "$status"
}

# peft_run SHOWCASE CONFIG B T FLAGS...: bench/peft_baseline.py; a row
peft_run() {
    local sc=$1 cfg=$2 B=$3 T=$4
    shift 4
    local f=$work/$sc.$cfg.peft.out
    echo "== peft $sc $cfg B $B T $T: $*" >>"$log"
    bench_run "$log" "$f" $run_timeout "$py" "$src/bench/peft_baseline.py" --device $device --B "$B" --T "$T" \
        --steps "$steps" --warmup "$warmup" "$@"
    local rc=$?
    local r
    r=$(grep '^RESULT' "$f" | tail -1)
    if [ -n "$BENCH_CUT" ]; then
        row "$sc" "$cfg" peft "$B" "$T" - - - - - "$(cut_status)"
    elif grep -q '^SKIP' "$f"; then
        row "$sc" "$cfg" peft "$B" "$T" - - - - - "skipped: $(sed -n 's/^SKIP //p' "$f" | head -1)"
    elif [ $rc != 0 ] || [ -z "$r" ]; then
        row "$sc" "$cfg" peft "$B" "$T" - - - - - "failed rc $rc$(why "$(tail -1 "$f")")"
    else
        echo "$r" | tr ' ' '\n' | awk -F= -v sc="$sc" -v cfg="$cfg" -v B="$B" -v T="$T" '{ v[$1] = $2 }
            END { printf "%s\t%s\tpeft\t%s\t%s\t%s\t%s\t%s\t%s\t-\tok\n", sc, cfg, B, T, v["tok_s"],
                  v["peak_gpu_mib"], v["loss_first"], v["loss_last"] }' >>"$tsv"
    fi
}

# in_time SHOWCASE CONFIG ENGINE B T: whether a run may start (20 s left
# before the deadline); else a row
in_time() {
    bench_may_start 20 && return 0
    row "$1" "$2" "$3" "$4" "$5" - - - - - "skipped: time"
    return 1
}

for sc in $showcases; do
    echo "== showcase $sc at $(($(date +%s) - BENCH_T0)) s ($(bench_left) s before the deadline)" >>"$log"
    case $sc in
    lomo)
        # shellcheck disable=SC2046 # the shape's flags are words
        in_time lomo llama-7b fitlm 1 512 &&
            fitlm_run lomo llama-7b 1 512 $(shape --model llama-7b) --optimizer lomo --lr "${BENCH_LOMO_LR:-1e-1}" \
                --activation-checkpointing block --mem-limit 24GiB --steps "$lomo_steps"
        ;;
    offload)
        [ "$smoke" = 1 ] && device="test" # a device's offload, on any machine
        # the 1B scale: offloaded with and without clipping, and all on the GPU
        acc=(--optimizer adamw --activation-checkpointing block --grad-accum 8)
        off=(--config "$work/offload.json" --mem-limit 24GiB)
        # shellcheck disable=SC2046
        in_time offload tinyllama-1.1b-acc8-offload fitlm 4 1024 &&
            fitlm_run offload tinyllama-1.1b-acc8-offload 4 1024 $(shape --model tinyllama-1.1b) "${acc[@]}" "${off[@]}"
        # the micro-batches' sum on the device alone (no delayed update)
        # shellcheck disable=SC2046
        in_time offload tinyllama-1.1b-acc8-offload-devsum fitlm 4 1024 &&
            fitlm_run offload tinyllama-1.1b-acc8-offload-devsum 4 1024 $(shape --model tinyllama-1.1b) \
                "${acc[@]}" --config "$work/devsum.json" --mem-limit 24GiB
        # shellcheck disable=SC2046
        in_time offload tinyllama-1.1b-acc8-offload-delayed-devsum fitlm 4 1024 &&
            fitlm_run offload tinyllama-1.1b-acc8-offload-delayed-devsum 4 1024 $(shape --model tinyllama-1.1b) \
                "${acc[@]}" --config "$work/delayed_devsum.json" --mem-limit 24GiB
        # the same 32 sequences in one micro-batch: no sums on the host
        # (12 bytes a parameter each micro-batch), the delayed update under
        # the whole step
        # shellcheck disable=SC2046
        in_time offload tinyllama-1.1b-b32-offload-delayed fitlm 32 1024 &&
            fitlm_run offload tinyllama-1.1b-b32-offload-delayed 32 1024 $(shape --model tinyllama-1.1b) \
                --optimizer adamw --activation-checkpointing block --config "$work/delayed.json" --mem-limit 24GiB
        # shellcheck disable=SC2046
        in_time offload tinyllama-1.1b-acc8-offload-noclip fitlm 4 1024 &&
            fitlm_run offload tinyllama-1.1b-acc8-offload-noclip 4 1024 $(shape --model tinyllama-1.1b) "${acc[@]}" \
                --grad-clip 0 "${off[@]}"
        # shellcheck disable=SC2046
        in_time offload tinyllama-1.1b-acc8-all-on-gpu fitlm 4 1024 &&
            fitlm_run offload tinyllama-1.1b-acc8-all-on-gpu 4 1024 $(shape --model tinyllama-1.1b) "${acc[@]}"
        # the largest shape whose plan fits: 7B, 7B's width with 24 and
        # with 16 blocks, OpenLLaMA-3B's shape, TinyLlama-1.1B's
        names=(llama-7b llama-7b-24l llama-7b-16l openllama-3b tinyllama-1.1b)
        shapes=("--model llama-7b" "--model llama-7b --n-layer 24" "--model llama-7b --n-layer 16"
            "--model llama-7b --n-layer 26 --n-embd 3200 --n-head 32 --n-kv-head 32 --intermediate-size 8640"
            "--model tinyllama-1.1b")
        pick=-1 plan_err=""
        for k in "${!names[@]}"; do
            # shellcheck disable=SC2086
            "$fitlm" plan --device $device "${data[@]}" ${shapes[$k]} --batch 4 --seq-len 1024 \
                --precision bf16 --optimizer adamw --activation-checkpointing block \
                --config "$work/offload.json" --mem-limit 24GiB >"$work/plan.$k" 2>&1
            rc=$?
            [ $rc = 0 ] || plan_err=$(why "$(grep -m1 'error' "$work/plan.$k")")
            { echo "== plan offload ${names[$k]}: ${shapes[$k]}"; cat "$work/plan.$k"; } >>"$log"
            # the device's budget says fits, and the host's limit; the
            # smoke (no device) takes the first plan that runs
            if [ $rc = 0 ] && { [ "$smoke" = 1 ] || { grep -q '^device budget.*fits$' "$work/plan.$k" &&
                ! grep -q 'does NOT fit' "$work/plan.$k"; }; }; then
                pick=$k
                break
            fi
        done
        if [ "$pick" -lt 0 ]; then
            row offload none fitlm 4 1024 - - - - - "no shape's plan fits$plan_err (see $log)"
        else
            name=${names[$pick]}
            # lr 3e-4 (the default 3e-3 made llama-7b's loss climb, 11.2
            # to 25.8 and back to 13.2), both the same
            # shellcheck disable=SC2046,SC2086
            in_time offload "$name-offload" fitlm 4 1024 &&
                fitlm_run offload "$name-offload" 4 1024 $(shape ${shapes[$pick]}) --optimizer adamw --lr 3e-4 \
                    --activation-checkpointing block --config "$work/offload.json" --mem-limit 24GiB
            # shellcheck disable=SC2046,SC2086
            in_time offload "$name-all-on-gpu" fitlm 4 1024 &&
                fitlm_run offload "$name-all-on-gpu" 4 1024 $(shape ${shapes[$pick]}) --optimizer adamw --lr 3e-4 \
                    --activation-checkpointing block
        fi
        [ "$smoke" = 1 ] && device=cpu
        ;;
    lora)
        targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj
        lora=(--lora --lora-r 16 --lora-alpha 32 --lora-target-modules "$targets" --optimizer adamw
            --lr 1e-4 --activation-checkpointing block)
        for name in tinyllama-1.1b llama-7b; do
            if [ "$smoke" = 1 ]; then
                hf="--L 2 --C 64 --NH 4 --kv-heads 2 --I 176"
            elif [ $name = llama-7b ]; then
                hf="--L 32 --C 4096 --NH 32 --kv-heads 32 --I 11008"
            else
                hf="--L 22 --C 2048 --NH 32 --kv-heads 4 --I 5632"
            fi
            for q in lora qlora; do
                qf=() pq=(--quant none)
                [ $q = qlora ] && qf=(--quantize nf4 --double-quant) pq=(--quant nf4)
                # shellcheck disable=SC2046
                in_time lora "$name-$q" fitlm 4 512 &&
                    fitlm_run lora "$name-$q" 4 512 $(shape --model $name) "${lora[@]}" "${qf[@]}" \
                        --mem-limit 24GiB
                # llama-7b's LoRA under ZeRO-3 offload right after its LoRA
                # on the GPU, its comparison (before PEFT's and QLoRA's)
                if [ $name-$q = llama-7b-lora ]; then
                    [ "$smoke" = 1 ] && device="test" # a device's offload, on any machine
                    # shellcheck disable=SC2046
                    in_time lora llama-7b-lora-z3-offload fitlm 4 512 &&
                        fitlm_run lora llama-7b-lora-z3-offload 4 512 $(shape --model llama-7b) "${lora[@]}" \
                            --config "$work/z3_offload.json" --mem-limit 24GiB
                    [ "$smoke" = 1 ] && device=cpu
                fi
                T=512
                [ "$smoke" = 1 ] && T=32
                # shellcheck disable=SC2086
                in_time lora "$name-$q" peft 4 $T &&
                    peft_run lora "$name-$q" 4 $T $hf --rank 16 --alpha 32 --targets $targets \
                        --lr 1e-4 --ckpt block "${pq[@]}"
            done
        done
        ;;
    *)
        echo "bench/gpu_memory.sh: unknown showcase '$sc' (lomo, offload, lora)" >&2
        exit 2
        ;;
    esac
done

echo "== done at $(($(date +%s) - BENCH_T0)) s ($(bench_left) s before the deadline)" >>"$log"
echo "memory techniques, --mem-limit 24GiB: tokens/s (median of $steps steps after $warmup), peak MiB (device; the host's on --device cpu)"
table "$tsv"
# a run that failed (not one skipped) fails the script
! cut -f11 "$tsv" | grep -q '^failed'
