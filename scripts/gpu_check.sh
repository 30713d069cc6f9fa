#!/usr/bin/env bash
# scripts/gpu_check.sh OUTDIR [--memory [SHOWCASE...]]: everything the CUDA
# backend needs checked, in one call on a machine with one NVIDIA GPU (a
# device lease), in under 8 minutes (with --memory, steps 4 and 5 are
# instead bench/gpu_memory.sh's showcases named, default all: lomo, offload,
# lora; one per call keeps a call under 8 minutes):
#  1. facts: the GPU, driver, nvcc, cmake, the OS, and which of fitlm's C
#     libraries (cJSON, utf8proc, liburing, OpenBLAS-openmp, oneDNN, Open
#     MPI, cairo) the machine has;
#  2. what it lacks comes from .gpu-prefix/ (scripts/gpu_prefix.sh, run
#     beforehand on a Debian 12 machine, carried with the call): the .debs
#     unpacked into /tmp/fitlm_gpu_prefix (never into /) and pkg-config, CMake and
#     LD_LIBRARY_PATH pointed at it; no Open MPI: FITLM_MPI=OFF (one rank);
#     no cairo: FITLM_PLOT=OFF (no `fitlm plot`);
#  3. builds build-gpu (nvcc, arch 90a, -j16);
#  4. ctest -L gpu (test_gpu: every kernel against the cpu; gpu_runs: whole
#     runs against the cpu);
#  5. bench/gpu.sh (fitlm beside PyTorch eager and torch.compile, and
#     fitlm's GPT-2 124M step op by op, timed on the GPU);
#  6. OUTDIR/gpu_check.md and OUTDIR/gpu_check.json, and a short table last.
# Logs are tee'd into OUTDIR (check.log, build.log, ctest.log, bench.log,
# bench.tsv). Without a GPU, nvcc or cmake it says which and exits 1 after
# the facts (it never waits for one).
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUTDIR [--memory [SHOWCASE...]]}
memory=""
if [ "${2:-}" = --memory ]; then
    shift 2
    memory=${*:-lomo offload lora}
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
src=$(pwd)
exec > >(tee "$out/check.log") 2>&1
t0=$(date +%s)
elapsed() { echo $(($(date +%s) - t0)); }
status=ok
note() { echo "gpu_check: $*"; }

# ---- 1. facts
echo "== facts ($(date -u '+%Y-%m-%d %H:%M:%S UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown))"
gpu=none driver=none gpu_mem=none
if command -v nvidia-smi >/dev/null && timeout 30 nvidia-smi -L >/dev/null 2>&1; then
    timeout 30 nvidia-smi
    IFS=, read -r gpu driver gpu_mem < <(timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total \
        --format=csv,noheader | head -1)
    gpu=$(echo "$gpu" | xargs) driver=$(echo "$driver" | xargs) gpu_mem=$(echo "$gpu_mem" | xargs)
else
    note "no NVIDIA GPU: nvidia-smi $(command -v nvidia-smi >/dev/null && echo finds none || echo is missing)"
