#!/usr/bin/env bash
# bench/offload.sh: NVMe offload of the optimizer, measured. The showcase:
# GPT-2 XL (1.56B parameters) trained with mixed-precision (bf16) AdamW on
# one machine whose RAM cannot hold its model states (16 bytes/param, 25 GB):
# ZeRO-2 on one process with the fp32 master weights and AdamW's m and v
# (12 bytes/param, 18.7 GB) in a file under NVME. Then the order of the
# strategies on a model that fits: ZeRO-2, ZeRO-2 + NVMe offload and ZeRO-3
# over 2 ranks. The tables of the last run, with their analysis, are in
# bench/offload.md.
#
#   NO_BUILD=1 bash bench/offload.sh
#
# Steps:
#   1. the disk's sequential bandwidth under NVME: bench/bench_disk writes
#      DISK_MB MiB, reads them back, then reads and writes at once, with the
#      offload's own way of doing I/O (O_DIRECT, io_uring, 1 MiB requests,
#      8 in flight: aio's defaults), and dd (one request at a time) for
#      comparison;
#   2. `fitlm plan` of the run with and without the offload (RAM per tag,
#      disk, what fits in the available memory);
#   3. the run itself, and again with optimizer_in_backward (no whole
#      gradient; clipping's two backward passes): MODEL at BATCH x SEQ, STEPS
#      steps, bf16 AdamW (lr LR,
#      WARMUP warm-up steps), ZeRO-2,
#      offload_optimizer {device nvme, buffer_count BUFFERS, pipeline_read
#      and pipeline_write true}, sub_group_size CHUNK; each step's loss and
#      time, the offload's bytes read and written per step, the bandwidth its
#      I/O achieved, the seconds the step stood waiting for it and the share
#      of the I/O time hidden behind computation; the tagged peak per tag
#      (--mem-report) against the plan, and the process's peak RSS;
#   4. with ORDER=1 (default), ORDER_MODEL (gpt2) bf16 over 2 ranks, ZeRO-2,
#      ZeRO-2 + NVMe offload and ZeRO-3, ORDER_STEPS steps each: the median
#      step time of the steps after the first.
# Environment: BUILD (build), NVME (/work/nvme-bench: created, emptied after),
# MODEL (gpt2-xl), BATCH (1), SEQ (128), STEPS (6), LR (2e-4), WARMUP (2),
# CHUNK (5e7), BUFFERS (4),
# DISK_MB (4096), XL (1: the runs of 3), ORDER (1), ORDER_MODEL (gpt2),
# ORDER_STEPS (5), LOG (a new temporary directory).
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=${BUILD:-build}
NVME=${NVME:-/work/nvme-bench}
MODEL=${MODEL:-gpt2-xl}
BATCH=${BATCH:-1}
SEQ=${SEQ:-128}
STEPS=${STEPS:-6}
LR=${LR:-2e-4}
WARMUP=${WARMUP:-2}
CHUNK=${CHUNK:-5e7}
BUFFERS=${BUFFERS:-4}
DISK_MB=${DISK_MB:-4096}
ORDER=${ORDER:-1}
XL=${XL:-1}
ORDER_MODEL=${ORDER_MODEL:-gpt2}
ORDER_STEPS=${ORDER_STEPS:-5}
LOG=${LOG:-$(mktemp -d "${TMPDIR:-/tmp}/fitlm-offload.XXXXXX")}
mkdir -p "$LOG" "$NVME"
echo "== logs in $LOG, offload files in $NVME" >&2

source bench/lib.sh
bench_build

echo "# NVMe offload benchmark ($(date -u +%Y-%m-%d))"
echo
bench_cpu
echo "Disk under $NVME: $(df -h "$NVME" | awk 'NR == 2 { print $1 ", " $2 " (" $4 " free)" }'); RAM: $(awk '/MemTotal/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo)"
echo

