#!/usr/bin/env bash
# bench/lora.sh: memory and speed of LoRA and QLoRA against full fine-tuning,
# on one LLaMA shape, measured side by side in one run, then planned for 7B
# and for the QLoRA paper's 65B.
#
#  (a) measured: MODEL (TinyLlama-1.1B's shape), bf16, B=1, T=256, block
#      activation checkpointing, random weights, byte tokens of the Brown
#      corpus, STEPS steps of `fitlm train --mem-report` under five configs:
#        full       AdamW on every weight (bf16 weights, fp32 master, m, v)
#        lora-qv    LoRA r=8 alpha 8 on q_proj,v_proj (PEFT's defaults), AdamW
#        lora-all   LoRA r=64 alpha 16 on all linear layers but lm_head
#        qlora      the same on an NF4 base with double quantisation: the
#                   QLoRA paper's recipe (r 64, alpha 16, all linear layers,
#                   constant LR 2e-4, max_grad_norm 0.3, checkpointing)
#        lora-lomo  LoRA r=8 on q_proj,v_proj + the base trained by LOMO in the
#                   same backward (--lora-base-optimizer lomo); LOMO clips by
#                   the global norm (1.0), which takes a second backward
#      Columns: per-tag peaks (GiB) from the memory report, the tagged total
#      and `fitlm plan`'s total for the same flags, peak RSS (/usr/bin/time
#      -v), median tokens/s of the steps after the first, trainable
#      parameters, and the 1-minute load average after the run (the machine
#      may be shared; this run counts for about THREADS of it, so a value well
#      above THREADS means other processes took cores and the speed suffered).
#      Every tag's measured peak is then checked against the plan.
#  (b) planned (`fitlm plan`, exact for what the engine runs): the llama-7b
#      preset under the same five configs, and the QLoRA config on a 65B
#      LLaMA shape (80 layers, 8192 channels, 64 heads, MLP 22016) at T=512,
#      beside the QLoRA paper's claim (65B fine-tuned on one 48 GB GPU), with
#      the bytes per parameter of the base weights.
#
#   bash bench/lora.sh                    # ~7 minutes on 2 cores
#   LORA_OUT=file bash bench/lora.sh     # also writes the tables there
#
# Knobs: BUILD [build], THREADS [2], STEPS [4], MODEL [tinyllama-1.1b],
# LOG [a fresh /tmp dir], NO_BUILD=1, LORA_OUT [none].
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=${BUILD:-build}
THREADS=${THREADS:-2}
STEPS=${STEPS:-4}
MODEL=${MODEL:-tinyllama-1.1b}
LOG=${LOG:-$(mktemp -d "${TMPDIR:-/tmp}/fitlm-lora.XXXXXX")}
mkdir -p "$LOG"
if [[ -n ${LORA_OUT:-} ]]; then
    exec > >(tee "$LORA_OUT")
fi

source bench/lib.sh
bench_build
[[ -f data/brown_byte/train_000000.bin ]] || FITLM=$FITLM bash scripts/tokenize.sh >/dev/null

COMMON=(--precision bf16 --batch 1 --activation-checkpointing block --tokenizer byte
    --data data/brown_byte --val-data none --eval-every 0 --sample-tokens 0 --out ''
    --threads "$THREADS" --warmup 0)
CONFIGS=(full lora-qv lora-all qlora lora-lomo)

config_flags() {
    local qlora="--lora --lora-r 64 --lora-alpha 16 --lora-target-modules all-linear"
    qlora+=" --lr 2e-4 --scheduler constant --grad-clip 0.3"
    case $1 in
        full) echo "--optimizer adamw" ;;
        lora-qv) echo "--lora --lora-r 8 --lora-alpha 8 --lora-target-modules q_proj,v_proj" ;;
        lora-all) echo "$qlora" ;;
        qlora) echo "$qlora --quantize nf4 --double-quant" ;;
        lora-lomo) echo "--lora --lora-r 8 --lora-alpha 8 --lora-target-modules q_proj,v_proj" \
            "--lora-base-optimizer lomo --lora-base-lr 0.01" ;;
    esac
}

