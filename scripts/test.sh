#!/usr/bin/env bash
# Quick start 2: set up the machine, check style (clang-format, cppcheck),
# build, and run every test: the release build, then the same suite built
# with AddressSanitizer and UBSan. Each phase prints its seconds (the
# suite's time per CPU class: docs/testing.md).
#   scripts/test.sh            both builds
#   scripts/test.sh release    the release build only
set -euo pipefail
cd "$(dirname "$0")/.."
t=$SECONDS
took() { echo "== $1: $((SECONDS - t)) s =="; t=$SECONDS; }
bash scripts/setup.sh
bash scripts/lint.sh
took "set-up and lint"
builds=("${1:-release}")
[[ $# -eq 0 ]] && builds=(release sanitize)
for b in "${builds[@]}"; do
    bash scripts/build.sh "$b"
    dir=build; [[ $b == sanitize ]] && dir=build-san
    FITLM=$dir/fitlm bash scripts/tokenize.sh # the data some tests train on
    took "$b build"
    echo "== tests: $b build =="
    # halt_on_error: a sanitizer report fails the test instead of scrolling by.
    # One test per core: most are one thread or wait on ranks and deadlines
    # much of the time; the long ones start first (COST, CMakeLists.txt).
    ASAN_OPTIONS=detect_leaks=1:halt_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
        ctest --test-dir "$dir" --output-on-failure -j "$(nproc)"
    took "tests, $b build"
done
echo "== all: $SECONDS s =="
