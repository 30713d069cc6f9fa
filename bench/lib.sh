# bench/lib.sh: what the benchmark scripts share (sourced, not run): building
# fitlm, the CPU they ran on, and reading fitlm's reports.
#   BUILD, LOG, NO_BUILD=1 as the scripts document them.

# Builds the fitlm target in $BUILD (Release) unless NO_BUILD=1; sets FITLM.
bench_build() {
    if [[ ${NO_BUILD:-0} != 1 ]]; then
        cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null
        cmake --build "$BUILD" -j "$(nproc)" --target fitlm >"$LOG/build.log" 2>&1 ||
            { cat "$LOG/build.log"; exit 1; }
    fi
    FITLM=$BUILD/fitlm
}

# The CPU model and the ISA extensions that choose fitlm's kernels.
bench_cpu() {
    local cpu isa
    cpu=$(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo)
    isa=$(grep -o -w -E 'avx512_bf16|amx_bf16|avx512f|avx2|fma' /proc/cpuinfo | sort -u | tr '\n' ' ')
    echo "CPU: $cpu; ISA: $isa"
}

# tag_peak TAG LOG: the peak (MiB) of TAG in a --mem-report ("total": the peak
# of the tagged total)
tag_peak() {
    awk -v t="$1" '$0 ~ /^memory by tag/ { on = 1 }
        on && $1 == t { v = t == "total" ? $4 : $3 } END { print v + 0 }' "$2"
}

# plan_bytes TAG PLAN: the bytes of TAG in `fitlm plan`'s table
plan_bytes() {
    awk -v t="$1" '$1 == t { print $2; exit }' "$2"
}

# median_min_max: "median min max" of the numbers on stdin, one a line
median_min_max() {
    sort -g | awk '{ v[NR] = $1 } END { if (!NR) { print "- - -"; exit }
        m = NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; print m, v[1], v[NR] }'
}
