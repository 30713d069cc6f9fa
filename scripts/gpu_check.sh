#!/usr/bin/env bash
# scripts/gpu_check.sh OUTDIR [--memory [SHOWCASE...]]: everything the CUDA
# backend needs checked, in one call on a machine with one NVIDIA GPU (a
# device lease), in under 8 minutes (with --memory, steps 4 and 5 are
# instead bench/gpu_memory.sh's showcases named, default all: lomo, offload,
# lora; one per call keeps a call under 8 minutes). GPU_CHECK_SECONDS (450
# by default) is the call's time: the benchmark and the showcases get its
# end, less 10 s, as their deadline (BENCH_DEADLINE: a run starts only
# while enough is left, one the deadline cuts is "skipped: time (cut after
# N s)", not failed), and a `timeout` 5 s after it only guards against a
# script that overruns it:
#  1. facts: the GPU, driver, nvcc, cmake, the OS, and which of fitlm's C
#     libraries (cJSON, utf8proc, liburing, OpenBLAS-openmp, oneDNN, Open
#     MPI, cairo) the machine has;
#  2. what it lacks comes from .gpu-prefix/ (scripts/gpu_prefix.sh, run
#     beforehand on a Debian 12 machine, carried with the call): the .debs
#     unpacked into /tmp/fitlm_gpu_prefix (never into /) and pkg-config, CMake and
#     LD_LIBRARY_PATH pointed at it; no Open MPI: FITLM_MPI=OFF (one rank);
#     no cairo: FITLM_PLOT=OFF (no `fitlm plot`);
#  3. builds build-gpu (nvcc, arch 90a, -j16), and prints where each
#     library fitlm links loads from (ldd; one that does not load fails);
#  4. ctest -L gpu (mma: the tensor cores' fragment layouts mma.cuh
#     assumes; test_gpu: every kernel against the cpu; gpu_runs: whole
#     runs against the cpu); a test skipped fails the check, since
#     nvidia-smi showed a GPU (the CUDA runtime could not use it: why is in
#     ctest.log); where mma (the fragment layouts) fails, the benchmark
#     runs with FITLM_CUDA_ATTENTION=wmma;
#  5. bench/gpu.sh (fitlm beside PyTorch eager and torch.compile,
#     fitlm's GPT-2 124M step op by op, timed on the GPU, the attention
#     kernels alone beside PyTorch's scaled_dot_product_attention, and,
#     when time is left, under Nsight Compute);
#  6. OUTDIR/gpu_check.md and OUTDIR/gpu_check.json, and a short table last.
# Logs are tee'd into OUTDIR (check.log, build.log, ctest.log, bench.log,
# bench.tsv). Without a GPU, nvcc or cmake it says which and exits 1 after
# the facts (it never waits for one). Exits 0 when everything passed: the
# build, the tests, and every fitlm run of the benchmark (one skipped for
# time has not failed). The commit is
# git's, or where the copy is no git checkout, .gpu-prefix/commit's (the
# one gpu_prefix.sh ran at), said as such.
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
source "$src/bench/lib.sh" # table
exec > >(tee "$out/check.log") 2>&1
tee_pid=$!
# finish RC: exit RC once tee has ended (its input closed), so that
# check.log is whole when the caller collects OUTDIR; at most 5 s, in case
# a straggler of a run that timed out still holds the pipe
finish() {
    exec >&- 2>&-
    for _ in $(seq 50); do kill -0 "$tee_pid" 2>/dev/null || break; sleep 0.1; done
    exit "$1"
}
t0=$(date +%s)
elapsed() { echo $(($(date +%s) - t0)); }
# the call's seconds: 450 (under the lease's 8 minutes a call), or fewer
# where a lease has less left (GPU_CHECK_SECONDS; the benchmark's or the
# showcases' runs are what gives)
seconds=${GPU_CHECK_SECONDS:-450}
case $seconds in '' | *[!0-9]*)
    echo "gpu_check: GPU_CHECK_SECONDS=$seconds: a whole number of seconds"
    finish 2
    ;;
