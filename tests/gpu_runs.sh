#!/usr/bin/env bash
# tests/gpu_runs.sh FITLM: whole training runs on the GPU against the cpu
# (CTest gpu_runs, label gpu). For a tiny GPT-2 and a tiny LLaMA, 10 AdamW
# steps on byte tokens of the repository's docs:
# - fp32: every step's loss on `--device cuda` within 1e-5 relative of the
#   cpu run's;
# - bf16: every step's loss within the gap bf16 shows against fp32 on the
#   cpu (the largest relative difference over the 10 steps, at least 1e-4);
# - GPT-2 with FITLM_CUDA_GELU_FUSION=0 and 2 (its MLP GELU in its own
#   kernels; in cuBLASLt's GELU and DGELU epilogues, the default on Hopper)
#   within the same bounds; fp32 with the LM head and
#   loss in chunks of 48 positions (--logits-chunk) within 1e-5 too;
# - two GPU runs bitwise equal (every logged loss, lr and norm, printed to
#   float precision, and their exported weights byte for byte);
# - resume: 5 steps, a checkpoint, 5 more from it, equal to the 10 straight;
# - an export of the GPU-trained model evaluates on the cpu to the loss the
#   checkpoint evaluates to on the cpu (bitwise) and on the GPU (1e-5);
# - --mem-limit, the device's budget: at the plan's device bytes a run
#   trains, one byte under them it is refused before allocating;
# - the fused step (LOMO, AdaLomo, AdamW with --optimizer-in-backward: each
#   unit updated from the backward pass, no master, 16-bit weights stored
#   back by stochastic rounding): fp32 losses within 1e-5 relative of the
#   cpu's, bf16 within the cpu's bf16-fp32 gap (as above), and two bf16 GPU
#   runs of each bit for bit.
# Then LoRA, QLoRA (NF4, double quantisation) and LoRA + LOMO on the LLaMA's
# export, in fp32 and bf16 with the same bounds, two runs and a resume bitwise.
# Then ZeRO-Offload (offload_optimizer.device cpu, fp32 and bf16): the first
# step's loss bitwise the all-on-GPU run's (the same weights), every step's
# within 1e-5 relative (the update is the cpu's AdamW, not the GPU's; on the
# test device and the cpu, where they are the same, bitwise), and its
# resume bit for bit as its straight run; LoRA and QLoRA likewise with
# their adapters' optimizer in host memory (LoRA's dense base offloaded
# too, ZeRO-3's offload_param cpu); under NVMe offload bitwise the
# pinned-memory offload run; with weight offload (ZeRO-3, offload_param
# cpu) bitwise the stage-1 offloaded run, and its resume bit for bit; with
# weight offload to NVMe (offload_param and offload_optimizer device nvme)
# bitwise the pinned weight offload's run, its resume bit for bit, and the
# device's peak of weights the plan's and under the model's; without
# clipping the update during the backward pass bitwise the update after it;
# each step after the first waits behind the device's queued work once
# (metrics.jsonl's host_waits: the verdict's read); each offloaded step
# reports the share of it the device waited on the cpu
# (timed on the device), within [0, 100]. The plan's device bytes per tag
# equal a run's measured peaks (the backend's scratch included), and
# --mem-limit counts what the device holds itself (cuda: its context,
# measured at start-up). With accumulation 3 (the device holding a ring
# of two units' gradients, summed on the host) an offloaded run's first
# step is bitwise the all-on-GPU run's, every step within 1e-5 relative,
# weight offload bitwise the stage-1 offloaded run, and the device's peak
# of gradients the plan's, under the whole gradient's; ZeRO-2 on one
# process bitwise the plain run, the offload's state pinned (pin_memory)
# bitwise the unpinned; the sum made on the device (accumulate_on_device,
# fp32 and bf16) bitwise the host's. The delayed update
# (offload_optimizer.delayed_update) within 1e-5 relative of the test
# device's run (fp32, accumulation 2), its first steps bitwise the
# undelayed run's, its resume bit for bit.
# GPU_RUNS_QUICK=1 (the emulated GPU's CTest gpu_runs_emu, where a step
# takes 0.1 to 0.2 s) runs the whole runs on the LLaMA only (GPT-2's
# kernels are test_gpu's), the fused steps as LOMO and AdaLomo, LoRA's
# kinds as QLoRA alone, and every run at batch 2 instead of 4 for 6 steps
# instead of 10 (the resumes from step 3); the rest as written.
# Exits 77 (skipped) when the machine has no NVIDIA GPU or the build no
# CUDA backend. GPU_RUNS_DEVICE=test (or cpu) runs the same checks on the
# test device (or the cpu) against the cpu: a check of this script anywhere.
set -euo pipefail
fitlm=${1:?usage: tests/gpu_runs.sh FITLM}
dev=${GPU_RUNS_DEVICE:-cuda}
batch=4 steps=10
[ -n "${GPU_RUNS_QUICK:-}" ] && batch=2 steps=6
half=$((steps / 2)) # where the resumes start
src=${FITLM_SOURCE_DIR:-$(cd "$(dirname "$0")/.." && pwd)}

