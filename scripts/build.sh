#!/usr/bin/env bash
# Configures and builds fitlm with CMake.
#   scripts/build.sh            release build in build/
#   scripts/build.sh sanitize   AddressSanitizer + UndefinedBehaviorSanitizer build in build-san/
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-release}" in
    release) dir=build; flags=(-DCMAKE_BUILD_TYPE=Release) ;;
    sanitize) dir=build-san; flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DFITLM_SANITIZE=ON) ;;
    *) echo "build: unknown build '$1' (release or sanitize)" >&2; exit 2 ;;
esac
cmake -S . -B "$dir" "${flags[@]}" -DFITLM_WERROR=ON >/dev/null
cmake --build "$dir" -j "$(nproc)"