esac
# the benchmark's and the showcases' deadline (epoch seconds, their
# BENCH_DEADLINE): the call's end less 10 s, for the results and check.log's
# last lines
deadline=$((t0 + seconds - 10))
# guard: the outer timeout of bench/gpu.sh or gpu_memory.sh, 5 s after the
# deadline (at least 15 s: where the deadline has passed, the script only
# records its runs as skipped), a guard only: the scripts end by the
# deadline themselves
guard() { local g=$((deadline + 5 - $(date +%s))); echo $((g > 15 ? g : 15)); }
status=ok
note() { echo "gpu_check: $*"; }

# json STRING: STRING as a JSON string's contents (its \ and " escaped,
# control characters dropped)
json() { local v=${1//\\/\\\\}; v=${v//\"/\\\"}; printf '%s' "$v" | tr -d '\000-\037'; }

# ---- 1. facts
# the commit: the working tree that travels to a device machine need not be
# a git checkout (then git fails, or is missing), so gpu_prefix.sh's record
# of the commit it ran at stands in, said as such
commit=$(git rev-parse --short=12 HEAD 2>/dev/null) || commit=""
if [ -z "$commit" ]; then
    commit=unknown
    [ -s .gpu-prefix/commit ] && commit="unknown (no git checkout; .gpu-prefix made at $(head -1 .gpu-prefix/commit))"
fi
echo "== facts ($(date -u '+%Y-%m-%d %H:%M:%S UTC'), commit $commit)"
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
    printf '{"status": "%s", "gpu": "%s", "driver": "%s", "nvcc": "%s", "cmake": "%s", "os": "%s", "commit": "%s"}\n' \
        "$(json "$status")" "$(json "$gpu")" "$(json "$driver")" "$(json "$nvcc_v")" "$(json "$cmake_v")" \
        "$(json "$os")" "$(json "$commit")" >"$out/gpu_check.json"
    finish 1
}
[ "$gpu" != none ] || fail_early "no NVIDIA GPU on this machine: nothing to check"
[ -n "$nvcc" ] || fail_early "no nvcc (CUDA compiler): cannot build the CUDA backend"
[ "$cmake_v" != none ] || fail_early "no cmake"

# ---- 2. the private prefix for what the machine lacks
cmake_flags=()
needs_prefix=0 from_prefix="" without=""
for m in $missing; do
    case $m in
    OpenMPI) without="$without OpenMPI" ;; # built without it: no prefix
    cairo) without="$without cairo" ;;
    *) needs_prefix=1 from_prefix="$from_prefix $m" ;;
    esac
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
        else # a .deb is an ar archive holding data.tar.* (Debian's: xz)
            (cd "$root" && ar p "$f" "$(ar t "$f" | grep '^data.tar')" | tar -x -J -f -)
        fi || fail_early "could not unpack $f into $root"
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
    timeout 300 cmake --build build-gpu -j16 --target fitlm test_gpu test_mma bench_gpu_gemm bench_gpu_attention >>"$out/build.log" 2>&1; then
    build_ok=1
    grep -E '^-- (CUDA backend|Open MPI|FITLM_PLOT)' "$out/build.log"
    # where each library the binaries link loads from (the prefix's, the
    # machine's, the toolkit's), and none missing: a library that does not
    # load would fail every test and run below with exit 127
    if command -v ldd >/dev/null; then
        { echo "== ldd build-gpu/fitlm"; ldd build-gpu/fitlm; } >>"$out/build.log" 2>&1
        echo "libraries: $(ldd build-gpu/fitlm 2>/dev/null | awk '$2 == "=>" && $1 ~ /^lib(openblas|dnnl|cjson|utf8proc|uring|gomp|gfortran|quadmath|OpenCL|cudart|cublasLt)\./ {
            printf "%s%s %s", (n++ ? ", " : ""), $1, $3 }')"
        unloaded=$(ldd build-gpu/fitlm build-gpu/test_gpu build-gpu/bench_gpu_gemm 2>&1 | awk '/not found/ { print $1 }' |
            sort -u | xargs)
        if [ -n "$unloaded" ]; then
            build_ok=0
            status="failed: the build's binaries cannot load $unloaded"
            note "$status (see build.log)"
        fi
    fi
