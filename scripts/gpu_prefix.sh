#!/usr/bin/env bash
# scripts/gpu_prefix.sh: run HERE (a Debian 12 machine with apt), before a
# GPU lease: fills .gpu-prefix/ (git-ignored) with what scripts/gpu_check.sh
# needs on a GPU machine whose image may lack fitlm's C libraries and has no
# package registry:
#   .gpu-prefix/debs/       Debian 12's packages of cJSON, utf8proc, liburing,
#                           OpenBLAS (OpenMP flavour), oneDNN, pkg-config and
#                           the libraries those link (libgomp, libgfortran,
#                           libquadmath, the OpenCL loader), as downloaded (apt-get download: they
#                           are not installed here); gpu_check.sh unpacks
#                           there (dpkg-deb -x, never into /) only the ones
#                           whose libraries the machine lacks
#   .gpu-prefix/data/gpt2/  GPT-2's encoder.json and vocab.bpe, and
#   .gpu-prefix/data/llama/ LLaMA-2's tokenizer.json (data/gpt2 and data/llama
#                           are links that do not travel), for the benchmark's
#                           shards
#   .gpu-prefix/commit      the commit this ran at (git describe, -dirty
#                           with changes), which gpu_check.sh reports where
#                           the travelling copy is no git checkout
# The packages travel compressed (about 21 MiB): unpacked they take 140 MiB
# (OpenBLAS's static and LAPACK libraries 98, oneDNN 38), over the device
# tool's 64 MiB carry. Carry it with: run(carry: [".gpu-prefix"], ...).
# Then checks that the unpacked prefix holds every library and .pc file the
# build asks for, and prints the prefix's size.
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=.gpu-prefix
pkgs=(libcjson-dev libcjson1 libutf8proc-dev libutf8proc2 liburing-dev liburing2
    libopenblas-openmp-dev libopenblas0-openmp libopenblas-dev libdnnl-dev libdnnl2 libgomp1
    libgfortran5 libquadmath0 ocl-icd-libopencl1 pkgconf pkgconf-bin libpkgconf3)
. /etc/os-release
[ "${VERSION_CODENAME:-}" = bookworm ] ||
    { echo "gpu_prefix: needs Debian 12 (bookworm), this is ${PRETTY_NAME:-unknown}" >&2; exit 1; }
rm -rf "$prefix/debs"
mkdir -p "$prefix/debs" "$prefix/data/gpt2" "$prefix/data/llama"
(cd "$prefix/debs" && apt-get download "${pkgs[@]}" 2>&1 | grep -v '^W: Download is performed unsandboxed')
git describe --always --dirty --abbrev=12 >"$prefix/commit" 2>/dev/null || echo unknown >"$prefix/commit"
for f in gpt2/encoder.json gpt2/vocab.bpe llama/tokenizer.json; do
    [ -s "data/$f" ] || { echo "gpu_prefix: data/$f is missing" >&2; exit 1; }
    cp -L "data/$f" "$prefix/data/$f"
done

# the check: unpack into a scratch root and look for what CMake needs
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
for f in "$prefix"/debs/*.deb; do dpkg-deb -x "$f" "$root"; done
lib=$root/usr/lib/x86_64-linux-gnu
export PKG_CONFIG_LIBDIR=$lib/pkgconfig PKG_CONFIG_SYSROOT_DIR=$root
for m in libcjson libutf8proc liburing; do
    pkg-config --exists "$m" || { echo "gpu_prefix: $m.pc missing from the packages" >&2; exit 1; }
done
for f in "$lib/openblas-openmp/libopenblas.so" "$lib/libdnnl.so" "$lib/libgomp.so.1" \
    "$root/usr/include/x86_64-linux-gnu/openblas-openmp/cblas.h" "$root/usr/include/oneapi/dnnl/dnnl.h" \
    "$root/usr/bin/pkg-config"; do
    [ -e "$f" ] || { echo "gpu_prefix: $f missing from the packages" >&2; exit 1; }
done
echo "gpu_prefix: $(ls "$prefix"/debs | wc -l) packages, $(du -sh "$prefix" | cut -f1) in $prefix" \
    "(unpacked: $(du -sh "$root" | cut -f1))"