fi
nvcc=$(command -v nvcc || { [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc; } || true)
nvcc_v=none cmake_v=none
[ -n "$nvcc" ] && nvcc_v=$("$nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p') && "$nvcc" --version | tail -2
command -v cmake >/dev/null && cmake_v=$(cmake --version | sed -n 's/cmake version //p' | head -1)
echo "nvcc: $nvcc_v ($nvcc)  cmake: $cmake_v  cc: $(cc --version 2>/dev/null | head -1)"
os=$(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME")
echo "os: $os"

# has LIB HEADER: the shared library (in ldconfig's cache or the
# multiarch directory) and its header ("-": none to look for)
has() {
    { ldconfig -p 2>/dev/null | grep -q "/$1" || [ -e "/usr/lib/x86_64-linux-gnu/$1" ]; } &&
        { [ "$2" = - ] || [ -e "$2" ]; }
}
libs="" missing=""
for spec in "cJSON libcjson.so /usr/include/cjson/cJSON.h" "utf8proc libutf8proc.so /usr/include/utf8proc.h" \
    "liburing liburing.so /usr/include/liburing.h" \
    "OpenBLAS-openmp openblas-openmp/libopenblas.so /usr/include/x86_64-linux-gnu/openblas-openmp/cblas.h" \
    "oneDNN libdnnl.so /usr/include/oneapi/dnnl/dnnl.h" \
    "OpenMPI libmpi.so /usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h" \
    "cairo libcairo.so /usr/include/cairo/cairo.h" "pkg-config - -"; do
    set -- $spec
    if [ "$1" = pkg-config ]; then
        command -v pkg-config >/dev/null && ok=1 || ok=0
    else
        has "$2" "$3" && ok=1 || ok=0
    fi
    if [ $ok = 1 ]; then libs="$libs $1"; else missing="$missing $1"; fi
done
echo "C libraries found:${libs:- none}; missing:${missing:- none}"

fail_early() {
    note "$1"
    status="failed: $1"
    printf '# gpu_check\n\n%s\n\nGPU: %s, driver %s; nvcc %s; cmake %s; %s\nlibraries found:%s; missing:%s\n' \
        "$status" "$gpu" "$driver" "$nvcc_v" "$cmake_v" "$os" "$libs" "$missing" >"$out/gpu_check.md"
    printf '{"status": "%s", "gpu": "%s", "driver": "%s", "nvcc": "%s", "cmake": "%s", "os": "%s"}\n' \
        "$status" "$gpu" "$driver" "$nvcc_v" "$cmake_v" "$os" >"$out/gpu_check.json"
    exit 1
}
[ "$gpu" != none ] || fail_early "no NVIDIA GPU on this machine: nothing to check"
[ -n "$nvcc" ] || fail_early "no nvcc (CUDA compiler): cannot build the CUDA backend"
[ "$cmake_v" != none ] || fail_early "no cmake"

# ---- 2. the private prefix for what the machine lacks
cmake_flags=()
needs_prefix=0
for m in cJSON utf8proc liburing OpenBLAS-openmp oneDNN pkg-config; do
    case " $missing " in *" $m "*) needs_prefix=1 ;; esac
done
if [ $needs_prefix = 1 ]; then
    root=${TMPDIR:-/tmp}/fitlm_gpu_prefix # not under .gpu-prefix: it would travel
    ls "$src"/.gpu-prefix/debs/*.deb >/dev/null 2>&1 ||
        fail_early "missing libraries ($missing) and no .gpu-prefix/debs: run scripts/gpu_prefix.sh here first and carry .gpu-prefix"
    rm -rf "$root" && mkdir -p "$root"
    # the packages of what is missing, and of the libraries those link that
    # the machine lacks (a newer libgomp of its own compiler stays in use)
    debs=()
    for m in $missing; do
        case $m in
        cJSON) debs+=(libcjson1 libcjson-dev) ;;
        utf8proc) debs+=(libutf8proc2 libutf8proc-dev) ;;
        liburing) debs+=(liburing2 liburing-dev) ;;
        OpenBLAS-openmp) debs+=(libopenblas0-openmp libopenblas-openmp-dev libopenblas-dev) ;;
        oneDNN) debs+=(libdnnl2 libdnnl-dev) ;;
        pkg-config) debs+=(pkgconf pkgconf-bin libpkgconf3) ;;
        esac
    done
    for dep in "libgomp.so.1 libgomp1" "libgfortran.so.5 libgfortran5" "libquadmath.so.0 libquadmath0" \
        "libOpenCL.so.1 ocl-icd-libopencl1"; do
        set -- $dep
        has "$1" - || debs+=("$2")
    done
    for d in "${debs[@]}"; do
        f=$(ls "$src"/.gpu-prefix/debs/"${d}"_*.deb 2>/dev/null | head -1)
        [ -n "$f" ] || fail_early "$d's package is not in .gpu-prefix/debs: rerun scripts/gpu_prefix.sh"
        if command -v dpkg-deb >/dev/null; then
            dpkg-deb -x "$f" "$root"
        else # a .deb is an ar archive holding data.tar.*
            (cd "$root" && ar p "$f" "$(ar t "$f" | grep '^data.tar')" | tar -x -J -f -)
        fi
    done
    lib=$root/usr/lib/x86_64-linux-gnu
    # the .pc files name /usr: point them at the prefix
    find "$root" -name '*.pc' -exec sed -i "s|=/usr|=$root/usr|g" {} +
    export PKG_CONFIG_PATH="$lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
    export LD_LIBRARY_PATH="$lib:$lib/openblas-openmp${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    command -v pkg-config >/dev/null || export PATH="$root/usr/bin:$PATH"
    # find_path/find_library (OpenBLAS, oneDNN) search under the prefix too
    cmake_flags+=(-DCMAKE_FIND_ROOT_PATH="$root")
    note "unpacked ${debs[*]} into $root ($(du -sh "$root" | cut -f1))"
fi
case " $missing " in *" OpenMPI "*) cmake_flags+=(-DFITLM_MPI=OFF) ;; esac
case " $missing " in *" cairo "*) cmake_flags+=(-DFITLM_PLOT=OFF) ;; esac

# ---- 3. build
echo "== build ($(elapsed) s)"
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
build_ok=0
if timeout 300 cmake -S . -B build-gpu "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DFITLM_CUDA=ON \
    -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES=90a "${cmake_flags[@]}" >"$out/build.log" 2>&1 &&
    timeout 300 cmake --build build-gpu -j16 --target fitlm test_gpu bench_gpu_gemm >>"$out/build.log" 2>&1; then
    build_ok=1
    grep -E '^-- .*(CUDA|cuBLAS)' "$out/build.log" | head -5
else
    status="failed: build"
    tail -30 "$out/build.log"
fi

# ---- 4. the GPU tests
ctest_summary="not run"
if [ $build_ok = 1 ] && [ -n "$memory" ]; then
    # the memory showcases instead of steps 4 and 5, in what is left of 450 s
    left=$((450 - $(elapsed)))
    [ $left -ge 60 ] || left=60
    echo "== bench/gpu_memory.sh $memory ($(elapsed) s; ${left} s left)"
    BENCH_SHOWCASES="$memory" BENCH_BUDGET=$((left > 200 ? left - 160 : 40)) timeout $left \
        bash bench/gpu_memory.sh build-gpu/fitlm "$out" | tail -16
    build_ok=memory
fi
if [ $build_ok = 1 ]; then
    echo "== ctest -L gpu ($(elapsed) s)"
    (cd build-gpu && timeout 300 ctest -L gpu --output-on-failure --timeout 120) >"$out/ctest.log" 2>&1
    rc=$?
    tail -40 "$out/ctest.log"
    ctest_summary=$(grep -E 'tests passed|tests failed' "$out/ctest.log" | tail -1)
    [ -n "$ctest_summary" ] || ctest_summary="ctest exit $rc"
    [ $rc = 0 ] || status="failed: ctest -L gpu"
fi

# ---- 5. the benchmark
if [ $build_ok = 1 ]; then
    # what is left of 450 s: new runs start until 160 s before its end (a
    # run takes at most 150), so the script ends inside its 8 minutes
    left=$((450 - $(elapsed)))
    [ $left -ge 60 ] || left=60
    echo "== bench/gpu.sh ($(elapsed) s; ${left} s left)"
    BENCH_BUDGET=$((left > 200 ? left - 160 : 40)) timeout $left bash bench/gpu.sh build-gpu/fitlm "$out" |
        tail -16
fi

# ---- 6. results
date_s=$(date -u '+%Y-%m-%d %H:%M UTC')
{
    echo "# gpu_check ($date_s)"
    echo
    echo "- GPU: $gpu ($gpu_mem), driver $driver; nvcc $nvcc_v; cmake $cmake_v; $os"
    echo "- C libraries found:${libs:- none}; from .gpu-prefix:${missing:- none}"
    echo "- commit $(git rev-parse --short HEAD 2>/dev/null); status: $status; ctest -L gpu: $ctest_summary"
    echo "- total $(elapsed) s"
    if [ -s "$out/memory.tsv" ]; then
        echo
        echo "memory techniques, --mem-limit 24GiB (bench/gpu_memory.sh)"
        echo
        awk -F'\t' '{ s = "|"; for (i = 1; i <= NF; i++) s = s " " $i " |"; print s }
                    NR == 1 { s = "|"; for (i = 1; i <= NF; i++) s = s "---|"; print s }' "$out/memory.tsv"
    fi
    if [ -s "$out/bench.tsv" ]; then
        echo
        echo "bf16 AdamW, T 1024: tokens/s (median), MFU of 989 TFLOP/s and of the best cuBLASLt rate on the config's GEMMs, peak device MiB"
        echo
        awk -F'\t' 'NR == 1 { print "| " $1 " | " $2 " | " $3 " | " $5 " | " $6 " | " $7 " | " $8 " | " $9 " | " $10 " |";
                              print "|---|---|---|---|---|---|---|---|---|"; next }
                    { print "| " $1 " | " $2 " | " $3 " | " $5 " | " $6 " | " $7 " | " $8 " | " $9 " | " $10 " |" }' "$out/bench.tsv"
    fi
    for f in "$out"/profile_*.md; do
        [ -s "$f" ] && echo && sed 's/^# /## /' "$f"
    done
} >"$out/gpu_check.md"
{
    printf '{"date": "%s", "status": "%s", "gpu": "%s", "gpu_memory": "%s", "driver": "%s", ' \
        "$date_s" "$status" "$gpu" "$gpu_mem" "$driver"
    printf '"nvcc": "%s", "cmake": "%s", "os": "%s", "libraries_found": "%s", "from_prefix": "%s", ' \
        "$nvcc_v" "$cmake_v" "$os" "${libs# }" "${missing# }"
    printf '"ctest": "%s", "seconds": %s, "bench": [' "$ctest_summary" "$(elapsed)"
    [ -s "$out/bench.tsv" ] && awk -F'\t' 'NR > 1 { printf "%s{\"config\": \"%s\", \"engine\": \"%s\", \"B\": %s, \"T\": %s, \"tok_s\": \"%s\", \"ms_median\": \"%s\", \"mfu\": \"%s\", \"mfu_gemm\": \"%s\", \"peak_mib\": \"%s\", \"status\": \"%s\"}",
        (NR > 2 ? ", " : ""), $1, $2, $3, $4, $5, $6, $7, $8, $9, $10 }' "$out/bench.tsv"
    printf ']}\n'
} >"$out/gpu_check.json"

echo "== summary ($(elapsed) s): $gpu, driver $driver, nvcc $nvcc_v; $status; ctest -L gpu: $ctest_summary"
for f in "$out"/profile_*.md; do
    [ -s "$f" ] && head -16 "$f" # the step's largest ops (the whole table in gpu_check.md)
done
[ -s "$out/bench.tsv" ] && column -t -s $'\t' "$out/bench.tsv"
[ -s "$out/memory.tsv" ] && column -t -s $'\t' "$out/memory.tsv"
[ "$status" = ok ]
