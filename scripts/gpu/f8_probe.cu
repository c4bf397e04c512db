// The FP8 ring's consumer alone, two ways (scripts/gpu/f8_probe.py; docs/cuda.md, "FP8 in the
// ring"): how long 16 consumer warps of one block take to reduce a 32 KB slot of e4m3 weights
// against a batch-1 input that shared memory already holds, with no stream and no waits.
// `f8_probe.py --build` appends this file to kernels/cuda/harrier.cu and builds the whole for
// sm_90a (wgmma), so "mma" runs the ring's own `ring_f8_dot`. Each block loops `iters` times
// over two resident slots (the address changes, so nothing is hoisted) and writes its sums;
// every block does the same work.
#define PROBE_SLOT 32768

// Mode "mma" (the ring's FP8 GEMV today, `ring_f8_dot`): a slot is 32 units of 1,024 weights (rows of 2,048:
// unit u against input half u % 2); warp w reduces units 2w and 2w + 1 each pass.
// w: one slot (copied twice); xh: the input's 2 x 1,024 f16 in the kernel's read order
// (4 KB); out[block * 32 + unit]: the unit's sum over the passes.
extern "C" __global__ void __launch_bounds__(512, 1) probe_mma(const uint4* w, const uint4* xh, float* out, int iters) {
    extern __shared__ __align__(128) uint4 sm[];
    uint4* slots = sm;                    // 2 x PROBE_SLOT bytes
    uint4* xs = sm + 2 * PROBE_SLOT / 16;       // 4 KB
    for (int i = threadIdx.x; i < PROBE_SLOT / 16; i += blockDim.x) slots[i] = slots[PROBE_SLOT / 16 + i] = w[i];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) xs[i] = xh[i];
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float acc[2] = {0.0f, 0.0f};
    for (int p = 0; p < iters; p++) {
        const uint4* s = slots + (p & 1) * (PROBE_SLOT / 16);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int u = 2 * warp + h;
            acc[h] += ring_f8_dot(s + u * 64, xs + (u & 1) * 128, lane);
        }
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[h] += __shfl_xor_sync(0xffffffffu, acc[h], o);
        if (lane == 0) out[blockIdx.x * 32 + 2 * warp + h] = acc[h];
    }
}

// Mode "wgmma": a slot is 64 rows x 512 k as 16 k-tiles of 2 KB, tile t's core matrix (mb, kb)
// (rows 8 mb.., k 32 t + 16 kb..: 8 rows of 16 bytes) at 2048 t + 256 mb + 128 kb; the input B
// (n = 8, column 0 the input, the rest zero) as 16 tiles of 256 bytes, core kb at 256 t + 128 kb.
// Warpgroup g takes tiles 4g..4g+3 a pass (wgmma m64n8k32 e4m3, f32 sums in registers), and
// waits for them before the next pass, as a consumer would before a slot's release.
// lbo / sbo: the descriptors' two core-matrix strides (the PTX ISA: K-adjacent, M/N-adjacent:
// 128 / 256 here); f8_probe.py also runs them swapped, which must give wrong sums.
// out[(block * 4 + g) * 64 + row]: column 0 of warpgroup g's sums.
__device__ __forceinline__ u64 wg_desc(const void* p, u32 lbo, u32 sbo) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    return (u64)((a & 0x3ffff) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32);
}
extern "C" __global__ void __launch_bounds__(512, 1) probe_wgmma(const uint4* w, const uint4* xb, float* out, int iters, u32 lbo,
                                                                 u32 sbo) {
    extern __shared__ __align__(128) uint4 sm[];
    uint4* slots = sm;
    uint4* bs = sm + 2 * PROBE_SLOT / 16;  // 4 KB
    for (int i = threadIdx.x; i < PROBE_SLOT / 16; i += blockDim.x) slots[i] = slots[PROBE_SLOT / 16 + i] = w[i];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) bs[i] = xb[i];
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    const int g = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int p = 0; p < iters; p++) {
        const unsigned char* s = (const unsigned char*)(slots + (p & 1) * (PROBE_SLOT / 16));
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int t = 4 * g + j;
            const u64 da = wg_desc(s + 2048 * t, lbo, sbo), db = wg_desc((const unsigned char*)bs + 256 * t, lbo, sbo);
            asm volatile(
                "{ .reg .pred p; setp.ne.b32 p, %6, 0;\n"
                "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, %4, %5, p, 1, 1; }"
                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                : "l"(da), "l"(db), "r"(1));
        }
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    }
    // (m64n8 f32: warp w of the group rows 16 w + lane / 4 and + 8, columns 2 (lane % 4) + 0, 1.)
    if ((lane & 3) == 0) {
        float* o = out + (blockIdx.x * 4 + g) * 64 + 16 * warp + (lane >> 2);
        o[0] = d[0];
        o[8] = d[2];
    }
}