# FITLM_CUDA_EMU=1: a build on the CUDA emulator (tests/cuda_emu), no GPU needed
if [ "$dev" = cuda ] && [ -z "${FITLM_CUDA_EMU:-}" ] && ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_runs: skipped: no NVIDIA GPU (nvidia-smi finds none)"
    exit 77
fi
work=$(mktemp -d /tmp/fitlm_gpu_runs.XXXXXX)
trap 'rm -rf "$work"' EXIT

failed=0
check() { # check OK MESSAGE
    if [ "$1" = 1 ]; then echo "ok: $2"; else echo "FAILED: $2"; failed=1; fi
}

cat "$src"/docs/*.md >"$work/text.txt"
"$fitlm" tokenize "$work/text.txt" -o "$work/data" --tokenizer byte --threads 2 >/dev/null
head -c 2048 "$work/text.txt" >"$work/eval.txt" # what the evals read: 32 windows

# run NAME DEVICE ARCH PRECISION [FLAGS...]: $steps steps into $work/NAME
# (a given peak: the cpu runs would measure the host's, 0.05 s each)
run() {
    local name=$1 device=$2 arch=$3 prec=$4
    shift 4
    if ! "$fitlm" train --device "$device" --model tiny --arch "$arch" --tokenizer byte \
        --data "$work/data" --batch "$batch" --seq-len 64 --steps "$steps" --warmup 2 --lr 1e-3 \
        --precision "$prec" --threads 2 --sample-tokens 0 --eval-every 0 --eval-iters 2 \
        --seed 1234 --peak-tflops 1 --out "$work/$name" "$@" >"$work/$name.out" 2>&1; then
        if grep -qE "no CUDA backend|no NVIDIA GPU|no CUDA-capable" "$work/$name.out"; then
            echo "gpu_runs: skipped: $(grep -m1 -E 'CUDA|GPU' "$work/$name.out")"
            exit 77
        fi
        echo "gpu_runs: fitlm train ($name) failed:"
        tail -20 "$work/$name.out"
        exit 1
    fi
}

# the step lines' losses of a run, one per line
losses() { awk '$1 == "step" && $3 == "loss" { print $4 }' "$work/$1/log.txt"; }

# max relative difference of two runs' losses, step by step (and whether
# they have the same number of steps: 1 when not)
max_rel() {
    paste <(losses "$1") <(losses "$2") | awk -v n="$steps" '
        NF != 2 { bad = 1 }
        { d = $1 - $2; if (d < 0) d = -d; r = d / ($2 < 0 ? -$2 : $2); if (r > m) m = r }
        END { if (bad || NR != n) print "inf"; else printf "%.3g\n", m }'
}

le() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a != "inf" && a + 0 <= b + 0) }'; }

# resumed_equals RUN WHAT [FLAGS...]: RUN's checkpoint at step $half
# resumed (with FLAGS) logs the steps after it, bit for bit those of RUN
resumed="resumed at step $half on $dev, steps $((half + 1))-$steps bit for bit"
resumed_equals() {
    local r=$1 what=$2 late
    late="^step \($(seq -s '\|' $((half + 1)) "$steps")\) loss"
    shift 2
    "$fitlm" train --device "$dev" --resume "$work/$r/ckpt_$(printf %08d $half).fitlm" "$@" \
        --out "$work/${r}_resumed" --threads 2 >"$work/${r}_resumed.out" 2>&1 ||
        { tail -20 "$work/${r}_resumed.out"; exit 1; }
    [ "$(grep -c "$late" "$work/${r}_resumed/log.txt")" = $((steps - half)) ] &&
        cmp -s <(grep "$late" "$work/$r/log.txt") <(grep "$late" "$work/${r}_resumed/log.txt") &&
        ok=1 || ok=0
    check $ok "$what"
}

archs=(gpt2 llama)
[ -n "${GPU_RUNS_QUICK:-}" ] && archs=(llama)
for arch in "${archs[@]}"; do
    run "cpu_fp32_$arch" cpu "$arch" fp32
    run "cpu_bf16_$arch" cpu "$arch" bf16
    run "dev_fp32_$arch" "$dev" "$arch" fp32 --save-every "$half"
    run "dev_fp32b_$arch" "$dev" "$arch" fp32
    run "dev_bf16_$arch" "$dev" "$arch" bf16

    e=$(max_rel "dev_fp32_$arch" "cpu_fp32_$arch")
    le "$e" 1e-5 && ok=1 || ok=0
    check $ok "$arch fp32: $dev losses within 1e-5 relative of the cpu's (max $e)"

    # the LM head and loss 48 positions at a time (logits_chunk)
    run "dev_fp32c_$arch" "$dev" "$arch" fp32 --logits-chunk 48
    e=$(max_rel "dev_fp32c_$arch" "cpu_fp32_$arch")
    le "$e" 1e-5 && ok=1 || ok=0
    check $ok "$arch fp32 with --logits-chunk 48: $dev losses within 1e-5 relative of the cpu's (max $e)"

    gap=$(max_rel "cpu_bf16_$arch" "cpu_fp32_$arch")
    bound=$(awk -v g="$gap" 'BEGIN { print (g + 0 > 1e-4 ? g : 1e-4) }')
    e=$(max_rel "dev_bf16_$arch" "cpu_bf16_$arch")
    le "$e" "$bound" && ok=1 || ok=0
    check $ok "$arch bf16: $dev losses within the cpu's bf16-fp32 gap $bound of the cpu's (max $e)"

    # GPT-2's MLP GELU in its own kernels and in its GEMMs' cuBLASLt
    # epilogues, forward and backward (one of them the card's default)
    if [ "$arch" = gpt2 ] && [ "$dev" = cuda ]; then
        for level in 0 2; do
            for prec in fp32 bf16; do
                FITLM_CUDA_GELU_FUSION=$level run "dev_${prec}_gelu$level" cuda gpt2 "$prec"
                e=$(max_rel "dev_${prec}_gelu$level" "cpu_${prec}_gpt2")
                b=1e-5
                [ "$prec" = bf16 ] && b=$bound
                le "$e" "$b" && ok=1 || ok=0
                check $ok "gpt2 $prec with FITLM_CUDA_GELU_FUSION=$level: losses within $b of the cpu's (max $e)"
            done
        done
    fi

    cmp -s <(grep '^step' "$work/dev_fp32_$arch/log.txt") \
        <(grep '^step' "$work/dev_fp32b_$arch/log.txt") && ok=1 || ok=0
    check $ok "$arch: two $dev runs log the same values bit for bit"

    # the step's one wait: its verdict's read (the first step left out: a
    # one-time set-up may wait there; the emulated GPU's waits once too)
    if [ "$dev" != cpu ]; then
        waits=$(grep -o '"host_waits":[0-9]*' "$work/dev_bf16_$arch/metrics.jsonl" | tail -n +2 |
            cut -d: -f2 | sort -u | tr '\n' ' ')
        [ "$waits" = "1 " ] && ok=1 || ok=0
        check $ok "$arch bf16: each $dev step after the first waits on the device once (host_waits: ${waits:-none})"
    fi

    # resume from step $half's checkpoint: the later steps as the straight run's
    resumed_equals "dev_fp32_$arch" "$arch: $resumed as the straight run"

    # the export of the GPU-trained model on the cpu
    for r in "dev_fp32_$arch" "dev_fp32b_$arch"; do
        "$fitlm" export "$work/$r" -o "$work/$r.hf" >/dev/null
    done
    cmp -s "$work/dev_fp32_$arch.hf/model.safetensors" "$work/dev_fp32b_$arch.hf/model.safetensors" &&
        ok=1 || ok=0
    check $ok "$arch: two $dev runs export the same weights byte for byte"
    ev() { # ev DEVICE SOURCE-FLAG PATH: the eval loss
        "$fitlm" eval --device "$1" "$2" "$3" --text "$work/eval.txt" --tokenizer byte --batch "$batch" --seq-len 64 \
            --threads 2 --json 2>/dev/null | sed -n 's/.*"loss": *\([-0-9.eE+]*\).*/\1/p'
    }
    l_export=$(ev cpu --init-from "$work/dev_fp32_$arch.hf")
    l_ckpt=$(ev cpu --checkpoint "$work/dev_fp32_$arch")
    l_dev=$(ev "$dev" --checkpoint "$work/dev_fp32_$arch")
    [ -n "$l_export" ] && [ "$l_export" = "$l_ckpt" ] && ok=1 || ok=0
    check $ok "$arch: the export evaluates on the cpu to the checkpoint's cpu loss ($l_export, $l_ckpt)"
    e=$(awk -v a="$l_dev" -v b="$l_ckpt" 'BEGIN { if (a == "" || b == "") print "inf";
        else { d = a - b; if (d < 0) d = -d; printf "%.3g\n", d / b } }')
    le "$e" 1e-5 && ok=1 || ok=0
    check $ok "$arch: the checkpoint evaluates on $dev within 1e-5 of the cpu ($l_dev, $e)"