else
    status="failed: build"
    tail -30 "$out/build.log"
fi

# ---- 4. the GPU tests
ctest_summary="not run"
if [ $build_ok = 1 ] && [ -n "$memory" ]; then
    # the memory showcases instead of steps 4 and 5, by the deadline
    echo "== bench/gpu_memory.sh $memory ($(elapsed) s; $((deadline - $(date +%s))) s to the deadline)"
    BENCH_SHOWCASES="$memory" BENCH_DEADLINE=$deadline timeout "$(guard)" \
        bash bench/gpu_memory.sh build-gpu/fitlm "$out" | tail -16
    rc=${PIPESTATUS[0]} # the script's, not tail's: a failed run fails the check
    [ $rc = 0 ] || status="failed: bench/gpu_memory.sh (exit $rc$([ $rc = 124 ] && echo ': timed out'))"
    build_ok=memory
fi
if [ $build_ok = 1 ]; then
    echo "== ctest -L gpu ($(elapsed) s)"
    (cd build-gpu && timeout 300 ctest -L gpu --output-on-failure) >"$out/ctest.log" 2>&1
    rc=$?
    tail -40 "$out/ctest.log"
    ctest_summary=$(grep -E 'tests passed|tests failed' "$out/ctest.log" | tail -1)
    [ -n "$ctest_summary" ] || ctest_summary="ctest exit $rc"
    [ $rc = 0 ] || status="failed: ctest -L gpu"
    # a GPU test skips (exit 77) where the CUDA runtime finds no usable GPU
    # (no driver, or one too old for the runtime); here nvidia-smi showed
    # one, so a skip is a failure of the check, not a pass
    skipped=$(grep -c '(Skipped)' "$out/ctest.log")
    if [ "$skipped" != 0 ]; then
        ctest_summary="$ctest_summary, $skipped skipped"
        # why (--output-on-failure shows no skipped test's output; CTest's
        # own log holds it)
        grep -h 'skipped:' build-gpu/Testing/Temporary/LastTest*.log 2>/dev/null | sort -u | tee -a "$out/ctest.log"
        [ $rc != 0 ] || status="failed: ctest -L gpu skipped tests although nvidia-smi shows a GPU (see ctest.log)"
    fi
    # the mma.sync attention rests on the PTX fragment layouts test_mma
    # checks: where they fail on this GPU, the benchmark's runs take the
    # WMMA kernels instead, so that the lease still measures the rest
    if grep -qE 'Test +#[0-9]+: mma \.+ *\*\*\*(Failed|Exception|Timeout)' "$out/ctest.log"; then
        export FITLM_CUDA_ATTENTION=wmma
        status="$status; the mma layouts failed: bench/gpu.sh with FITLM_CUDA_ATTENTION=wmma"
    fi
fi

# ---- 5. the benchmark
if [ $build_ok = 1 ]; then
    # by the deadline: each run's timeout is its own cap or what is left
    # before it (bench_timeout in bench/lib.sh)
    echo "== bench/gpu.sh ($(elapsed) s; $((deadline - $(date +%s))) s to the deadline)"
    BENCH_DEADLINE=$deadline timeout "$(guard)" bash bench/gpu.sh build-gpu/fitlm "$out" |
        tail -16
    rc=${PIPESTATUS[0]} # a failed fitlm run fails the check (not after a failure above)
    [ $rc = 0 ] || [ "$status" != ok ] ||
        status="failed: bench/gpu.sh (exit $rc$([ $rc = 124 ] && echo ': timed out'))"
fi