# --- 1. the disk ------------------------------------------------------------
"$BUILD/bench_disk" "$NVME" "$DISK_MB" 1024 8 >"$LOG/disk.txt" || { cat "$LOG/disk.txt"; exit 1; }
dd if=/dev/zero of="$NVME/bandwidth.bin" bs=1M count="$DISK_MB" oflag=direct conv=fsync 2>"$LOG/dd_write.txt"
dd if="$NVME/bandwidth.bin" of=/dev/null bs=1M iflag=direct 2>"$LOG/dd_read.txt"
rm -f "$NVME/bandwidth.bin"
echo "Sequential bandwidth: $(sed 's/^disk [^:]*: //' "$LOG/disk.txt")"
echo "dd, 1 MiB blocks one at a time: write $(tail -1 "$LOG/dd_write.txt" | sed 's/.*, //'), read $(tail -1 "$LOG/dd_read.txt" | sed 's/.*, //')"
echo

# --- 2. the plans -------------------------------------------------------------
cat >"$LOG/offload.json" <<EOF
{"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7, "sub_group_size": $CHUNK,
  "offload_optimizer": {"device": "nvme", "nvme_path": "$NVME", "buffer_count": $BUFFERS,
                        "pipeline_read": true, "pipeline_write": true}}}
EOF
cat >"$LOG/ram.json" <<EOF
{"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7}}
EOF
RUN=(--model "$MODEL" --precision bf16 --batch "$BATCH" --seq-len "$SEQ" --threads 2 --val-data none
     --sample-tokens 0)
"$FITLM" plan "${RUN[@]}" --config "$LOG/offload.json" >"$LOG/plan.txt"
"$FITLM" plan "${RUN[@]}" --config "$LOG/ram.json" >"$LOG/plan_ram.txt"
echo "## Plan: $MODEL, bf16 AdamW, ZeRO-2, one process, micro-batch $BATCH x $SEQ"
echo
echo '```'
sed -n '/^tag (per rank)/,$p' "$LOG/plan.txt"
echo '```'
echo
echo "Without the offload: $(grep -E '^memory limit' "$LOG/plan_ram.txt") (total $(awk '$1 == "total" { printf "%.2f GiB", $4; exit }' "$LOG/plan_ram.txt"))"
echo

# --- 3. the runs ---------------------------------------------------------------
# xl_run NAME CONFIG: trains, then prints its losses, I/O, time, RSS and tags
# against the plan of the same config
xl_run() {
    local name=$1 config=$2 wall rss_kb steps
    "$FITLM" plan "${RUN[@]}" --config "$config" >"$LOG/plan_$name.txt"
    /usr/bin/time -o "$LOG/$name.time" -f '%e %M' "$FITLM" train "${RUN[@]}" --config "$config" \
        --steps "$STEPS" --lr "$LR" --warmup "$WARMUP" --eval-every 0 --out '' --mem-report \
        >"$LOG/$name.out" 2>"$LOG/$name.err" || { cat "$LOG/$name.err"; exit 1; }
    echo "| step | loss | step time (s) |"
    echo "|---:|---:|---:|"
    grep -E '^step +[0-9]+/' "$LOG/$name.out" | awk -F'|' '{ split($1, s, " "); split(s[2], n, "/");
        gsub(/[^0-9.]/, "", $2); gsub(/ ms/, "", $5); printf "| %d | %s | %.1f |\n", n[1], $2, $5 / 1000 }'
    echo
    grep '^NVMe offload per step' "$LOG/$name.out"
    echo
    read -r wall rss_kb <"$LOG/$name.time"
    steps=$(grep -o '| [0-9.]* ms |' "$LOG/$name.out" | awk 'NR > 1 { print $2 / 1000 }' | median_min_max)
    echo "Median step time after the first: $(echo "$steps" | awk '{ printf "%.1f s (min %.1f, max %.1f)", $1, $2, $3 }');" \
        "whole run $wall s; peak RSS $(awk -v k="$rss_kb" 'BEGIN { printf "%.2f GiB", k / 1048576 }')"
    echo
    echo "| tag | planned (bytes) | measured peak (bytes) |"
    echo "|---|---:|---:|"
    local t planned measured
    for t in params grads master optim acts workspace comm offload other total; do
        planned=$(plan_bytes "$t" "$LOG/plan_$name.txt")
        if [[ $t == total ]]; then
            measured=$(awk '$0 ~ /^memory by tag/ { on = 1 } on && $1 == "total" { v = $4 } END { printf "%.0f", v * 1048576 }' "$LOG/$name.out")
            t="total (measured: its MiB)"
        else
            measured=$(awk -v t="$t" '$0 ~ /^memory by tag/ { on = 1 } on && $1 == t { v = $4 } END { printf "%.0f", v }' "$LOG/$name.out")
        fi
        echo "| $t | $planned | $measured |"
    done
    echo
}
if [[ $XL == 1 ]]; then
    echo "## Training $STEPS steps with the optimizer on disk (ZeRO-2)"
    echo
    xl_run offload "$LOG/offload.json"
    sed 's/^{/{"optimizer_in_backward": true, /' "$LOG/offload.json" >"$LOG/offload_ib.json"
    echo "## The same with optimizer_in_backward: each block updated from the backward pass"
    echo
    xl_run in_backward "$LOG/offload_ib.json"
