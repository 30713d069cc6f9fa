#!/usr/bin/env bash
# Quick start 1: set up the machine, build, and run the default training demo
# (a small GPT-2 on the Brown corpus in GPT-2 tokens; a checkpoint in out/ and
# a text sample). A re-run starts the demo over (--overwrite: out/ is replaced
# as the new run saves; the previous run is never resumed by accident).
# Extra arguments go to `fitlm train`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh release
bash scripts/tokenize.sh
exec ./build/fitlm train --overwrite "$@"