gib() { awk -v b="$1" 'BEGIN { printf "%.3f", b / 1073741824 }'; }
# mgib TAG LOG: TAG's peak in a memory report, in GiB
mgib() { awk -v m="$(tag_peak "$1" "$2")" 'BEGIN { printf "%.3f", m / 1024 }'; }
# pgib TAG PLAN: TAG's bytes in a plan, in GiB
pgib() { gib "$(plan_bytes "$1" "$2")"; }
# median_tok LOG: the median tokens/s of the steps after the first
median_tok() {
    grep -o '[0-9]* tok/s' "$1" | awk 'NR > 1 { print $1 }' | median_min_max | awk '{ print $1 }'
}
# n_base LOG|PLAN: the model's parameter count
n_base() { grep -m1 -o -E '[0-9]+ parameters' "$1" | awk '{ print $1 }'; }
# n_adapters LOG|PLAN: LoRA adapter parameters (0 without LoRA); a plan that
# does not name them: its grads tag / 2 (bf16 adapter gradients)
n_adapters() {
    local n
    n=$(grep -m1 -o -E '[0-9]+ (in LoRA adapters|adapter parameters)' "$1" | awk '{ print $1 }')
    if [[ -z $n ]] && grep -q -- '--lora' <<<"$2"; then
        n=$(($(plan_bytes grads "$1") / 2))
    fi
    echo "${n:-0}"
}
# trainable CONFIG BASE ADAPTERS
trainable() {
    case $1 in
        full) echo "$2" ;;
        lora-lomo) echo $(($2 + $3)) ;;
        *) echo "$3" ;;
    esac
}
# commas N: 1234567 -> 1,234,567
commas() { printf "%s" "$1" | rev | sed -E 's/([0-9]{3})/\1,/g; s/,$//' | rev; }
# plan_check NAME LOG PLAN: tags whose measured peak is not the plan's (0.01 MiB)
plan_check() {
    local t m p
    for t in params grads master optim acts workspace comm offload other; do
        m=$(tag_peak "$t" "$2")
        p=$(awk -v b="$(plan_bytes "$t" "$3")" 'BEGIN { printf "%.2f", b / 1048576 }')
        awk -v m="$m" -v p="$p" 'BEGIN { d = m - p; exit !(d > 0.01 || d < -0.01) }' &&
            MISMATCH+=("$1: $t measured $m MiB, planned $p MiB")
    done
    return 0
}

echo "$(bench_cpu); $THREADS threads; load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "(a) measured: $MODEL, bf16, B=1, T=256, block checkpointing, random weights, $STEPS steps"
echo
echo "| config | params GiB | grads GiB | optimizer state GiB (master + optim) | activations GiB | workspace GiB | total GiB (tags) | plan total GiB | peak RSS GiB | tokens/s (median) | trainable parameters | load after |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
MISMATCH=()
for c in "${CONFIGS[@]}"; do
    read -r -a cf <<<"$(config_flags "$c")"
    log=$LOG/a_$c.log plan=$LOG/a_$c.plan
    flags=(--model "$MODEL" "${COMMON[@]}" --seq-len 256 --steps "$STEPS" "${cf[@]}")
    echo "fitlm train ${flags[*]} --mem-report" >"$LOG/a_$c.cmd"
    "$FITLM" plan "${flags[@]}" --mem-limit 1T >"$plan" 2>&1
    if ! /usr/bin/time -v "$FITLM" train "${flags[@]}" --mem-report >"$log" 2>"$LOG/a_$c.time"; then
        echo "| $c | failed: $(tail -n 3 "$LOG/a_$c.time" | tr '\n' ' ') (log $log) |"
        continue
    fi
    ms=$(awk -v a="$(tag_peak master "$log")" -v b="$(tag_peak optim "$log")" \
        'BEGIN { printf "%.3f", (a + b) / 1024 }')
    rss=$(awk '/Maximum resident set size/ { printf "%.2f", $NF / 1048576 }' "$LOG/a_$c.time")
    nb=$(n_base "$log")
    na=$(n_adapters "$log" "${cf[*]}")
    echo "| $c | $(mgib params "$log") | $(mgib grads "$log") | $ms | $(mgib acts "$log") | $(mgib workspace "$log") | $(mgib total "$log") | $(pgib total "$plan") | $rss | $(median_tok "$log") | $(commas "$(trainable "$c" "$nb" "$na")") | $(cut -d' ' -f1 /proc/loadavg) |"
    plan_check "$c" "$log" "$plan"