done

# --mem-limit on the device: its budget, against the plan's device bytes
# (and, on cuda, an unknown choice of attention kernels refused by name)
flags=(--device "$dev" --model tiny --arch llama --tokenizer byte --data "$work/data" --batch "$batch"
    --seq-len 64 --steps 2 --precision bf16 --threads 2 --sample-tokens 0 --eval-iters 1)
"$fitlm" plan "${flags[@]}" >"$work/plan.out" 2>&1 || true
need=$(awk '$1 == "total" && NF >= 4 { print $3; exit }' "$work/plan.out")
# what the device holds itself (cuda: its context), which the limit, a
# card's total memory, counts too
held=$(awk '/^the device holds [0-9]+ bytes itself/ { print $4; exit }' "$work/plan.out")
held=${held:-0}
if [ "$dev" = cuda ]; then
    [ "$held" -gt 0 ] && grep -q "context and cuBLASLt" "$work/plan.out" && ok=1 || ok=0
    check $ok "cuda measures the bytes its context holds ($held) and names them at start-up"
    ! FITLM_CUDA_ATTENTION=flash "$fitlm" train "${flags[@]}" --out "" >"$work/kernels.out" 2>&1 &&
        grep -q "FITLM_CUDA_ATTENTION=flash: the tensor-core attention kernels are mma or wmma" \
            "$work/kernels.out" && ok=1 || ok=0
    check $ok "an unknown FITLM_CUDA_ATTENTION is refused by name, not run as the default"
    ! FITLM_CUDA_GELU_FUSION=3 "$fitlm" train "${flags[@]}" --out "" >"$work/kernels.out" 2>&1 &&
        grep -q "FITLM_CUDA_GELU_FUSION=3: 0 (off), 1" "$work/kernels.out" && ok=1 ||
        ok=0
    check $ok "an unknown FITLM_CUDA_GELU_FUSION is refused by name, not run as the default"
