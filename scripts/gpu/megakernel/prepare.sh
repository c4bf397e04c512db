#!/usr/bin/env bash
# Assembles the published megakernel (HazyResearch/Megakernels' low-latency Llama-1B demo) for a
# device call and builds it here, so that the device runs it beside Harrier's decode ring.
#   prepare.sh MEGAKERNELS_GIT THUNDERKITTENS_GIT OUT_DIR
# The two arguments are git directories holding the commits below (the `fetch` tool's mirrors:
# /work/.mirror/HazyResearch+Megakernels/repo, /work/.mirror/HazyResearch+ThunderKittens/repo).
# OUT_DIR (inside a carried, git-ignored folder such as .gpu-z/mk) gets MK/ and TK/ (the two
# trees at those commits), stub/pyutils/pyutils.cuh (this folder's ctypes shim, which stands in
# for ThunderKittens' pybind11 binding: no Python.h is needed, here or on the device),
# mkbench.py, libmk.so, and libmk_t.so (a timing build from MK_T/, a patched copy of MK/). nvcc
# comes from NVCC, else from the nvidia-cuda-nvcc 13.0 wheels (downloaded into /tmp/cu13 once;
# the device's driver runs CUDA 13.0).
set -euo pipefail
LIBS=
MK_COMMIT=7309cec801537b61fea3b50d7dfe454a6cde578e # Megakernels main, 2025-06-02
TK_COMMIT=664c108d16f12707a73d3072ab525f26fb2b4f62 # its ThunderKittens submodule
[ $# -eq 3 ] || { echo "usage: $0 MEGAKERNELS_GIT THUNDERKITTENS_GIT OUT_DIR" >&2; exit 2; }
HERE=$(cd "$(dirname "$0")" && pwd)
OUTD=$(mkdir -p "$3" && cd "$3" && pwd)
rm -rf "$OUTD/MK" "$OUTD/TK" && mkdir -p "$OUTD/MK" "$OUTD/TK" "$OUTD/stub/pyutils"
git -C "$1" archive "$MK_COMMIT" include demos/low-latency-llama megakernels | tar -x -C "$OUTD/MK"
git -C "$2" archive "$TK_COMMIT" include | tar -x -C "$OUTD/TK"
cp "$HERE/shim_pyutils.cuh" "$OUTD/stub/pyutils/pyutils.cuh"
cp "$HERE/mkbench.py" "$OUTD/"
if [ -z "${NVCC:-}" ]; then
    C=/tmp/cu13/nvidia/cu13
    if [ ! -x "$C/bin/nvcc" ]; then
        mkdir -p /tmp/cu13/whl
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d /tmp/cu13/whl \
            "nvidia-cuda-nvcc>=13.0,<13.1" "nvidia-cuda-runtime>=13.0,<13.1" \
            "nvidia-cuda-cccl>=13.0,<13.1" "nvidia-cuda-crt>=13.0,<13.1" "nvidia-nvvm>=13.0,<13.1"
        for w in /tmp/cu13/whl/*.whl; do unzip -qo "$w" -d /tmp/cu13; done
    fi
    NVCC=$C/bin/nvcc
    export PATH="$C/bin:$PATH"
    LIBS="-L$C/lib" # cudart_static, cudadevrt
fi
# The demo's Makefile flags for an H100 (sm_90a), less pybind11's; the driver API
# (cuTensorMapEncodeTiled) stays unlinked: mkbench.py loads libcuda.so.1 globally first.
build() { # MK_TREE OUT_LIB
    (cd "$1/demos/low-latency-llama" && "$NVCC" -x cu llama.cu -DNDEBUG -Xcompiler=-fPIE \
        --expt-extended-lambda --expt-relaxed-constexpr -Xcompiler=-Wno-psabi \
        -Xcompiler=-fno-strict-aliasing --use_fast_math -O3 -std=c++20 -Xptxas=--warn-on-spills \
        -lineinfo -I"$OUTD/stub" -I"$OUTD/TK/include" -I"$1/include" -DKITTENS_HOPPER \
        -gencode arch=compute_90a,code=sm_90a -shared -Xcompiler=-fPIC -o "$2" $LIBS ${MK_NVCC_FLAGS:-})
    echo "built $2"
}
build "$OUTD/MK" "$OUTD/libmk.so"
# A timing build (libmk_t.so): the demo's TIMING_RECORD_ENABLED on, its record() taking
# %globaltimer (one clock for every SM; the demo's clock64 differences have no common base).
rm -rf "$OUTD/MK_T" && cp -r "$OUTD/MK" "$OUTD/MK_T"
sed -i 's/TIMING_RECORD_ENABLED = false/TIMING_RECORD_ENABLED = true/' "$OUTD/MK_T/include/config.cuh"
python3 - "$OUTD/MK_T/include/util.cuh" <<'PY'
import sys
p = sys.argv[1]
s = open(p).read()
old = "uint64_t current = clock64();\n            int diff = (int)(current - start_clock);"
new = ('uint64_t current;\n            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(current));\n'
       "            int diff = (int)(unsigned)current;")
assert old in s, "record() not as expected"
open(p, "w").write(s.replace(old, new))
# Its timing reset runs a __syncwarp() that the controller reaches from lane 0 alone (the demo's
# Hopper build never enabled timings; the first try hung): one lane zeroes the row there.
p = p.replace("util.cuh", "controller/timings_store.cuh")
s = open(p).read()
old = "    __syncwarp();\n    for (int i = kittens::laneid(); i < config::TIMING_WIDTH; i += kittens::WARP_THREADS) {\n        timings[i] = 0;\n    }"
new = ("    if (__activemask() == 0xffffffffu) {\n        __syncwarp();\n"
       "        for (int i = kittens::laneid(); i < config::TIMING_WIDTH; i += kittens::WARP_THREADS) timings[i] = 0;\n"
       "    } else {\n        for (int i = 0; i < config::TIMING_WIDTH; i++) timings[i] = 0;\n    }")
assert old in s, "timings reset not as expected"
open(p, "w").write(s.replace(old, new))
PY
build "$OUTD/MK_T" "$OUTD/libmk_t.so"
