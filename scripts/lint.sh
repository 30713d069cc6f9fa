#!/usr/bin/env bash
# Style and static checks: clang-format (the committed .clang-format) and
# cppcheck. Exits non-zero on any finding.
set -euo pipefail
cd "$(dirname "$0")/.."
# the CUDA emulator's C++-only headers (NVIDIA's names) are checked as C++ below
emu_cxx_headers="tests/cuda_emu/mma.h tests/cuda_emu/fl_emu_ptx.h tests/cuda_emu/in_child.h tests/cuda_emu/cuda_bf16.h tests/cuda_emu/cuda_fp16.h"
files=$(git ls-files '*.c' '*.h' 2>/dev/null || find include src tests bench -name '*.[ch]')
files=$(printf '%s\n' $files | grep -v -x -F "$(printf '%s\n' $emu_cxx_headers)")
# the CUDA backend's kernels (src/cuda/*.cu, *.cuh) take the same format
cuda_files=$(git ls-files '*.cu' '*.cuh' 2>/dev/null || find src -name '*.cu' -o -name '*.cuh')
# the CUDA emulator's C++ (tests/cuda_emu/) too
emu_files=$(git ls-files 'tests/cuda_emu/*.cc' 'tests/cuda_emu/*.hpp' 2>/dev/null ||
    find tests/cuda_emu -name '*.cc' -o -name '*.hpp')
emu_files="$emu_files $emu_cxx_headers"
clang-format --dry-run --Werror $files $cuda_files $emu_files
# Findings that are false positives carry an inline cppcheck-suppress comment.
# One job per core; a build directory keeps the whole-program checks, which
# cppcheck 2.x skips under -j without one.
ckdir=$(mktemp -d)
trap 'rm -rf "$ckdir"' EXIT
cppcheck -j "$(nproc)" --cppcheck-build-dir="$ckdir" --enable=warning,performance,portability --std=c11 -Iinclude --quiet --error-exitcode=1 \
    --suppress=missingIncludeSystem --inline-suppr $files
cppcheck --enable=warning,performance,portability --std=c++17 --language=c++ --quiet \
    --error-exitcode=1 --suppress=missingIncludeSystem --inline-suppr -Itests/cuda_emu $emu_files
echo "lint: clang-format and cppcheck clean"