fi

# --- 4. the order of the strategies --------------------------------------------
if [[ $ORDER == 1 ]]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl=self,vader OMPI_MCA_mpi_yield_when_idle=1
    export MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-1800}
    echo "## $ORDER_MODEL bf16 AdamW over 2 ranks (one thread each), batch 2 x 128 per rank"
    echo
    echo "| strategy | median step (ms) | min-max | tagged peak per rank (MiB) |"
    echo "|---|---:|---:|---:|"
    # each rank's output to a file of its own (not a terminal: one plain line per step)
    cat >"$LOG/rank.sh" <<'EOF'
out=$1; shift
exec "$@" >"$out.r${OMPI_COMM_WORLD_RANK:-0}" 2>&1
EOF
    order_run() { # name config
        mpirun.openmpi -q --bind-to none -np 2 bash "$LOG/rank.sh" "$LOG/order_$1.out" "$FITLM" \
            train --model "$ORDER_MODEL" --precision bf16 --batch 2 --seq-len 128 --threads 1 \
            --steps "$ORDER_STEPS" --warmup 0 --eval-every 0 --val-data none --sample-tokens 0 \
            --out '' --mem-report --config "$2" ||
            { tail -5 "$LOG/order_$1.out.r0"; exit 1; }
        local s
        s=$(grep -o '| [0-9.]* ms |' "$LOG/order_$1.out.r0" | awk 'NR > 1 { print $2 }' | median_min_max)
        echo "| $1 | $(echo "$s" | awk '{ printf "%.0f | %.0f-%.0f", $1, $2, $3 }') | $(tag_peak total "$LOG/order_$1.out.r0") |"
    }
    echo '{"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6}}' >"$LOG/z2.json"
    cat >"$LOG/z2_nvme.json" <<EOF
{"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6,
  "sub_group_size": 1e7, "offload_optimizer": {"device": "nvme", "nvme_path": "$NVME",
  "buffer_count": $BUFFERS, "pipeline_read": true, "pipeline_write": true}}}
EOF
    echo '{"zero_optimization": {"stage": 3, "reduce_bucket_size": 5e6, "stage3_prefetch_bucket_size": 7.1e6}}' >"$LOG/z3.json"
    order_run "ZeRO-2" "$LOG/z2.json"
    order_run "ZeRO-2 + NVMe offload" "$LOG/z2_nvme.json"
    order_run "ZeRO-3" "$LOG/z3.json"
    echo
fi
rm -rf "${NVME:?}"/fitlm-* 2>/dev/null || true