# ---- 6. results
date_s=$(date -u '+%Y-%m-%d %H:%M UTC')
{
    echo "# gpu_check ($date_s)"
    echo
    echo "- GPU: $gpu ($gpu_mem), driver $driver; nvcc $nvcc_v; cmake $cmake_v; $os"
    echo "- C libraries found:${libs:- none}; from .gpu-prefix:${from_prefix:- none}; built without:${without:- none}"
    echo "- commit $commit; status: $status; ctest -L gpu: $ctest_summary"
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
    for f in "$out"/profile_*.md "$out"/attention.md; do
        [ -s "$f" ] && echo && sed 's/^# /## /' "$f"
    done
    if [ -s "$out/ncu_attention.txt" ]; then
        echo
        echo "## the attention kernels under Nsight Compute (excerpt of ncu_attention.txt)"
        echo
        echo '```'
        grep -E '^  [a-z_]+.*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per Thread|Occupancy|Shared Memory Per Block|^ncu' \
            "$out/ncu_attention.txt" | head -60
        echo '```'
    fi
} >"$out/gpu_check.md"
{
    printf '{"date": "%s", "commit": "%s", "status": "%s", "gpu": "%s", "gpu_memory": "%s", "driver": "%s", ' \
        "$date_s" "$(json "$commit")" "$(json "$status")" "$(json "$gpu")" "$(json "$gpu_mem")" "$(json "$driver")"
    printf '"nvcc": "%s", "cmake": "%s", "os": "%s", "libraries_found": "%s", "from_prefix": "%s", "built_without": "%s", ' \
        "$(json "$nvcc_v")" "$(json "$cmake_v")" "$(json "$os")" "$(json "${libs# }")" "$(json "${from_prefix# }")" \
        "$(json "${without# }")"
    printf '"ctest": "%s", "seconds": %s, "bench": [' "$(json "$ctest_summary")" "$(elapsed)"
    [ -s "$out/bench.tsv" ] && awk -F'\t' 'NR > 1 { for (i = 1; i <= NF; i++) gsub(/["\\]/, "\\\\&", $i)
        printf "%s{\"config\": \"%s\", \"engine\": \"%s\", \"B\": %s, \"T\": %s, \"tok_s\": \"%s\", \"ms_median\": \"%s\", \"mfu\": \"%s\", \"mfu_gemm\": \"%s\", \"peak_mib\": \"%s\", \"status\": \"%s\"}",
        (NR > 2 ? ", " : ""), $1, $2, $3, $4, $5, $6, $7, $8, $9, $10 }' "$out/bench.tsv"
    printf ']'
    # the memory showcases' rows (--memory), every field a string
    if [ -s "$out/memory.tsv" ]; then
        printf ', "memory": ['
        awk -F'\t' 'NR == 1 { for (i = 1; i <= NF; i++) h[i] = $i; next }
            { for (i = 1; i <= NF; i++) gsub(/["\\]/, "\\\\&", $i)
              printf "%s{", (NR > 2 ? ", " : "")
              for (i = 1; i <= NF; i++) printf "%s\"%s\": \"%s\"", (i > 1 ? ", " : ""), h[i], $i
              printf "}" }' "$out/memory.tsv"
        printf ']'
    fi
    printf '}\n'
} >"$out/gpu_check.json"

echo "== summary ($(elapsed) s): $gpu, driver $driver, nvcc $nvcc_v; $status; ctest -L gpu: $ctest_summary"
for f in "$out"/profile_*.md; do
    [ -s "$f" ] && head -16 "$f" # the step's largest ops (the whole table in gpu_check.md)
    [ -s "$f" ] && grep -m1 'host waited behind' "$f" # 1 a step: the verdict's read
done
[ -s "$out/attention.md" ] && tail -n +5 "$out/attention.md" # the attention kernels beside PyTorch's
[ -s "$out/bench.tsv" ] && table "$out/bench.tsv"
[ -s "$out/memory.tsv" ] && table "$out/memory.tsv"
[ "$status" = ok ] && finish 0
finish 1