done
echo
if ((${#MISMATCH[@]})); then
    echo "plan check: these tags' measured peaks differ from fitlm plan's:"
    printf '    %s\n' "${MISMATCH[@]}"
else
    echo "plan check: every tag's measured peak equals fitlm plan's (to 0.01 MiB) in every row"
fi
grep -h '^NF4 base' "$LOG/a_qlora.log" 2>/dev/null | sed 's/^/qlora: /' || true
echo "load average at the end of (a): $(cut -d' ' -f1-3 /proc/loadavg)"

# (b): plans
echo
echo "(b) planned (fitlm plan): llama-7b, bf16, B=1, T=256, block checkpointing; and a 65B LLaMA shape, QLoRA, T=512"
echo
echo "| model | config | params GiB | grads GiB | optimizer state GiB | activations GiB | workspace GiB | total GiB | total GB | trainable parameters | base weights bytes/param |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
SHAPE_65B=(--model llama-7b --n-layer 80 --n-embd 8192 --n-head 64 --n-kv-head 64 --intermediate-size 22016)
plan_row() { # NAME CONFIG FLAGS...
    local name=$1 c=$2 plan=$LOG/b_$1_$2.plan nb na ms
    shift 2
    "$FITLM" plan "$@" --mem-limit 1T >"$plan" 2>&1 || { echo "| $name | $c | plan failed ($plan) |"; return 0; }
    nb=$(n_base "$plan")
    na=$(n_adapters "$plan" "$*")
    ms=$(gib "$(($(plan_bytes master "$plan") + $(plan_bytes optim "$plan")))")
    echo "| $name | $c | $(pgib params "$plan") | $(pgib grads "$plan") | $ms | $(pgib acts "$plan") | $(pgib workspace "$plan") | $(pgib total "$plan") | $(awk -v b="$(plan_bytes total "$plan")" 'BEGIN { printf "%.2f", b / 1e9 }') | $(commas "$(trainable "$c" "$nb" "$na")") | $(awk -v p="$(plan_bytes params "$plan")" -v a="$na" -v n="$nb" 'BEGIN { printf "%.4f", (p - 2 * a) / n }') |"
}
for c in "${CONFIGS[@]}"; do
    read -r -a cf <<<"$(config_flags "$c")"
    plan_row llama-7b "$c" --model llama-7b "${COMMON[@]}" --seq-len 256 "${cf[@]}"
done
read -r -a cf <<<"$(config_flags qlora)"
plan_row llama-65b qlora "${SHAPE_65B[@]}" "${COMMON[@]}" --seq-len 512 "${cf[@]}"
p65=$LOG/b_llama-65b_qlora.plan
echo
grep -o -E 'NF4: [0-9]+ parameters at [0-9.]+ bytes each' "$p65" | sed 's/^/65B plan: /' || true
awk -v t="$(plan_bytes total "$p65")" -v n="$(n_base "$p65")" 'BEGIN {
    printf "65B QLoRA: planned total %.2f GB (%.2f GiB) = %.3f bytes per base parameter; ", t / 1e9, t / 1073741824, t / n
    printf "QLoRA paper: 65B fine-tuned on one 48 GB GPU (%.3f bytes per parameter of budget)\n", 48e9 / n }'