fi
if [ -n "$need" ] && [ "$need" -gt 0 ]; then
    cap=$((need + held))
    "$fitlm" train "${flags[@]}" --out "$work/capped" --mem-limit "$cap" >"$work/capped.out" 2>&1 &&
        ok=1 || ok=0
    check $ok "a run at its planned $need device bytes and the device's own $held trains under --mem-limit $cap"
    ! "$fitlm" train "${flags[@]}" --out "$work/over" --mem-limit $((cap - 1)) >"$work/over.out" 2>&1 &&
        grep -q "device budget" "$work/over.out" && ok=1 || ok=0
    check $ok "one byte under them, the run is refused naming the device budget"
    # the plan's device bytes per tag are what the run allocated (its peaks)
    "$fitlm" train "${flags[@]}" --out "$work/measured" --mem-report >"$work/measured.out" 2>&1 || true
    same=$(awk '/^tag \(per rank\)/ { p = 1; next } p && NF >= 4 && $1 != "total" { plan[$1] = $3 }
        p && $1 == "total" { p = 0 }
        /^device memory by tag/ { m = 1; next } m && NF >= 4 && $1 != "total" { got[$1] = $4 }
        m && $1 == "total" { m = 0 }
        END { ok = 1; n = 0; for (t in plan) { n++; if ((t in got ? got[t] : 0) != plan[t]) ok = 0 } print ok && n }' \
        "$work/plan.out" "$work/measured.out")
    check "$same" "the plan's device bytes per tag are the run's measured peaks (the backend's scratch included)"
    # and its pinned host bytes per tag (the tokens, cuda's staged buckets)
    same=$(awk '/^of the host.s +pinned bytes/ { p = 1; next } p && NF == 2 && $1 != "total" { plan[$1] = $2 }
        p && ($1 == "total" || NF != 2) { p = 0 }
        /^of which pinned/ { m = 1; next } m && NF == 4 { got[$1] = $4 } m && NF != 4 { m = 0 }
        END { ok = 1; n = 0; for (t in plan) { n++; if (got[t] != plan[t]) ok = 0 }
              for (t in got) if (got[t] != 0 && !(t in plan)) ok = 0; print ok && n }' \
        "$work/plan.out" "$work/measured.out")
    check "$same" "the plan's pinned host bytes per tag are the run's measured peaks"
else
    check 0 "fitlm plan --device $dev prints the device bytes' total"
fi

# the fused step: LOMO with a global-norm clip (the two backward passes) and
# a clip by value, AdaLomo, AdamW from the backward pass
fused_flags=("--optimizer lomo --grad-clip 1 --clip-grad-value 0.5"
    "--optimizer adalomo --grad-clip 1"
    "--optimizer adamw --optimizer-in-backward --grad-clip 1")
fused_archs=(gpt2 llama)
fused_kinds=(0 1 2)
lora_kinds=(lora qlora lora_lomo)
if [ -n "${GPU_RUNS_QUICK:-}" ]; then
    fused_archs=(llama)
    fused_kinds=(0 1)
    lora_kinds=(qlora)
fi
for arch in "${fused_archs[@]}"; do
    for k in "${fused_kinds[@]}"; do
        read -r -a f <<<"${fused_flags[$k]}"
        run "fcpu_fp32_${arch}_$k" cpu "$arch" fp32 "${f[@]}"
        run "fcpu_bf16_${arch}_$k" cpu "$arch" bf16 "${f[@]}"
        run "fdev_fp32_${arch}_$k" "$dev" "$arch" fp32 "${f[@]}"
        run "fdev_bf16_${arch}_$k" "$dev" "$arch" bf16 "${f[@]}"
        run "fdev_bf16b_${arch}_$k" "$dev" "$arch" bf16 "${f[@]}"
        e=$(max_rel "fdev_fp32_${arch}_$k" "fcpu_fp32_${arch}_$k")
        le "$e" 1e-5 && ok=1 || ok=0
        check $ok "$arch fp32 ${fused_flags[$k]}: $dev losses within 1e-5 relative of the cpu's (max $e)"
        gap=$(max_rel "fcpu_bf16_${arch}_$k" "fcpu_fp32_${arch}_$k")
        bound=$(awk -v g="$gap" 'BEGIN { print (g + 0 > 1e-4 ? g : 1e-4) }')
        e=$(max_rel "fdev_bf16_${arch}_$k" "fcpu_bf16_${arch}_$k")
        le "$e" "$bound" && ok=1 || ok=0
        check $ok "$arch bf16 ${fused_flags[$k]}: $dev losses within the cpu's bf16-fp32 gap $bound (max $e)"
        cmp -s <(grep '^step' "$work/fdev_bf16_${arch}_$k/log.txt") \
            <(grep '^step' "$work/fdev_bf16b_${arch}_$k/log.txt") && ok=1 || ok=0
        check $ok "$arch bf16 ${fused_flags[$k]}: two $dev runs log the same values bit for bit"
    done
done

# LoRA and QLoRA (issue 46) on the LLaMA the cpu trained above, exported
# as a Hugging Face base: adapters (r 8, dropout 0.1) on the default
# targets, 10 steps; QLoRA's base in NF4 with double quantisation. fp32
# within 1e-5 relative of the cpu's losses, bf16 within the cpu's own
# bf16-fp32 gap for that run (at least 1e-4); two device runs and their
# PEFT adapters bitwise; a QLoRA resume at step 5 bitwise.
"$fitlm" export "$work/cpu_fp32_llama" -o "$work/base.hf" >/dev/null
lrun() { # lrun NAME DEVICE PRECISION [FLAGS...]: $steps steps into $work/NAME
    local name=$1 device=$2 prec=$3
    shift 3
    "$fitlm" train --device "$device" --init-from "$work/base.hf" --tokenizer byte \
        --data "$work/data" --batch "$batch" --seq-len 64 --steps "$steps" --warmup 2 --lr 1e-3 \
        --precision "$prec" --threads 2 --sample-tokens 0 --eval-every 0 --eval-iters 2 \
        --seed 1234 --peak-tflops 1 --lora --lora-dropout 0.1 --out "$work/$name" "$@" >"$work/$name.out" 2>&1 ||
        { echo "gpu_runs: fitlm train ($name) failed:"; tail -20 "$work/$name.out"; exit 1; }
}
for kind in "${lora_kinds[@]}"; do
    flags=()
    [ $kind = qlora ] && flags=(--quantize nf4 --double-quant)
    [ $kind = lora_lomo ] && flags=(--lora-base-optimizer lomo --grad-clip 1)
    lrun "cpu_fp32_$kind" cpu fp32 "${flags[@]}"
    lrun "cpu_bf16_$kind" cpu bf16 "${flags[@]}"
    lrun "dev_fp32_$kind" "$dev" fp32 "${flags[@]}"
    lrun "dev_bf16_$kind" "$dev" bf16 "${flags[@]}" --save-every "$half"
    lrun "dev_bf16b_$kind" "$dev" bf16 "${flags[@]}"

    e=$(max_rel "dev_fp32_$kind" "cpu_fp32_$kind")
    le "$e" 1e-5 && ok=1 || ok=0
    check $ok "$kind fp32: $dev losses within 1e-5 relative of the cpu's (max $e)"
    gap=$(max_rel "cpu_bf16_$kind" "cpu_fp32_$kind")
    bound=$(awk -v g="$gap" 'BEGIN { print (g + 0 > 1e-4 ? g : 1e-4) }')
    e=$(max_rel "dev_bf16_$kind" "cpu_bf16_$kind")
    le "$e" "$bound" && ok=1 || ok=0
    check $ok "$kind bf16: $dev losses within the cpu's bf16-fp32 gap $bound of the cpu's (max $e)"

    cmp -s <(grep '^step' "$work/dev_bf16_$kind/log.txt") \
        <(grep '^step' "$work/dev_bf16b_$kind/log.txt") &&
        cmp -s "$work/dev_bf16_$kind/adapter/adapter_model.safetensors" \
            "$work/dev_bf16b_$kind/adapter/adapter_model.safetensors" && ok=1 || ok=0
    check $ok "$kind: two $dev runs log the same values and write the same adapter bit for bit"

    resumed_equals "dev_bf16_$kind" "$kind: $resumed as the straight run"
done

# ZeRO-Offload: the optimizer in pinned host memory, updated by the cpu
printf '{"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}\n' \
    >"$work/offload.json"
# offloaded_equals RUN ALL_ON_DEVICE_RUN WHAT: the first step's loss bitwise
# (the same weights); every step within 1e-5 relative on cuda (the update is
# the cpu's AdamW, not the GPU's), bitwise on the test device and the cpu
offloaded_equals() {
    [ "$(losses "$2" | head -1)" = "$(losses "$1" | head -1)" ] && ok=1 || ok=0
    check $ok "$3 on $dev: the first step's loss bitwise the all-on-$dev run's"
    if [ "$dev" = cuda ]; then
        e=$(max_rel "$1" "$2")
        le "$e" 1e-5 && ok=1 || ok=0
        check $ok "$3 on $dev: losses within 1e-5 relative of all-on-$dev (max $e)"
    else
        cmp -s <(grep '^step' "$work/$1/log.txt") <(grep '^step' "$work/$2/log.txt") && ok=1 || ok=0
        check $ok "$3 on $dev: every step's loss and norm bitwise all-on-$dev's"
    fi
}
for prec in fp32 bf16; do
    run "dev_${prec}_off" "$dev" llama "$prec" --save-every "$half"
    run "off_${prec}" "$dev" llama "$prec" --save-every "$half" --config "$work/offload.json"
    offloaded_equals "off_$prec" "dev_${prec}_off" "llama $prec offloaded"
    resumed_equals "off_$prec" "llama $prec offloaded: $resumed" --config "$work/offload.json"
done
# LoRA and QLoRA under ZeRO-Offload (PEFT's recipe for one GPU): the
# adapters' optimizer in host memory, and a dense base's weights offloaded
# too (ZeRO-3, offload_param cpu, a ring of one unit): as the all-on-device
# LoRA run above, and resumed bit for bit
printf '{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}\n' \
    >"$work/lora_off.json"
printf '{"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}\n' \
    >"$work/lora_w3.json"
for kind in "${lora_kinds[@]}"; do
    [ $kind = lora_lomo ] && continue # (the base's update is in the backward pass)
    flags=() config=lora_w3.json
    [ $kind = qlora ] && flags=(--quantize nf4 --double-quant) config=lora_off.json
    lrun "off_bf16_$kind" "$dev" bf16 "${flags[@]}" --save-every "$half" --config "$work/$config"
    offloaded_equals "off_bf16_$kind" "dev_bf16_$kind" "$kind bf16 under $config"
    resumed_equals "off_bf16_$kind" "$kind bf16 under $config: $resumed" --config "$work/$config"
done
# NVMe under it: the same cpu update, paged from a file: bitwise the pinned run
mkdir -p "$work/nvme"
printf '{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "%s"}}}\n' \
    "$work/nvme" >"$work/nvme.json"
run off_nvme "$dev" llama bf16 --config "$work/nvme.json"
cmp -s <(grep '^step' "$work/off_nvme/log.txt") <(grep '^step' "$work/off_bf16/log.txt") &&
    ok=1 || ok=0
check $ok "llama bf16 offloaded to NVMe on $dev: every step bitwise the pinned-memory run's"

# Weight offload (ZeRO-3, offload_param cpu): the whole weights in the
# pinned host copy, each unit up ahead of use into a ring on the device (no
# persistent units): the same kernels on the same values as the stage-1
# offloaded run, so every step bitwise it, and its resume bit for bit
printf '{"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}\n' \
    >"$work/weights.json"
for prec in fp32 bf16; do
    run "woff_${prec}" "$dev" llama "$prec" --save-every "$half" --config "$work/weights.json"
    cmp -s <(grep '^step' "$work/woff_$prec/log.txt") <(grep '^step' "$work/off_$prec/log.txt") &&
        ok=1 || ok=0
    check $ok "llama $prec with weight offload on $dev: every step bitwise the stage-1 offloaded run's"
    resumed_equals "woff_$prec" "llama $prec with weight offload: $resumed" --config "$work/weights.json"
done

# Weight offload to NVMe (ZeRO-Infinity): the weights in the optimizer's
# NVMe file, each unit read through two pinned staging buffers of 4096
# elements (a unit in pieces) and up into a ring of one unit (no prefetch):
# the same values as the pinned weight offload, so every step bitwise its
# run and the resume bit for bit; the model is built in pinned host memory,
# so the device's peak of weights (--mem-report) is the plan's, under the
# whole model's
mkdir -p "$work/wnvme"
printf '{"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "nvme", "nvme_path": "%s"}, "offload_param": {"device": "nvme", "buffer_count": 2, "buffer_size": 4096}}}\n' \
    "$work/wnvme" >"$work/wnvme.json"
# the params row's bytes (last column) of a table whose header starts with $2, in file $1
params_bytes() { awk -v h="$2" 'index($0, h) == 1 { t = 1; next } t && $1 == "params" { print $NF; exit }' "$1"; }
for prec in fp32 bf16; do
    run "wnv_${prec}" "$dev" llama "$prec" --save-every "$half" --config "$work/wnvme.json" --mem-report
    cmp -s <(grep '^step' "$work/wnv_$prec/log.txt") <(grep '^step' "$work/woff_$prec/log.txt") &&
        ok=1 || ok=0
    check $ok "llama $prec with weight offload to NVMe on $dev: every step bitwise the pinned weight offload's"
    resumed_equals "wnv_$prec" "llama $prec with weight offload to NVMe: $resumed" --config "$work/wnvme.json"
    "$fitlm" plan --device "$dev" --model tiny --arch llama --tokenizer byte --data "$work/data" \
        --batch "$batch" --seq-len 64 --precision "$prec" --threads 2 --sample-tokens 0 \
        --config "$work/wnvme.json" >"$work/wnv_plan_$prec.out" 2>&1 || { tail -20 "$work/wnv_plan_$prec.out"; exit 1; }
    peak=$(params_bytes "$work/wnv_$prec.out" "device memory by tag")
    planned=$(awk 'index($0, "tag (per rank)") == 1 { t = 1; next } t && $1 == "params" { print $3; exit }' \
        "$work/wnv_plan_$prec.out")
    whole=$(params_bytes "$work/wnv_$prec.out" "of which pinned")
    [ -n "$peak" ] && [ "$peak" = "$planned" ] && [ "$peak" -lt "$whole" ] && ok=1 || ok=0
    check $ok "llama $prec with weight offload to NVMe on $dev: the device's peak of weights $peak bytes = the plan's ${planned:-?}, under the whole model's ${whole:-?}"
done

# the update during the backward pass (no clipping): bitwise the same run whose
# update waits for the whole gradient (a spike test on the norm that never fires)
run off_overlap "$dev" llama bf16 --grad-clip 0 --config "$work/offload.json"
grep -q "the cpu updates each unit during the last backward pass" "$work/off_overlap.out" &&
    ok=1 || ok=0
check $ok "llama bf16 offloaded on $dev with --grad-clip 0: the update overlaps the backward pass"
run off_wait "$dev" llama bf16 --grad-clip 0 --skip-update-gradz 1e6 --config "$work/offload.json"
cmp -s <(grep '^step' "$work/off_overlap/log.txt") <(grep '^step' "$work/off_wait/log.txt") &&
    ok=1 || ok=0
check $ok "llama bf16 offloaded on $dev: overlapped, every step bitwise the waiting update's"

# the share of the step the device waits on the cpu: every step of an
# offloaded run (overlapped or not) and the summary give one within [0, 100]
for r in off_bf16 off_overlap; do
    ok=$(awk -v steps="$steps" '$1 == "step" && $2 ~ /\// { n++; if (match($0, /waited on the cpu [0-9.]+%/)) {
            v = substr($0, RSTART + 18, RLENGTH - 19) + 0; if (v >= 0 && v <= 100) good++ } }
        /^ZeRO-Offload: the .* device waited on the cpu [0-9.]+% of the step/ { sum = 1 }
        END { print (n == steps && good == n && sum) ? 1 : 0 }' "$work/$r.out")
    check "$ok" "$r on $dev: each step and the summary give the share of the step the device waited on the cpu ($(grep -m1 '^ZeRO-Offload: the .* device waited' "$work/$r.out" | cut -c15-90))"
done

# The gradient ring: the device holds no whole gradient, each unit's going
# down to the pinned copy from a ring of two buffers and summed there over
# the micro-batches (fp32: the sum so far goes up into the unit's buffer and
# the backward adds to it, as the all-on-device run adds in place). With
# accumulation 3: the first step's loss bitwise the all-on-device run's
# (every step on the test device, within 1e-5 relative on a GPU), weight
# offload bitwise the stage-1 offloaded run, and the device's peak of
# gradients (--mem-report) the plan's and under the whole gradient's
grads_bytes() { awk -v h="$2" 'index($0, h) == 1 { t = 1; next } t && $1 == "grads" { print $NF; exit }' "$1"; }
for prec in fp32 bf16; do
    run "dev_${prec}_acc" "$dev" llama "$prec" --grad-accum 3
    run "offacc_${prec}" "$dev" llama "$prec" --grad-accum 3 --config "$work/offload.json" --mem-report
    run "woffacc_${prec}" "$dev" llama "$prec" --grad-accum 3 --config "$work/weights.json"
    offloaded_equals "offacc_$prec" "dev_${prec}_acc" "llama $prec offloaded with accumulation 3"
    cmp -s <(grep '^step' "$work/woffacc_$prec/log.txt") <(grep '^step' "$work/offacc_$prec/log.txt") &&
        ok=1 || ok=0
    check $ok "llama $prec with weight offload and accumulation 3 on $dev: every step bitwise the stage-1 offloaded run's"
    "$fitlm" plan --device "$dev" --model tiny --arch llama --tokenizer byte --data "$work/data" \
        --batch "$batch" --seq-len 64 --grad-accum 3 --precision "$prec" --threads 2 --sample-tokens 0 \
        --config "$work/offload.json" >"$work/offacc_plan_$prec.out" 2>&1 || { tail -20 "$work/offacc_plan_$prec.out"; exit 1; }
    peak=$(grads_bytes "$work/offacc_$prec.out" "device memory by tag")
    planned=$(awk 'index($0, "tag (per rank)") == 1 { t = 1; next } t && $1 == "grads" { print $3; exit }' \
        "$work/offacc_plan_$prec.out")
    whole=$(params_bytes "$work/offacc_$prec.out" "of which pinned") # the whole weights', the gradient's size
    [ -n "$peak" ] && [ "$peak" = "$planned" ] && [ "$peak" -lt "$whole" ] && ok=1 || ok=0
    check $ok "llama $prec offloaded on $dev: the device's peak of gradients $peak bytes = the plan's ${planned:-?} (the ring), under the whole gradient's ${whole:-?}"
done

# zero_equals NAME BASE PREC ZERO MESSAGE: llama PREC with accumulation 3
# under the zero_optimization block ZERO, every step bitwise run BASE's
zero_equals() {
    printf '{"zero_optimization": %s}\n' "$4" >"$work/$1.json"
    run "$1" "$dev" llama "$3" --grad-accum 3 --config "$work/$1.json"
    cmp -s <(grep '^step' "$work/$1/log.txt") <(grep '^step' "$work/$2/log.txt") && ok=1 || ok=0
    check $ok "$5"
}
# ZeRO's stages on one process (a single-GPU DeepSpeed config): the plain
# step; ZeRO-Offload with the state pinned too (pin_memory) the unpinned
# run's; the gradients' fp32 sum on the device (accumulate_on_device) the
# offloaded run that sums on the host (the same arithmetic, on the device:
# 16-bit gradients added into it, fp32 ones bound to it in place)
zero_equals zero2_bf16 dev_bf16_acc bf16 '{"stage": 2, "overlap_comm": true}' \
    "llama bf16 with ZeRO-2 on one process on $dev: every step bitwise the plain run's"
zero_equals offacc_pin offacc_bf16 bf16 '{"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": true}}' \
    "llama bf16 offloaded on $dev with pin_memory: every step bitwise the unpinned state's run"
if [ "$dev" != cpu ]; then
    for prec in fp32 bf16; do
        zero_equals "offacc_dev_$prec" "offacc_$prec" "$prec" '{"stage": 1, "offload_optimizer": {"device": "cpu", "accumulate_on_device": true}}' \
            "llama $prec offloaded with accumulation 3 on $dev, summed on the device: every step bitwise the host-summed run's"
    done
fi

# The delayed update (offload_optimizer.delayed_update after one update, the
# ZeRO-Offload paper's DPU; not on the cpu, which refuses it): fp32 with
# accumulation 2, every step's loss within 1e-5 relative of the same run on
# the test device (whose values test_device_offload checks against a cpu
# reference bitwise); the first two steps bitwise the undelayed offloaded
# run's and the third not (the first delayed update shows there); its
# resume bit for bit as its straight run
if [ "$dev" != cpu ]; then
    printf '{"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "delayed_update": true, "delayed_update_warmup": 1}}}\n' \
        >"$work/delayed.json"
    run dpu "$dev" llama fp32 --grad-accum 2 --save-every "$half" --config "$work/delayed.json"
    run dpu_test test llama fp32 --grad-accum 2 --save-every "$half" --config "$work/delayed.json"
    run dpu_off "$dev" llama fp32 --grad-accum 2 --config "$work/offload.json"
    grep -q "the cpu updates during the next step (delayed_update)" "$work/dpu.out" && ok=1 || ok=0
    check $ok "llama fp32 with the delayed update on $dev: the run says so"
    e=$(max_rel dpu dpu_test)
    le "$e" 1e-5 && ok=1 || ok=0
    check $ok "llama fp32 with the delayed update on $dev: losses within 1e-5 relative of the test device's (max $e)"
    [ "$(losses dpu | head -2)" = "$(losses dpu_off | head -2)" ] &&
        [ "$(losses dpu | sed -n 3p)" != "$(losses dpu_off | sed -n 3p)" ] && ok=1 || ok=0
    check $ok "llama fp32 with the delayed update on $dev: steps 1-2 bitwise the undelayed run's, step 3 not"
    resumed_equals dpu "llama fp32 with the delayed update: $resumed" --config "$work/delayed.json"
fi

[ $failed = 0 ] && echo "gpu_runs: all passed" || echo "gpu_runs: some checks FAILED"
exit $failed
