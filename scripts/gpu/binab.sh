#!/usr/bin/env bash
# Two builds side by side (old and new kernels in one device call; a structural kernel change
# has no switch): source it from a device command, then call B per measurement.
#   carry .gpu-z/{harrier,harrier-cuda-tool,harrier-cuda-tool-old}.xz (xz -6 of the stripped
#   binaries: three fit the 64 MiB carry beside the tree, gzip does not), the old tool built
#   at the baseline commit;
#   B LABEL TOOL MODEL BATCHES MODES [ARGS]: harrier-cuda-tool bench (context 512, 64 steps,
#   fused path up to $FUSED_ROWS rows, default 16 as the engine's; sessions 11-38 ran 8, session
#   39 passed --fused-max-rows 16 in ARGS, which may still override it) of generated MODEL, one
#   compact line per batch and mode (also
#   appended to $OUT/ab2.log); TOOL is $OLD or $NEW; el NAME prints the seconds so far.
#   K LABEL CUBIN MODEL BATCHES [ARGS]: the same with the new tool on a kernel image that
#   scripts/gpu/pack.sh built here (below); O LABEL MODEL BATCHES [ARGS]: the old tool on
#   its own kernels.
# Example (session 12):
#   . scripts/gpu/binab.sh; gen llama-3.2-1b
#   for r in 1 2; do B old $OLD llama-3.2-1b 1,8 graph-async; B new $NEW llama-3.2-1b 1,8 graph-async; done
# Example (session 49; `scripts/gpu/pack.sh nodep=-DRING_NO_DEP` here, carry [".gpu-z"]):
#   . scripts/gpu/binab.sh; gen llama-3.2-1b
#   for r in 1 2 3; do K def new llama-3.2-1b 1; K nodep nodep llama-3.2-1b 1; done
# Every carried file: the binaries (the old build is optional: switches need one) and
# scripts/gpu/pack.sh's kernel images, if any.
mkdir -p .gpu && for z in .gpu-z/*.xz; do
    if [ -f "$z" ]; then xz -dc "$z" >".gpu/$(basename "$z" .xz)"; fi
done
chmod +x .gpu/harrier*
OUT="${OUT:-/tmp/harrier-binab-out}"
W=/tmp/harrier-latency-work
export OUT
. scripts/gpu/common.sh
NEW=.gpu/harrier-cuda-tool
OLD=.gpu/harrier-cuda-tool-old
S=$(date +%s)
B() {
    local l=$1 t=$2 m=$3 b=$4 md=$5
    shift 5
    timeout 300 "$t" bench --model "$W/$m" --batches "$b" --context 512 --steps 64 --modes "$md" --prefill-seqs 1 \
        --prefill-len 16 --fused-max-rows "${FUSED_ROWS:-16}" "$@" 2>&1 | grep -E "^decode|Error" \
        | sed -E "s/^decode batch +/$l b/; s/ms\/step wall, GPU.*tok\/s, floor +/floor /; s/graph kernels/k/" \
        | tee -a "$OUT/ab2.log"
}
el() { echo "-- $1 $(($(date +%s) - S))s"; }
# K LABEL CUBIN MODEL BATCHES [ARGS]: B with the new tool in graph-async mode on the kernels of
# .gpu/CUBIN.cubin (HARRIER_KERNEL_IMAGE; pack.sh's "new" is the source's default kernels), so
# variants of one build run side by side with no NVRTC minute each; environment variables set
# before K reach the tool (e.g. HARRIER_RING_DEPTH_MLP=3 K mlp3 new llama-3.2-1b 1).
K() {
    local l=$1 c=$2 m=$3 b=$4
    shift 4
    HARRIER_KERNEL_IMAGE=".gpu/$c.cubin" B "$l" "$NEW" "$m" "$b" graph-async "$@"
}
# O LABEL MODEL BATCHES [ARGS]: B with the old tool (pack.sh's OLD=REV) in graph-async mode on
# REV's own kernels (.gpu/old.cubin where pack.sh built it, else the tool's NVRTC compile).
O() {
    local l=$1 m=$2 b=$3
    shift 3
    if [ -f .gpu/old.cubin ]; then
        HARRIER_KERNEL_IMAGE=.gpu/old.cubin B "$l" "$OLD" "$m" "$b" graph-async "$@"
    else
        B "$l" "$OLD" "$m" "$b" graph-async "$@"
    fi
}
