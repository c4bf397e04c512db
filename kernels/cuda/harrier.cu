// Harrier's CUDA kernels, compiled at engine start with NVRTC (see kernels/src/lib.rs).
//
// Conventions: `elem` is the storage type of weights, activations and the KV cache: bf16 (raw
// 16-bit words, converted here; no CUDA headers needed) by default, fp32 when compiled with
// -DHARRIER_F32 (the fp32 model, for exact parity checks). Arithmetic is fp32 either way.
// In bf16, where the rounding points of Hugging Face's bf16 modules are cheap to reproduce
// (RMSNorm, RoPE, SiLU-and-mul, residual adds, attention probabilities) they are reproduced
// (`rnd`), so bf16 parity with transformers is as close as the GEMMs allow; in fp32 `rnd` is
// the identity. Every kernel is `extern "C"`.
//
// Index types: token rows `t < T`, sequences `s < S`, backend rows `row < max_rows`.

typedef unsigned short bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define NEG_INF (__int_as_float(0xff800000))

// Programmatic dependent launch (sm_90+; the host launches with the programmatic stream
// serialization attribute, kernels/src/lib.rs): a kernel may start while the one before it in
// the stream is finishing. PDL_ENTER, first in every kernel, waits until that kernel has
// completed and its writes are visible (griddepcontrol.wait), then lets the next kernel launch
// (launch_dependents); the skinny GEMMs issue their first weight loads (read-only data) before
// waiting, so those loads overlap the previous kernel's tail. Every kernel waits on every path
// before touching memory another kernel writes, so completion stays transitive along the
// stream; what a kernel reads before its wait was written at least two launches back (one
// exception, attention_combine, triggers first: see there). Before sm_90 (and with
// HARRIER_PDL=0) these are no-ops / plain launches.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#define PDL_TRIGGER() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#else
#define PDL_WAIT()
#define PDL_TRIGGER()
#endif
#ifndef HARRIER_TRACE
#define PDL_ENTER()    \
    do {               \
        PDL_WAIT();    \
        PDL_TRIGGER(); \
    } while (0)
// The next launch scheduled first, then the wait (attention_combine only; see there).
#define PDL_ENTER_TRIGGER_FIRST() \
    do {                          \
        PDL_TRIGGER();            \
        PDL_WAIT();               \
    } while (0)
#else
// Measurement only (HARRIER_KERNEL_DEFINES=-DHARRIER_TRACE; `harrier-cuda-tool bench
// --trace FILE`): thread 0 of every block records its launch (%gridid), the global time
// before and after its PDL wait and when it leaves the kernel (the destructor of a local that
// PDL_ENTER declares in the kernel's scope), its SM and clock, into harrier_trace.
#define TRACE_CAP 262144
__device__ unsigned long long harrier_trace[TRACE_CAP][8];
__device__ unsigned int harrier_trace_n;
__device__ __forceinline__ unsigned long long gtimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
struct TraceScope {
    unsigned int i;
    __device__ TraceScope(bool trigger_first = false) : i(TRACE_CAP) {
        // The slot is taken before the wait, so its atomic's latency hides under it.
        const bool first = threadIdx.x + threadIdx.y + threadIdx.z == 0;
        if (first) i = atomicAdd(&harrier_trace_n, 1u);
        unsigned long long t0 = gtimer(), c0 = clock64();
        if (trigger_first) PDL_TRIGGER();
        PDL_WAIT();
        unsigned long long t1 = gtimer();
        if (!trigger_first) PDL_TRIGGER();
        if (i >= TRACE_CAP) return;
        unsigned long long gid, smid;
        asm volatile("mov.u64 %0, %%gridid;" : "=l"(gid));
        unsigned int sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        smid = sm;
        unsigned long long* r = harrier_trace[i];
        r[0] = gid;
        r[1] = t0;
        r[2] = t1;
        r[4] = c0;
        r[6] = ((unsigned long long)gridDim.x * gridDim.y * gridDim.z << 32) | ((unsigned long long)blockDim.x << 16) | smid;
    }
    __device__ ~TraceScope() {
        if (i >= TRACE_CAP) return;
        harrier_trace[i][3] = gtimer();
        harrier_trace[i][5] = clock64();
    }
};
#define PDL_ENTER() TraceScope trace_scope_
#define PDL_ENTER_TRIGGER_FIRST() TraceScope trace_scope_(true)
#endif

__device__ __forceinline__ float bf2f(bf16 x) { return __uint_as_float(((u32)x) << 16); }

// Round to nearest even; NaN stays NaN. (sm_80 on: the conversion instruction, the same bits
// but a NaN's, which becomes the canonical one; the bit arithmetic took ~6 instructions and a
// branch, inlined wherever a value is rounded: 568 of the decode ring's 9,768.)
__device__ __forceinline__ bf16 f2bf(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return (bf16)r;
#else
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
#endif
}

// Rounds through bf16 (a bf16 tensor op's result).
__device__ __forceinline__ float rbf(float f) { return bf2f(f2bf(f)); }

#ifdef HARRIER_F32
typedef float elem;
__device__ __forceinline__ float e2f(elem x) { return x; }
__device__ __forceinline__ elem f2e(float f) { return f; }
__device__ __forceinline__ float rnd(float f) { return f; }
#else
typedef bf16 elem;
__device__ __forceinline__ float e2f(elem x) { return bf2f(x); }
__device__ __forceinline__ elem f2e(float f) { return f2bf(f); }
__device__ __forceinline__ float rnd(float f) { return rbf(f); }
#endif

// float or double.
template <typename T> __device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide reductions (blockDim.x a multiple of 32, at most 1024). `sh` holds 32 values.
template <typename T> __device__ T block_sum(T v, T* sh) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : (T)0;
    return warp_sum(v);
}

__device__ float block_max(float v, float* sh) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : NEG_INF;
    return warp_max(v);
}

// An RMSNorm weight applied to a normalised value xn: Llama's w * bf16(xn), or with w_off != 0
// (Gemma) xn * (w_off + w) in fp32 (add_rmsnorm below has the rounding points).
__device__ __forceinline__ float norm_weight(float xn, float w, float w_off) {
    return w_off != 0.0f ? xn * (w_off + w) : w * rnd(xn);
}
__device__ __forceinline__ float norm_scale(float xn, const elem* w, int j, float w_off) {
    return norm_weight(xn, e2f(w[j]), w_off);
}

// An RMSNorm's end, by a whole block over one row: ss is each thread's sum of squares of the
// row's values x(j) over its j (j = threadIdx.x, + blockDim.x, ...); writes
// out[j] = norm(x(j)) * w. (add_rmsnorm and embed_tokens: the same loop, so the same bits.)
template <typename X>
__device__ __forceinline__ void rms_norm_row(X x, float ss, int hidden, float eps, const elem* w, float w_off,
                                             elem* out, float* sh) {
    ss = block_sum(ss, sh);
    const float inv = rsqrtf(ss / (float)hidden + eps);
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) out[j] = f2e(norm_scale(x(j) * inv, w, j, w_off));
}

// ---------------------------------------------------------------------------------------------
// Embedding: out[t] = table[token(t)] (times scale when it is not 1: Gemma's sqrt(hidden), already
// rounded to the storage type by the host, the product rounded as a bf16 multiply), where
// token(t) = tok_src[t] if >= 0 (from the host), else pending[-tok_src[t] - 1] (the row's last
// sampled token, written on the device by sampling).
// With norm_w != 0 also layer 0's input RMSNorm of the row into h[t] (the add_rmsnorm launch it
// replaces, without a delta: rms_norm_row over a block of the same size, so the same bits).
#define EMBED_ROUND 2
extern "C" __global__ void __launch_bounds__(1024, 2) embed_tokens(elem* out, const elem* table, const int* tok_src, const int* pending,
                                        int hidden, int vocab, float scale, elem* h, const elem* norm_w, float eps,
                                        float w_off) {
    PDL_ENTER();
    int t = blockIdx.x;
    int s = tok_src[t];
    int tok = s >= 0 ? s : pending[-s - 1];
    if (tok < 0 || tok >= vocab) tok = 0;
    const elem* row = table + (size_t)tok * hidden;
    elem* o = out + (size_t)t * hidden;
    const auto val = [&](int j) { return scale == 1.0f ? e2f(row[j]) : rnd(e2f(row[j]) * scale); };
    float ss = 0.0f;
    // A thread's j = threadIdx.x + k blockDim.x in order, EMBED_ROUND loads issued before their
    // stores: as one loop of load and store, where the store may alias the next load as far as
    // the compiler knows, every element was a round trip to HBM, 7 us for the 1B's row of 2,048
    // in the batch-1 step's 256-thread block (session 42's trace). Rounds of 2 in 1,024-thread
    // blocks, two an SM (__launch_bounds__(1024, 2)): rounds of 16 took 72 registers and failed
    // to launch, rounds of 8 (48 registers, one block an SM) made batch-256 steps 2.5% and the
    // offline run 3.3% slower. (add_rmsnorm keeps its loop: taken so it made the offline run 0.3%
    // slower and no decode step faster.)
    for (int j0 = threadIdx.x; j0 < hidden; j0 += EMBED_ROUND * blockDim.x) {
        float v[EMBED_ROUND];
#pragma unroll
        for (int u = 0; u < EMBED_ROUND; u++) {
            const int j = j0 + u * blockDim.x;
            v[u] = j < hidden ? val(j) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < EMBED_ROUND; u++) {
            const int j = j0 + u * blockDim.x;
            if (j >= hidden) break;
            o[j] = f2e(v[u]);
            if (norm_w) ss += v[u] * v[u];
        }
    }
    __shared__ float sh[32];
    if (norm_w) rms_norm_row(val, ss, hidden, eps, norm_w, w_off, h + (size_t)t * hidden, sh);
}

// ---------------------------------------------------------------------------------------------
// Residual add + RMSNorm, Hugging Face's bf16 rounding points:
//   x = bf16(resid + delta)            (when delta != 0; written back to resid)
//   out = bf16(w * bf16(x * rsqrt(mean(x^2) + eps)))
// With w_off != 0 (Gemma: RMSNorm scales by 1 + w, in fp32, one rounding at the end):
//   out = bf16(x * rsqrt(mean(x^2) + eps) * (w_off + w))
// With delta_w != 0 (Gemma's post-attention and post-feedforward norms) the delta is normed
// first, the same way: x = bf16(resid + bf16(norm(delta) * (w_off + delta_w))).
// Block i handles row src = rows ? rows[i] : i and writes out row i (rows: the final norm over
// the rows that want logits).
extern "C" __global__ void __launch_bounds__(1024, 1) add_rmsnorm(elem* resid, const elem* delta, const elem* delta_w, const elem* w, elem* out,
                                       const int* rows, int hidden, float eps, float w_off) {
    PDL_ENTER();
    __shared__ float sh[32];
    int i = blockIdx.x;
    int src = rows ? rows[i] : i;
    elem* x = resid + (size_t)src * hidden;
    const elem* d = delta ? delta + (size_t)src * hidden : 0;
    float dinv = 0.0f;
    if (d && delta_w) {
        float ds = 0.0f;
        for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
            float v = e2f(d[j]);
            ds += v * v;
        }
        ds = block_sum(ds, sh);
        dinv = rsqrtf(ds / (float)hidden + eps);
    }
    float ss = 0.0f;
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
        float v = e2f(x[j]);
        if (d) {
            float dv = e2f(d[j]);
            if (delta_w) dv = rnd(norm_scale(dv * dinv, delta_w, j, w_off));
            v = rnd(v + dv);
            x[j] = f2e(v);
        }
        ss += v * v;
    }
    rms_norm_row([&](int j) { return e2f(x[j]); }, ss, hidden, eps, w, w_off, out + (size_t)i * hidden, sh);
}

// ---------------------------------------------------------------------------------------------
// RoPE pairs in the "paired" q/k row order. Rotate-half RoPE mixes dims i and i + hd / 2 of a
// head. With paired = 1 the q and k rows of the fused q|k|v weights are stored (at load) so
// that each 16-row tile of a head holds dims 8a .. 8a + 7 in its rows 0-7 and their partners
// hd / 2 + 8a .. in rows 8-15: storage row 16a + e is dim 8a + e (e < 8) or hd / 2 + 8a + e - 8.
// A skinny GEMM lane then holds both halves of its pairs (mma rows g and g + 8) and can rotate
// them in its epilogue (SK_ROPE). The K cache keeps the same order; attention only takes q . k
// over a head, which is the same in any order both share, so nothing else notices. V rows are
// never permuted.
__device__ __forceinline__ int rope_row(int i, int paired) { return paired ? ((i >> 3) << 4) + (i & 7) : i; }

// The rotated pair of values a (dim i) and b (dim i + hd / 2) at position pos with frequency f,
// rounded as HF's bf16 RoPE (cos / sin in the storage type, each product rounded).
__device__ __forceinline__ void rope_pair(float a, float b, float pos, float f, float* o1, float* o2) {
    float ang = pos * f;
    float c = rnd(cosf(ang)), s = rnd(sinf(ang));
    *o1 = rnd(rnd(a * c) + rnd(-b * s));
    *o2 = rnd(rnd(b * c) + rnd(a * s));
}

// Per token: (Qwen3, Gemma 3) per-head RMSNorm of q and k (Gemma's 1 + w with w_off = 1), RoPE (rotate-half, bf16 cos/sin as HF), q
// rotated in place, k and v stored in the paged cache at slot_mapping[t]
// (cache layout [num_blocks * block_size, nkv, hd]), q and k rows in the paired order when
// `paired` (see rope_row). One warp per head, the heads of a token
// spread over gridDim.y blocks (at batch 1 one block looping over 48 heads took 7.5 us a layer);
// hd <= 256, hd % 64 == 0.
extern "C" __global__ void rope_kv_write(elem* qkv, int qkv_stride, int nh, int nkv, int hd, const int* positions,
                                         const float* inv_freq, const elem* q_norm, const elem* k_norm, float eps,
                                         float w_off, const int* slot_mapping, elem* k_cache, elem* v_cache,
                                         int paired) {
    PDL_ENTER();
    int t = blockIdx.x;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    int half = hd >> 1;
    int partner = paired ? 8 : half;  // storage distance of a pair
    float pos = (float)positions[t];
    long long slot = slot_mapping[t];
    elem* row = qkv + (size_t)t * qkv_stride;
    for (int h = blockIdx.y * nw + warp; h < nh + 2 * nkv; h += nw * gridDim.y) {
        elem* x = row + (size_t)h * hd;
        if (h >= nh + nkv) {
            int kh = h - nh - nkv;
            elem* dst = v_cache + (size_t)(slot * nkv + kh) * hd;
            for (int i = lane; i < hd; i += 32) dst[i] = x[i];
            continue;
        }
        bool is_q = h < nh;
        const elem* nw_ = is_q ? q_norm : k_norm;
        float inv = 1.0f;
        if (nw_) {
            float ss = 0.0f;
            for (int i = lane; i < hd; i += 32) {
                float v = e2f(x[i]);
                ss += v * v;
            }
            ss = warp_sum(ss);
            inv = rsqrtf(ss / (float)hd + eps);
        }
        elem* dst = is_q ? x : k_cache + (size_t)(slot * nkv + (h - nh)) * hd;
        for (int i = lane; i < half; i += 32) {
            int r = rope_row(i, paired);
            float a = e2f(x[r]), b = e2f(x[r + partner]);
            if (nw_) {
                a = rnd(norm_scale(a * inv, nw_, i, w_off));
                b = rnd(norm_scale(b * inv, nw_, i + half, w_off));
            }
            float o1, o2;
            rope_pair(a, b, pos, inv_freq[i], &o1, &o2);
            dst[r] = f2e(o1);
            dst[r + partner] = f2e(o2);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// out[r, i] = bf16(bf16(act(gate)) * up), rows of gu = [gate | up]; act is SiLU (silu_mul) or
// the tanh approximation of GELU (gelu_tanh_mul: torch's gelu(approximate="tanh"), Gemma).
// act(g) * u with the activation rounded to the storage type (HF's bf16 act, then the mul):
// GELU with the tanh approximation, or SiLU. The skinny GEMMs' gated epilogue uses it too.
__device__ __forceinline__ float act_mul(float g, float u, bool gelu) {
    float a;
    if (gelu) {
        const float k0 = 0.7978845608028654f, k1 = 0.044715f;
        a = rnd(0.5f * g * (1.0f + tanhf(k0 * (g + k1 * g * g * g))));
    } else {
        a = rnd(g / (1.0f + expf(-g)));
    }
    return a * u;
}

template <bool GELU>
__device__ __forceinline__ void gated_act(elem* out, const elem* gu, int inter, long long total) {
    for (long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x; k < total; k += (long long)gridDim.x * blockDim.x) {
        long long r = k / inter;
        int i = (int)(k - r * inter);
        out[k] = f2e(act_mul(e2f(gu[r * 2 * inter + i]), e2f(gu[r * 2 * inter + inter + i]), GELU));
    }
}

extern "C" __global__ void silu_mul(elem* out, const elem* gu, int inter, long long total) {
    PDL_ENTER();
    gated_act<false>(out, gu, inter, total);
}

extern "C" __global__ void gelu_tanh_mul(elem* out, const elem* gu, int inter, long long total) {
    PDL_ENTER();
    gated_act<true>(out, gu, inter, total);
}

// ---------------------------------------------------------------------------------------------
// n (2, 4 or 8) consecutive elements at p (aligned to n elements) as floats, vector loads.
__device__ __forceinline__ void load_elems(const elem* p, int n, float* out) {
#ifdef HARRIER_F32
    if (n == 2) {
        float2 a = *(const float2*)p;
        out[0] = a.x;
        out[1] = a.y;
    } else {
        float4 a = *(const float4*)p;
        out[0] = a.x;
        out[1] = a.y;
        out[2] = a.z;
        out[3] = a.w;
        if (n == 8) {
            float4 b = *(const float4*)(p + 4);
            out[4] = b.x;
            out[5] = b.y;
            out[6] = b.z;
            out[7] = b.w;
        }
    }
#else
    if (n == 2) {
        u32 a = *(const u32*)p;
        out[0] = __uint_as_float(a << 16);
        out[1] = __uint_as_float(a & 0xffff0000u);
    } else if (n == 4) {
        uint2 a = *(const uint2*)p;
        out[0] = __uint_as_float(a.x << 16);
        out[1] = __uint_as_float(a.x & 0xffff0000u);
        out[2] = __uint_as_float(a.y << 16);
        out[3] = __uint_as_float(a.y & 0xffff0000u);
    } else {
        uint4 a = *(const uint4*)p;
        out[0] = __uint_as_float(a.x << 16);
        out[1] = __uint_as_float(a.x & 0xffff0000u);
        out[2] = __uint_as_float(a.y << 16);
        out[3] = __uint_as_float(a.y & 0xffff0000u);
        out[4] = __uint_as_float(a.z << 16);
        out[5] = __uint_as_float(a.z & 0xffff0000u);
        out[6] = __uint_as_float(a.w << 16);
        out[7] = __uint_as_float(a.w & 0xffff0000u);
    }
#endif
}

// 8 consecutive elements (aligned to 8) as they are stored, loaded at once (16 bytes in bf16),
// unpacked to floats when used; shfl_chunk hands a lane's chunk to the warp.
#ifdef HARRIER_F32
struct Chunk {
    float4 a, b;
};
__device__ __forceinline__ Chunk ld_chunk(const elem* p) { return {*(const float4*)p, *(const float4*)(p + 4)}; }
__device__ __forceinline__ void unpack_chunk(const Chunk& c, float* o) {
    o[0] = c.a.x, o[1] = c.a.y, o[2] = c.a.z, o[3] = c.a.w, o[4] = c.b.x, o[5] = c.b.y, o[6] = c.b.z, o[7] = c.b.w;
}
__device__ __forceinline__ Chunk shfl_chunk(const Chunk& c, int src) {
    Chunk r;
    r.a.x = __shfl_sync(0xffffffffu, c.a.x, src), r.a.y = __shfl_sync(0xffffffffu, c.a.y, src);
    r.a.z = __shfl_sync(0xffffffffu, c.a.z, src), r.a.w = __shfl_sync(0xffffffffu, c.a.w, src);
    r.b.x = __shfl_sync(0xffffffffu, c.b.x, src), r.b.y = __shfl_sync(0xffffffffu, c.b.y, src);
    r.b.z = __shfl_sync(0xffffffffu, c.b.z, src), r.b.w = __shfl_sync(0xffffffffu, c.b.w, src);
    return r;
}
#else
struct Chunk {
    uint4 a;
};
__device__ __forceinline__ Chunk ld_chunk(const elem* p) { return {*(const uint4*)p}; }
__device__ __forceinline__ void unpack_chunk(const Chunk& c, float* o) {
    const u32 w[4] = {c.a.x, c.a.y, c.a.z, c.a.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        o[2 * i] = __uint_as_float(w[i] << 16);
        o[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
__device__ __forceinline__ Chunk shfl_chunk(const Chunk& c, int src) {
    return {make_uint4(__shfl_sync(0xffffffffu, c.a.x, src), __shfl_sync(0xffffffffu, c.a.y, src),
                       __shfl_sync(0xffffffffu, c.a.z, src), __shfl_sync(0xffffffffu, c.a.w, src))};
}
#endif

// ---------------------------------------------------------------------------------------------
// What every attention kernel reads and writes, passed by value (mirrors
// harrier_kernels::AttentionInputs, #[repr(C)]): the output and query rows (q inside the fused
// qkv rows, q_stride apart), one layer's K/V cache ([slots, nkv, hd] each), each token's backend
// row and position, the per-row block tables (bt_stride apart), the head geometry, the softmax
// scale and the sliding window (0: none). ATTN_UNPACK names the fields as locals.
struct AttnIn {
    elem* out;
    const elem* q;
    const elem* k_cache;
    const elem* v_cache;
    const int* tok_row;
    const int* positions;
    const int* block_tables;
    int q_stride, bt_stride, nh, nkv, hd, block_size;
    float scale;
    int window;
};
#define ATTN_UNPACK(a)                                                                                   \
    elem* out = a.out;                                                                                   \
    const elem *q = a.q, *k_cache = a.k_cache, *v_cache = a.v_cache;                                     \
    const int *tok_row = a.tok_row, *positions = a.positions, *block_tables = a.block_tables;            \
    int q_stride = a.q_stride, bt_stride = a.bt_stride, nh = a.nh, nkv = a.nkv, hd = a.hd,               \
        block_size = a.block_size, window = a.window;                                                    \
    float scale = a.scale;

// ---------------------------------------------------------------------------------------------
// Paged attention, decode and prefill alike, optionally split over the context
// (flash-decoding). Token t (of backend row tok_row[t], at position positions[t]) attends
// causally to positions [start, positions[t]] of its sequence through the row's block table,
// block_tables + tok_row[t] * bt_stride (start = positions[t] - window + 1 with a sliding
// window, else 0). The new chunk's K/V must already be in the cache (rope_kv_write); q is
// read from the qkv rows (stride q_stride).
//
// The key range (n_tiles tiles of 32 keys) is cut into min(n_splits, ceil(n_tiles / 4))
// splits of equal tile counts, or kept whole when it has at most one_split tiles (a token
// with one split writes its output directly and marks its partial so that attention_combine
// skips it; a step whose tokens all do needs no attention_combine: the executor's
// short-context graphs leave it out, and their padding rows keep stale rows, which only
// padding reads); block (t, h, s) computes split s for query head h. Its
// blockDim.x / 32 warps (4, 8 or 16: the host's choice, at most ATT_WARPS_MAX) take the
// split's tiles round-robin: each lane computes one key's dot product with q (its K row's
// 16-byte chunks loaded at once, q's chunks handed round the lanes by shuffles), the warp
// does one max and one sum
// per tile (online softmax), then accumulates V, by rows (see vrows below) or with the lanes
// splitting head_dim (V rows of the 32 keys unrolled by 8). Warps merge their (max, sum, acc)
// at the end. With n_splits == 1 the block writes the output;
// otherwise its partial goes to part[t][h][s] ((max, sum, acc[hd]) floats) and
// attention_combine merges the splits in order. Splits are for small decode batches, where one
// block per (token, head) leaves most SMs idle; the host picks n_splits from the padded batch
// size, and the cut depends only on the token's own length and n_splits, so a row's output is
// the same in an eager step and in a graph replay of its bucket. A negative position marks a
// padding row of a CUDA-graph batch: no keys, the output is zeros. With tok_list, block x
// handles token tok_list[x] (the tokens prefill_attention's tiles leave; one split then).
//
// Measured on the H200 (1B shape, batch 1): 124 us per layer at 500 keys with one key per warp
// step and a warp reduction per key; 36 us with 16 warps of that; 21 us lane-per-key with a
// dependent V load per key; 15 us with the V loads unrolled. A variant with one block per KV
// head scoring all G query heads per key (K/V read once per group) ran 20-40% slower: fewer,
// longer warps. Splitting with 4-warp blocks lost to 16 warps without splits from batch 8 on.
// Merging the splits in the last block to finish (threadfence + arrival counter, no
// attention_combine launch) was correct but slower: 1.517 vs 1.456 ms per graph step at batch
// 1, 1.679 vs 1.509 at batch 8 (the merge then waits on the slowest split in every block's
// tail); not kept. Session 14 (H100, 1B, graphs, ms per step) tried it again to drop the
// combine launch, which keeps the o projection from loading its weights under attention:
// with an arrival counter 1.219-1.224 at batch 1 (5 splits) vs 1.230-1.241 with the launch,
// but 1.352 vs 1.333 at batch 4 and 3B 3.501 vs 3.428 there (an arrival by flags, without
// atomics, the same). Kept instead: graphs without attention_combine for steps whose
// contexts all fit one split (executor).
// Session 12 (H200, ms per graph step, old vs new side by side): at most 64 registers, so two
// 16-warp blocks fit an SM (71 had allowed one: an attention block could not start beside
// the q|k|v GEMM's blocks to prefetch, and batch 5-8 launches ran two waves): 1B 1.131 ->
// 1.046 at batch 1, 1.432 -> 1.210 at 8, 2.071 -> 1.626 at 16; 8B 5.26 -> 4.97 / 6.19 -> 5.44.
// Reading the metadata and the first tile's slots before the wait (3B: 2.708 -> 2.615 at
// batch 1, 3.555 -> 3.348 at 8) and V by rows (3B 2.637 -> 2.615, 3.425 -> 3.348; 1B 1.368 ->
// 1.344 on an H100) were measured before the bound, with it only as part of the whole.
#define ATT_WARPS_MAX 16

// Split s of n_splits of a token at position pos: its first key position (start), its tile
// range [tile0, tile1) of 32-key tiles (empty past the context or for padding); returns how
// many splits the token uses: one for a context of at most one_split tiles, else up to
// n_splits of at least 4 tiles each.
__device__ __forceinline__ int split_tiles(int pos, int window, int n_splits, int one_split, int s, int* start,
                                           int* tile0, int* tile1) {
    *start = window > 0 ? max(0, pos - window + 1) : 0;
    int n_tiles = pos >= 0 ? (pos - *start + 32) >> 5 : 0;
    int splits = n_tiles <= one_split ? min(n_tiles, 1) : min(n_splits, (n_tiles + 3) >> 2);
    int per = splits > 0 ? (n_tiles + splits - 1) / splits : 0;
    *tile0 = s * per;
    *tile1 = s < splits ? min(n_tiles, *tile0 + per) : *tile0;
    return splits;
}

// Stores a head's merged dim d (its weighted sum v, max M, sum L): the output o[i] directly where
// the token ran in one split (a split launch marks it done, sum -1, for attention_combine), else
// its split's partial at pp (`[HD + 2]`: max, sum, the dims).
__device__ __forceinline__ void attn_store(elem* o, int i, float* pp, int d, float v, float M, float L, int splits,
                                           int n_splits) {
    if (splits == 1) {
        o[i] = f2e(L > 0.0f ? v / L : 0.0f);
        if (n_splits > 1 && d == 0) pp[1] = -1.0f;
    } else {
        if (d == 0) {
            pp[0] = M;
            pp[1] = L;
        }
        pp[2 + d] = v;
    }
}

__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// The block's shared state: each warp's (max, sum, partial output), the warps' weights and the
// merged (max, sum).
struct AttnSmem {
    float m[ATT_WARPS_MAX], l[ATT_WARPS_MAX], w[ATT_WARPS_MAX], ML[2];
    float acc[ATT_WARPS_MAX][256];
};

// The kernel's work for head dim HD (0: any, read from the inputs): the kernel below picks the
// instance, so loops over the head dim unroll fully where it is known.
template <int HD>
__device__ __forceinline__ void paged_attention_body(AttnIn a, float* part, int n_splits, const int* tok_list,
                                                     int prefetch, int one_split, int vrows, AttnSmem& sm) {
    ATTN_UNPACK(a)
    if (HD) hd = HD;
    const int nw = blockDim.x >> 5;  // warps: 4, 8 or 16 (the host's choice)
    int h = blockIdx.y, s = blockIdx.z;
    int kh = h / (nh / nkv);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int nv = hd >> 5;
    // V by rows (vrows): lpk = hd / 8 lanes read a key's V row, 8 dims a lane in one 16-byte
    // load, kpr = 32 / lpk keys a load round (lanes past kpr * lpk idle when lpk does not
    // divide 32), so a tile's V loads are independent (all in flight at once for hd 64)
    // instead of 32 dependent rounds; each lane sums its keys' share and the lane groups are
    // added at the end. The other loop (HARRIER_ATTN_VROWS=0, to compare) reads hd / 32 dims
    // a lane and key, so only head dims 64, 128 and 256; every other one takes rows.
    const int lpk = hd >> 3;
    vrows = vrows || !(hd == 64 || hd == 128 || hd == 256);
    // Split decode launches (small batches, latency-bound; never a token list) read their
    // metadata before waiting on the previous kernel (q|k|v, which writes q and the new
    // keys): it is written before the step's graph starts or by kernels at least two launches
    // back, which have completed once this kernel runs (see PDL_ENTER). Each lane keeps its
    // first tile's cache slot, and the block's K and V rows are pulled into L2 (a hint only:
    // L2 is coherent and nothing lands in registers or L1), where the loads below find them.
    const bool early = prefetch && n_splits > 1;
    int t, pos, row, start, tile0, tile1, splits, first_slot = 0;
    auto read_meta = [&]() {
        pos = positions[t];
        row = tok_row[t];
        splits = split_tiles(pos, window, n_splits, one_split, s, &start, &tile0, &tile1);
    };
    if (early) {
        t = blockIdx.x;
        read_meta();
        const int* bt = block_tables + (size_t)row * bt_stride;
        for (int tile = tile0 + warp; tile < tile1; tile += nw) {
            int p = start + tile * 32 + lane;
            int pe = min(p, pos);  // lanes past the last key: its slot (see the main loop)
            int slot = bt[pe / block_size] * block_size + pe % block_size;
            if (tile == tile0 + warp) first_slot = slot;
            if (p <= pos) {
                size_t at = ((size_t)slot * nkv + kh) * hd;
                for (int b = 0; b < hd * (int)sizeof(elem); b += 128) {
                    prefetch_l2((const char*)(k_cache + at) + b);
                    prefetch_l2((const char*)(v_cache + at) + b);
                }
            }
        }
    }
#ifdef ATT_LATE_TRIGGER  // measurement only: the next launch only once this block's keys are done
    PDL_WAIT();
#else
    PDL_ENTER();
#endif
    if (!early) {
        t = tok_list ? tok_list[blockIdx.x] : blockIdx.x;
        read_meta();
    }
#ifdef ATT_EXIT_AFTER_WAIT  // measurement only (HARRIER_KERNEL_DEFINES): the launch without its work
    return;
#endif
    const elem* qp = q + (size_t)t * q_stride + (size_t)h * hd;
    float* pp = part + (((size_t)t * nh + h) * n_splits + s) * (hd + 2);
    elem* o = out + ((size_t)t * nh + h) * hd;
    if (tile0 >= tile1) { // no keys here (a split past the context, or padding)
        if (n_splits == 1) {
            for (int d = threadIdx.x; d < hd; d += blockDim.x) o[d] = f2e(0.0f);
        } else if (threadIdx.x == 0) {
            pp[0] = NEG_INF;
            pp[1] = 0.0f;
        }
        return;
    }
    const int* bt = block_tables + (size_t)row * bt_stride;
    // Chunks of 8 head dims (16 bytes in bf16). q is spread over the lanes (lane c holds chunk
    // c, read once a warp) and handed round by shuffles, so a key's K chunks are all loaded
    // before the first is used: one round trip a tile. Reading q beside each K row from
    // global memory instead (one broadcast load a chunk) made ptxas, at 64 registers, reuse
    // the K registers for the next loads only after the FMAs of the last: about six
    // dependent L2 round trips a tile (session 15).
    // Head dims are multiples of 8 up to 256 (the executor takes multiples of 64).
    const int nc = hd >> 3;
    Chunk qv = {};
    if (lane < nc) qv = ld_chunk(qp + lane * 8);
    float acc[8];
#pragma unroll
    for (int j = 0; j < 8; j++) acc[j] = 0.0f;
    float m = NEG_INF, l = 0.0f;
    for (int tile = tile0 + warp; tile < tile1; tile += nw) {
        int base = start + tile * 32;
        int p = base + lane;
        bool valid = p <= pos;
        // Lanes past the last key read the last key's row (their score is masked), so every
        // lane takes part in the shuffles below.
        int pe = valid ? p : pos;
        int slot = early && tile == tile0 + warp ? first_slot : bt[pe / block_size] * block_size + pe % block_size;
        const elem* kp = k_cache + ((size_t)slot * nkv + kh) * hd;
        float dot = 0.0f;
        for (int c0 = 0; c0 < nc; c0 += 8) {
            Chunk kr[8];
#pragma unroll
            for (int j = 0; j < 8; j++)
                if (c0 + j < nc) kr[j] = ld_chunk(kp + (c0 + j) * 8);
#pragma unroll
            for (int j = 0; j < 8; j++) {
                if (c0 + j >= nc) break;
                float kv[8], qc[8];
                unpack_chunk(kr[j], kv);
                unpack_chunk(shfl_chunk(qv, c0 + j), qc);
                dot += qc[0] * kv[0] + qc[1] * kv[1];
                dot += qc[2] * kv[2] + qc[3] * kv[3];
                dot += qc[4] * kv[4] + qc[5] * kv[5];
                dot += qc[6] * kv[6] + qc[7] * kv[7];
            }
        }
        float sc = valid ? dot * scale : NEG_INF;
        // Lane 0's key (p = base) is always valid: every tile max is finite.
        float mn = fmaxf(m, warp_max(sc));
        float corr = __expf(m - mn);
        float pk = valid ? __expf(sc - mn) : 0.0f;
        l = l * corr + warp_sum(pk);
#pragma unroll
        for (int j = 0; j < 8; j++) acc[j] *= corr;
        m = mn;
        // The V product takes the probabilities rounded to the storage type, as FlashAttention
        // and PyTorch's bf16 attention do (P is a bf16 GEMM operand); the sum l stays fp32.
        float pv = rnd(pk);
        if (vrows) {
            // Round r holds this lane's key r * kpr + grp (none past the tile's 32: weight 0,
            // row zeros): up to 8 rounds' slots and V row loads at once, then the products.
            const int kpr = 32 / lpk, grp = lane / lpk, sub = lane - grp * lpk;
            const int rounds = (32 + kpr - 1) / kpr;
            for (int r0 = 0; r0 < rounds; r0 += 8) {
                Chunk vr[8];
#pragma unroll
                for (int r = 0; r < 8; r++) {
                    const int ki = (r0 + r) * kpr + grp;
                    int si = __shfl_sync(0xffffffffu, slot, ki & 31);
                    if (r0 + r < rounds) vr[r] = ki < 32 ? ld_chunk(v_cache + ((size_t)si * nkv + kh) * hd + sub * 8) : Chunk{};
                }
#pragma unroll
                for (int r = 0; r < 8; r++) {
                    const int ki = (r0 + r) * kpr + grp;
                    float w = __shfl_sync(0xffffffffu, pv, ki & 31);
                    if (r0 + r >= rounds) break;
                    if (ki >= 32) w = 0.0f;
                    float v[8];
                    unpack_chunk(vr[r], v);
#pragma unroll
                    for (int j = 0; j < 8; j++) acc[j] += w * v[j];
                }
            }
            continue;
        }
#pragma unroll 8
        for (int i = 0; i < 32; i++) {
            float w = __shfl_sync(0xffffffffu, pv, i);
            int si = __shfl_sync(0xffffffffu, slot, i);
            float v[8];
            load_elems(v_cache + ((size_t)si * nkv + kh) * hd + lane * nv, nv, v);
#pragma unroll
            for (int j = 0; j < 8; j++)
                if (j < nv) acc[j] += w * v[j];
        }
    }
#ifdef ATT_LATE_TRIGGER
    PDL_TRIGGER();
#endif
    if (lane == 0) {
        sm.m[warp] = m;
        sm.l[warp] = l;
    }
    if (vrows) {
        // Add the lane groups' sums: lanes 0 .. lpk - 1 then hold dims 8 lane .. 8 lane + 7
        // (a butterfly where lpk divides 32; else lane + g lpk for the kpr groups).
        if (32 % lpk == 0) {
            for (int o = lpk; o < 32; o <<= 1)
#pragma unroll
                for (int j = 0; j < 8; j++) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
        } else {
            for (int g = 1; g < 32 / lpk; g++)
#pragma unroll
                for (int j = 0; j < 8; j++) acc[j] += __shfl_sync(0xffffffffu, acc[j], (lane + g * lpk) & 31);
        }
        if (lane < lpk)
#pragma unroll
            for (int j = 0; j < 8; j++) sm.acc[warp][lane * 8 + j] = acc[j];
    } else {
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (j < nv) sm.acc[warp][lane * nv + j] = acc[j];
    }
    __syncthreads();
    // Warp 0 weighs the warps' partial sums at once (lane w: warp w); then each thread adds
    // its dims. A warp without keys has sum 0 and weight 0 (its acc is zeros).
    if (warp == 0) {
        float mw = lane < nw ? sm.m[lane] : NEG_INF, lw = lane < nw ? sm.l[lane] : 0.0f;
        float M = warp_max(lw > 0.0f ? mw : NEG_INF);
        float e = lw > 0.0f ? __expf(mw - M) : 0.0f;
        float L = warp_sum(lw * e);
        if (lane < nw) sm.w[lane] = e;
        if (lane == 0) {
            sm.ML[0] = M;
            sm.ML[1] = L;
        }
    }
    __syncthreads();
    const float M = sm.ML[0], L = sm.ML[1];
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float v = 0.0f;
        for (int w = 0; w < nw; w++) v += sm.acc[w][d] * sm.w[w];
        attn_store(o, d, pp, d, v, M, L, splits, n_splits);  // (one split always with n_splits == 1)
    }
}

// One entry point per head dim the executor runs (64, 128, 256), each with its own registers,
// and one for any head dim (a multiple of 8 up to 256).
#define ATT_PARAMS AttnIn a, float *part, int n_splits, const int *tok_list, int prefetch, int one_split, int vrows
#define ATT_BODY(HD)                                                                        \
    __shared__ AttnSmem sm;                                                                 \
    paged_attention_body<HD>(a, part, n_splits, tok_list, prefetch, one_split, vrows, sm);
extern "C" __global__ void __launch_bounds__(ATT_WARPS_MAX * 32, 2) paged_attention(ATT_PARAMS) { ATT_BODY(0) }
extern "C" __global__ void __launch_bounds__(ATT_WARPS_MAX * 32, 2) paged_attention_hd64(ATT_PARAMS) { ATT_BODY(64) }
extern "C" __global__ void __launch_bounds__(ATT_WARPS_MAX * 32, 2) paged_attention_hd128(ATT_PARAMS) { ATT_BODY(128) }
extern "C" __global__ void __launch_bounds__(ATT_WARPS_MAX * 32, 2) paged_attention_hd256(ATT_PARAMS) { ATT_BODY(256) }
#undef ATT_BODY
#undef ATT_PARAMS

// Decode attention with the G = nh / nkv query heads of a KV head together: block (x, kh) takes
// token t = tok_list ? tok_list[x] : x and its G heads kh * G .. kh * G + G - 1, so each key's
// K and V rows are read once per group instead of once per head (large decode batches are
// bound by that traffic). The block's warps (blockDim.x / 32, at most GQA_WARPS) take 32-key
// tiles round-robin: a lane scores its key
// against the G queries (in shared memory), the warp runs G online softmaxes, then the lanes
// split head_dim (NV = hd / 32 values each) and accumulate P V for the G heads from one V row
// load per key; warps merge at the end. No context splits. Same semantics as paged_attention
// (causal, sliding window, position -1 writes zeros, P rounded to the storage type).
// Profile (H200, 1B, batch 256, context 512): 161 us per layer, about 40% of the copy bandwidth
// for the K/V it reads: latency- and shuffle-bound at two blocks per SM. A tensor-core version
// (the G heads as mma rows, 64-key K/V tiles staged in shared memory as prefill_attention
// does, 4 warps splitting each tile) was correct but slower: 6.41 vs 5.80 ms per eager step.
// Passing P and the slots through shared memory instead of shuffles in the P V loop changed
// nothing measurable (5.77 vs 5.80 ms) and spilled in the G = 8 instances: not kept.
#define GQA_WARPS 8
#define GQA_MAX_ELEMS 1024  // G * hd

template <int G, int NV>
__device__ __forceinline__ void gqa_attention(elem* out, const elem* q, int q_stride, const elem* k_cache,
                                              const elem* v_cache, const int* tok_row, const int* positions,
                                              const int* block_tables, int bt_stride, int nh, int nkv,
                                              int block_size, float scale, int window, const int* tok_list, float* sq,
                                              float* sm_m, float* sm_l, float* sm_acc) {
    constexpr int HD = NV * 32;
    const int t = tok_list ? tok_list[blockIdx.x] : blockIdx.x, kh = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int pos = positions[t];
    const int row = tok_row[t];
    const elem* qp = q + (size_t)t * q_stride + (size_t)kh * G * HD;
    for (int i = threadIdx.x; i < G * HD; i += blockDim.x) sq[i] = e2f(qp[i]) * scale;
    elem* o = out + ((size_t)t * nh + (size_t)kh * G) * HD;
    if (pos < 0) {  // graph padding row
        for (int i = threadIdx.x; i < G * HD; i += blockDim.x) o[i] = f2e(0.0f);
        return;
    }
    const int start = window > 0 ? max(0, pos - window + 1) : 0;
    const int n_tiles = (pos - start + 32) >> 5;
    const int* bt = block_tables + (size_t)row * bt_stride;
    __syncthreads();
    float acc[G][NV];
    float m[G], l[G];
#pragma unroll
    for (int g = 0; g < G; g++) {
        m[g] = NEG_INF;
        l[g] = 0.0f;
#pragma unroll
        for (int j = 0; j < NV; j++) acc[g][j] = 0.0f;
    }
    const int nw = blockDim.x >> 5;
    for (int tile = warp; tile < n_tiles; tile += nw) {
        int p = start + tile * 32 + lane;
        bool valid = p <= pos;
        int slot = valid ? bt[p / block_size] * block_size + p % block_size : 0;
        float sc[G];
#pragma unroll
        for (int g = 0; g < G; g++) sc[g] = 0.0f;
        if (valid) {
            const elem* kp = k_cache + ((size_t)slot * nkv + kh) * HD;
#pragma unroll 4
            for (int c = 0; c < HD / 8; c++) {
                float kv[8];
                load_elems(kp + c * 8, 8, kv);
#pragma unroll
                for (int g = 0; g < G; g++) {
                    const float* qc = sq + g * HD + c * 8;
                    sc[g] += qc[0] * kv[0] + qc[1] * kv[1] + qc[2] * kv[2] + qc[3] * kv[3] + qc[4] * kv[4] +
                             qc[5] * kv[5] + qc[6] * kv[6] + qc[7] * kv[7];
                }
            }
        }
        float pv[G];
#pragma unroll
        for (int g = 0; g < G; g++) {
            // Lane 0's key is always valid: every tile max is finite.
            float mn = fmaxf(m[g], warp_max(valid ? sc[g] : NEG_INF));
            float corr = __expf(m[g] - mn);
            float pe = valid ? __expf(sc[g] - mn) : 0.0f;
            l[g] = l[g] * corr + warp_sum(pe);
#pragma unroll
            for (int j = 0; j < NV; j++) acc[g][j] *= corr;
            m[g] = mn;
            pv[g] = rnd(pe);
        }
        int slot0 = __shfl_sync(0xffffffffu, slot, 0);
        int vslot = valid ? slot : slot0;
#pragma unroll 16
        for (int i = 0; i < 32; i++) {
            int si = __shfl_sync(0xffffffffu, vslot, i);
            float v[NV];
            load_elems(v_cache + ((size_t)si * nkv + kh) * HD + lane * NV, NV, v);
#pragma unroll
            for (int g = 0; g < G; g++) {
                float w = __shfl_sync(0xffffffffu, pv[g], i);
#pragma unroll
                for (int j = 0; j < NV; j++) acc[g][j] += w * v[j];
            }
        }
    }
#pragma unroll
    for (int g = 0; g < G; g++) {
        if (lane == 0) {
            sm_m[warp * G + g] = m[g];
            sm_l[warp * G + g] = l[g];
        }
#pragma unroll
        for (int j = 0; j < NV; j++) sm_acc[warp * G * HD + g * HD + lane * NV + j] = acc[g][j];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * HD; i += blockDim.x) {
        int g = i / HD;
        float M = NEG_INF;
        for (int w = 0; w < nw; w++)
            if (sm_l[w * G + g] > 0.0f) M = fmaxf(M, sm_m[w * G + g]);
        float L = 0.0f, v = 0.0f;
        for (int w = 0; w < nw; w++) {
            if (sm_l[w * G + g] > 0.0f) {
                float e = __expf(sm_m[w * G + g] - M);
                L += sm_l[w * G + g] * e;
                v += sm_acc[w * G * HD + i] * e;
            }
        }
        o[i] = f2e(L > 0.0f ? v / L : 0.0f);
    }
}

// At most 128 registers: four 4-warp blocks per SM (the host launches 4 warps from 512 (token,
// KV head) blocks on, 8 below: 4-warp blocks took 1B batch 64/128/256 to 33,229/48,718/63,606
// tok/s from 31,129/44,738/56,393 in the same run on the H200, but batch 32 lost 4-5%), and 16
// V loads in flight per lane. Without a bound the largest instances had set the whole kernel's
// count to 151 (one block per SM), which lost a third.
extern "C" __global__ void __launch_bounds__(GQA_WARPS * 32, 2) paged_attention_gqa(AttnIn a, const int* tok_list) {
    PDL_ENTER();
    ATTN_UNPACK(a)
    __shared__ float sq[GQA_MAX_ELEMS];
    __shared__ float sm_m[GQA_WARPS * 8], sm_l[GQA_WARPS * 8];
    __shared__ float sm_acc[GQA_WARPS * GQA_MAX_ELEMS];
    int G = nh / nkv, nv = hd >> 5;
#define GQA_CASE(g, n)                                                                                            \
    if (G == g && nv == n) {                                                                                      \
        gqa_attention<g, n>(out, q, q_stride, k_cache, v_cache, tok_row, positions, block_tables, bt_stride, nh, \
                            nkv, block_size, scale, window, tok_list, sq, sm_m, sm_l, sm_acc);                    \
        return;                                                                                                   \
    }
    GQA_CASE(1, 2) GQA_CASE(1, 4) GQA_CASE(2, 2) GQA_CASE(2, 4) GQA_CASE(3, 2) GQA_CASE(3, 4) GQA_CASE(4, 2)
    GQA_CASE(4, 4) GQA_CASE(6, 2) GQA_CASE(6, 4) GQA_CASE(8, 2) GQA_CASE(8, 4)
    // Head dim 256 (Gemma 3): G * hd must fit GQA_MAX_ELEMS.
    GQA_CASE(1, 8) GQA_CASE(2, 8) GQA_CASE(4, 8)
#undef GQA_CASE
}

#ifndef HARRIER_F32
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    u32 r;  // (one conversion for both: a to the upper half, b to the lower)
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return (u32)f2bf(lo) | ((u32)f2bf(hi) << 16);
#endif
}

// c += a (16x16 bf16, row-major fragments) * b (16x8 bf16, column fragments), fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Shared-memory addresses, mbarrier waits and distributed shared memory (clusters; sm_90).
__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ bool mbar_try_wait(u32 bar, u32 parity) {
    u32 ok;
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(ok)
        : "r"(bar), "r"(parity)
        : "memory");
    return ok != 0;
}
// The same with acquire at cluster scope (a barrier another block of the cluster arrives on).
__device__ __forceinline__ void mbar_wait_cluster(u32 bar, u32 parity) {
    u32 ok;
    do {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
            : "=r"(ok)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!ok);
}
// This block's shared address `a` in cluster block `rank` (distributed shared memory).
__device__ __forceinline__ u32 cluster_map(u32 a, u32 rank) {
    u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
    return r;
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    while (!mbar_try_wait(bar, parity)) {
    }
}

// Per-token attention with a KV head's G query heads in one block: block (x, kh, s) takes token x
// (tok_list[x] where the launch has a token list: unsplit launches only), split s (`split_tiles`,
// as paged_attention's), for heads kh G .. kh G + G - 1, so each K and V row is read once for the
// group. The per-head kernel reads it G times, and at batch 8 of the 1B its 256 blocks (two an
// SM) took ~13 us a layer on the path against ~2 us of K/V (docs/benchmarks.md, session 30).
// The block's warps (16, or 8 or 4 where more blocks than fit at 16 warps: kernels/src/lib.rs
// grp_warps) take the split's 16-key tiles round-robin (grp_tile): the scores of a tile on the
// tensor cores (K rows as mma.sync's A, q as B, kept in registers), the softmax in the mma's
// output layout, V by rows (HD / 8 lanes a row, a tile's loads at once) on FMAs; the warps merge
// at the end. The same outputs and partials as paged_attention up to the order of the score
// sums (P rounded to bf16 before P V, l from the unrounded P), so attention_combine merges its
// splits. bf16 only; G * HD at most GRP_MAX_ELEMS.
#define GRP_WARPS 16
#define GRP_MAX_ELEMS 512
#define GRP_MAX_G 4
struct GrpSmem {
    float m[GRP_WARPS][GRP_MAX_G], l[GRP_WARPS][GRP_MAX_G], w[GRP_WARPS][GRP_MAX_G], ML[GRP_MAX_G][2];
    float acc[GRP_WARPS][GRP_MAX_ELEMS];
};
// The cluster instances (`paged_attention_grpc*`): a token's splits of a KV head are one
// cluster (block x = split x = cluster rank, y the token, z the KV head), and ranks 1 .. S - 1
// push their split's (max, sum, weighted sums) into rank 0's `recv` with st.async, counted on
// rank 0's `bar`; rank 0 merges them as attention_combine would and writes the output. No
// partials in global memory and no attention_combine launch. At most GRP_CL_MAX splits
// (shared memory: 34 KB + 6 KB within the 48 KB of static shared memory).
#define GRP_CL_MAX 4
struct GrpCluster {
    float recv[GRP_CL_MAX - 1][GRP_MAX_ELEMS + 2 * GRP_MAX_G];  // a split's [G][HD + 2]: max, sum, dims
    unsigned long long bar;
};

// Element i (of head g) of the block's weighted sum: the warps' sums in shared memory, each
// weighed by its warp's exp(m_w - M) (warps without keys weigh 0), added in warp order.
__device__ __forceinline__ float grp_block_sum(const GrpSmem& sm, int i, int g) {
    float v = 0.0f;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) v += sm.acc[w][i] * sm.w[w][g];
    return v;
}

// The end of a cluster instance's block (see GrpCluster), its warps' sums merged in `sm`: ranks
// past 0 push their split's weighted sums and (max, sum) a head to rank 0 and leave; rank 0
// waits for the S - 1 pushes and writes head g's dims as sum_s e_s v_s / sum_s e_s l_s, e_s =
// exp(m_s - max) over the splits with keys (attention_combine's weights; a token of one split
// gets its own v / l, e = 1).
template <int G, int HD>
__device__ __forceinline__ void grp_cluster_merge(elem* o, int s, int n_splits, const GrpSmem& sm, GrpCluster& cl) {
    constexpr int GH = G * HD, ST = HD + 2;
    // Every rank started and rank 0's barrier initialised (the arrival was at the start).
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
    if (s != 0) {
        const u32 dst = cluster_map(smem_addr(cl.recv[s - 1]), 0), bar = cluster_map(smem_addr(&cl.bar), 0);
        for (int i = threadIdx.x; i < GH; i += blockDim.x) {
            const int g = i / HD, d = i - g * HD;
            const float v = grp_block_sum(sm, i, g);
            asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(
                             dst + 4u * (u32)(g * ST + 2 + d)),
                         "r"(__float_as_uint(v)), "r"(bar)
                         : "memory");
            if (d == 0)
                asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];" ::"r"(
                                 dst + 4u * (u32)(g * ST)),
                             "r"(__float_as_uint(sm.ML[g][0])), "r"(__float_as_uint(sm.ML[g][1])), "r"(bar)
                             : "memory");
        }
        return;
    }
    if (threadIdx.x == 0)
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(&cl.bar)),
                     "r"((u32)((n_splits - 1) * GH + 2 * G * (n_splits - 1)) * 4u)
                     : "memory");
    mbar_wait_cluster(smem_addr(&cl.bar), 0);
    for (int i = threadIdx.x; i < GH; i += blockDim.x) {
        const int g = i / HD, d = i - g * HD;
        const float v = grp_block_sum(sm, i, g);
        // Split r's (max, sum, dim d): attention_combine's arithmetic, so the output has its
        // bits (its sum of l e is a butterfly over lanes: (x0 + x2) + (x1 + x3) for 4 splits).
        float m[GRP_CL_MAX], l[GRP_CL_MAX], x[GRP_CL_MAX];
        m[0] = sm.ML[g][0];
        l[0] = sm.ML[g][1];
        x[0] = v;
#pragma unroll
        for (int r = 1; r < GRP_CL_MAX; r++) {
            const float* p = cl.recv[r - 1] + g * ST;
            m[r] = r < n_splits ? p[0] : NEG_INF;
            l[r] = r < n_splits ? p[1] : 0.0f;
            x[r] = r < n_splits ? p[2 + d] : 0.0f;
        }
        float M = NEG_INF;
#pragma unroll
        for (int r = 0; r < GRP_CL_MAX; r++) M = fmaxf(M, l[r] > 0.0f ? m[r] : NEG_INF);
        float e[GRP_CL_MAX], V = 0.0f;
#pragma unroll
        for (int r = 0; r < GRP_CL_MAX; r++) {
            e[r] = l[r] > 0.0f ? __expf(m[r] - M) : 0.0f;
            V += e[r] != 0.0f ? x[r] * e[r] : 0.0f;
        }
        static_assert(GRP_CL_MAX == 4, "the butterfly's order below");
        const float L = (l[0] * e[0] + l[2] * e[2]) + (l[1] * e[1] + l[3] * e[3]);
        o[i] = f2e(L > 0.0f ? V / L : 0.0f);
    }
}

// Measurement only (-DHARRIER_TRACE -DGRP_PHASE): the global time once `dep` is computed,
// and thread 0's phases of a grp block as three more trace records after its own (see
// grp_phase_write).
#if defined(HARRIER_TRACE) && defined(GRP_PHASE)
__device__ __forceinline__ u64 grp_stamp(float dep) {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : "f"(dep) : "memory");
    return t;
}
#define GRP_STAMP(i, dep) ph[i] = grp_stamp((float)(dep))
// Records (grid | k << 62, three times, 0, info, shape) for k = 1, 2, 3: the block's wait
// return and phases 1-2, phases 3-5, phases 6-8.
__device__ void grp_phase_write(unsigned int main_i, const u64* ph, u64 info) {
    if (main_i >= TRACE_CAP) return;
    const unsigned int j = atomicAdd(&harrier_trace_n, 3u);
    if (j + 3 > TRACE_CAP) return;
    u64 gid;
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(gid));
    const u64 t[9] = {harrier_trace[main_i][2], ph[1], ph[2], ph[3], ph[4], ph[5], ph[6], ph[7], ph[8]};
    for (int k = 0; k < 3; k++) {
        unsigned long long* r = harrier_trace[j + k];
        r[0] = gid | ((u64)(k + 1) << 62);
        r[1] = t[3 * k];
        r[2] = t[3 * k + 1];
        r[3] = t[3 * k + 2];
        r[4] = 0;
        r[5] = info;
        r[6] = harrier_trace[main_i][6];
    }
}
#else
#define GRP_STAMP(i, dep)
#endif

// One warp tile of grp_attention: 16 keys from key kbase (always valid; keys past pos read the
// last key's rows, their scores masked) of the token at pos through its block table bt, KV
// head kh; its running state in acc, m and lsum. K is the scores' mma operand A (skinny_gemm's
// tiles): lane (g8, t4) loads keys g8 and g8 + 8's 16 bytes at dims c * 32 + 8 t4, 8 rows' 64
// contiguous bytes an instruction (a key a lane, 32 rows' 16 bytes an instruction, took ~2.8 us
// of a 1B batch-8 block's ~8: session 37).
// C[key][head]: value r of lane (g8, t4) is key g8 + (r < 2 ? 0 : 8), head 2 t4 + (r & 1). V by
// rows (round r: key r KPR + grp, HD / 8 lanes a row) after the softmax: loaded with K it lost
// at batch 8 (session 37).
#if defined(HARRIER_TRACE) && defined(GRP_PHASE)
#define GRP_PH_PARAM , u64* ph
#define GRP_PH_ARG , ph
#else
#define GRP_PH_PARAM
#define GRP_PH_ARG
#endif
template <int G, int HD>
__device__ __forceinline__ void grp_tile(const AttnIn& a, const int* bt, int pos, int kh, int kbase, int next_kbase,
                                         const uint4 (&qf)[HD / 32], float (&acc)[G][8], float (&m)[G],
                                         float (&lsum)[2] GRP_PH_PARAM) {
    constexpr int NCH = HD / 32, LPK = HD / 8, KPR = 32 / LPK, VR = 16 / KPR;
    const int lane = threadIdx.x & 31, g8 = lane >> 2, t4 = lane & 3, grp = lane / LPK, sub = lane - grp * LPK;
    const int p = kbase + (lane & 15);
    const int pe = p <= pos ? p : pos;
    const int slot = bt[pe / a.block_size] * a.block_size + pe % a.block_size;
    // The warp's next tile (next_kbase >= 0: 4-warp blocks, see grp_attention): its K (lanes
    // 0-15) and V (lanes 16-31) rows pulled into L2 behind this tile's K loads.
    int next_slot = 0;
    if (next_kbase >= 0) {
        const int pn = min(next_kbase + (lane & 15), pos);
        next_slot = bt[pn / a.block_size] * a.block_size + pn % a.block_size;
    }
    GRP_STAMP(2, slot);
    const int sa = __shfl_sync(0xffffffffu, slot, g8), sb = __shfl_sync(0xffffffffu, slot, g8 + 8);
    const elem* pa = a.k_cache + ((size_t)sa * a.nkv + kh) * HD + 8 * t4;
    const elem* pb = a.k_cache + ((size_t)sb * a.nkv + kh) * HD + 8 * t4;
    uint4 ka[NCH], kb[NCH];
#pragma unroll
    for (int c = 0; c < NCH; c++) {
        ka[c] = *(const uint4*)(pa + c * 32);
        kb[c] = *(const uint4*)(pb + c * 32);
    }
    if (next_kbase >= 0) {
        const elem* row = (lane < 16 ? a.k_cache : a.v_cache) + ((size_t)next_slot * a.nkv + kh) * HD;
#pragma unroll
        for (int c = 0; c < HD; c += 64) prefetch_l2(row + c);  // (a 128-byte line each)
    }
    float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int c = 0; c < NCH; c++) {
        const u32 a1[4] = {ka[c].x, kb[c].x, ka[c].y, kb[c].y};
        const u32 a2[4] = {ka[c].z, kb[c].z, ka[c].w, kb[c].w};
        mma_bf16(sc, a1, qf[c].x, qf[c].y);
        mma_bf16(sc, a2, qf[c].z, qf[c].w);
    }
    GRP_STAMP(3, sc[0]);
    float tmax[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int r = 0; r < 4; r++) {
        sc[r] = kbase + g8 + (r < 2 ? 0 : 8) <= pos ? sc[r] * a.scale : NEG_INF;
        tmax[r & 1] = fmaxf(tmax[r & 1], sc[r]);
    }
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int x = 4; x < 32; x <<= 1) tmax[j] = fmaxf(tmax[j], __shfl_xor_sync(0xffffffffu, tmax[j], x));
    // Every head's new max in every lane (head g's from lane g / 2), and this lane's heads'.
    float corr[G], mj[2] = {0.0f, 0.0f}, cj[2] = {1.0f, 1.0f};
#pragma unroll
    for (int g = 0; g < G; g++) {
        const float mn = fmaxf(m[g], __shfl_sync(0xffffffffu, tmax[g & 1], g >> 1));
        corr[g] = __expf(m[g] - mn);
        m[g] = mn;
        if (t4 == (g >> 1)) {
            mj[g & 1] = mn;
            cj[g & 1] = corr[g];
        }
    }
    // P rounded to bf16 for P V (l sums the unrounded P).
    float pr[4], ls[2] = {0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < 4; r++) {
        const float pk = __expf(sc[r] - mj[r & 1]);
        ls[r & 1] += pk;
        pr[r] = rnd(pk);
    }
#pragma unroll
    for (int j = 0; j < 2; j++) lsum[j] = lsum[j] * cj[j] + ls[j];
#pragma unroll
    for (int g = 0; g < G; g++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[g][j] *= corr[g];
    GRP_STAMP(4, pr[0]);
    Chunk vr[VR];
#pragma unroll
    for (int r = 0; r < VR; r++) {
        const int si = __shfl_sync(0xffffffffu, slot, r * KPR + grp);
        vr[r] = ld_chunk(a.v_cache + ((size_t)si * a.nkv + kh) * HD + sub * 8);
    }
    // Key k's P for head g: value ((k >> 3) & 1) * 2 + (g & 1) in lane (k & 7) * 4 + g / 2 (the
    // same value index across a round's keys: KPR divides 8).
#pragma unroll
    for (int r = 0; r < VR; r++) {
        const int k0 = r * KPR;
        float v[8];
        unpack_chunk(vr[r], v);
#pragma unroll
        for (int g = 0; g < G; g++) {
            const float w =
                __shfl_sync(0xffffffffu, pr[((k0 >> 3) & 1) * 2 + (g & 1)], ((k0 + grp) & 7) * 4 + (g >> 1));
#pragma unroll
            for (int j = 0; j < 8; j++) acc[g][j] += w * v[j];
        }
    }
}

template <int G, int HD, bool CL>
__device__ __forceinline__ void grp_attention(const AttnIn& a, float* part, int n_splits, int one_split,
                                              const int* tok_list, GrpSmem& sm, GrpCluster* cl) {
    ATTN_UNPACK(a)
    (void)hd;
    constexpr int GH = G * HD, NCH = HD / 32, LPK = HD / 8;
    const int kh = CL ? blockIdx.z : blockIdx.y, s = CL ? blockIdx.x : blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    if constexpr (CL) {
        // Rank 0's barrier initialised before any rank pushes (the cluster barrier's wait, just
        // before the pushes; every rank arrives here, before the PDL wait).
        if (s == 0 && threadIdx.x == 0) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&cl->bar)) : "memory");
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        __syncthreads();
        asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    }
    PDL_ENTER();
    // (A token list: unsplit launches only, as the host checks.)
    const int t = CL ? blockIdx.y : tok_list ? tok_list[blockIdx.x] : blockIdx.x;
    // q as the scores' mma operand B (n = the group's heads, padded to 8): lane (g8, t4) holds
    // head g8's dims c * 32 + 8 t4 .. + 7 for each 32-dim chunk c, loaded with the token's
    // position rather than after it (a round trip fewer before the block table's).
    const int g8 = lane >> 2, t4 = lane & 3;
    uint4 qf[NCH];
#pragma unroll
    for (int c = 0; c < NCH; c++)
        qf[c] = g8 < G ? *(const uint4*)(q + (size_t)t * q_stride + (size_t)(kh * G + g8) * HD + c * 32 + 8 * t4)
                       : make_uint4(0, 0, 0, 0);
    const int pos = positions[t], row = tok_row[t];
#if defined(HARRIER_TRACE) && defined(GRP_PHASE)
    u64 ph[9] = {};
#endif
    GRP_STAMP(1, (float)qf[0].x + (float)pos + (float)row);
    int start, tile0, tile1;
    const int splits = split_tiles(pos, window, n_splits, one_split, s, &start, &tile0, &tile1);
    elem* o = out + ((size_t)t * nh + (size_t)kh * G) * HD;
    // Head g's partial of split s (paged_attention's layout: [token][head][split][HD + 2]).
    float* pp0 = CL ? nullptr : part + ((size_t)t * nh + (size_t)kh * G) * n_splits * (HD + 2);
    // No keys here (a split past the context, or padding). A cluster rank goes on without them:
    // its warps' sums are 0, so its weight in the merge is 0.
    if (!CL && tile0 >= tile1) {
        if (n_splits == 1) {
            for (int i = threadIdx.x; i < GH; i += blockDim.x) o[i] = f2e(0.0f);
        } else if (threadIdx.x < G) {
            float* pp = pp0 + ((size_t)threadIdx.x * n_splits + s) * (HD + 2);
            pp[0] = NEG_INF;
            pp[1] = 0.0f;
        }
        return;
    }
    // m: every head's running max (the same in every lane); lsum[j]: the running sum of this
    // lane's own keys for head 2 t4 + j (added over the lanes at the end).
    float acc[G][8], m[G], lsum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int g = 0; g < G; g++) {
        m[g] = NEG_INF;
#pragma unroll
        for (int j = 0; j < 8; j++) acc[g][j] = 0.0f;
    }
    // The split's 16-key tiles up to the last with a key, round-robin over the warps: at batch 4 of
    // the 1B 11-12 of 16 warps busy rather than 6 with 32-key tiles (H200, session 37, ms a
    // step, 32- vs 16-key tiles: 1B batch 4 0.931-0.940 vs 0.914-0.918, 3B 2.260-2.278 vs
    // 2.227-2.239, batch 16 2.98 vs 2.87; at batch 8, 17-18 tiles of 32 over two splits, 32-key
    // tiles tie on the 1B and 3B and win 1.5% on Qwen3-0.6B, but a kernel with both loops was
    // slower on the 1B).
    const int* bt = block_tables + (size_t)row * bt_stride;
    const int u1 = min(2 * tile1, ((pos - start) >> 4) + 1);
    // 4-warp blocks (many tokens: 8 rounds a warp at 512 keys; never the 16-warp cluster
    // instances) pull each next tile into L2 behind the current one's K loads. H200, session
    // 38, ms a step, without / with (every width): 1B batch 64 1.575-1.577 / 1.561-1.565, 128
    // 2.085-2.091 / 2.062, 256 3.182-3.193 / 3.114-3.118; wider blocks lost or tied (16 warps:
    // batch 16 1.242-1.246 / 1.252-1.253; 8: batch 32 1.353-1.355 / 1.359-1.362). With this
    // rule (another machine): 64 1.593-1.606 / 1.580-1.587, 256 3.252-3.270 / 3.217-3.251,
    // 16 1.241-1.252 / 1.236-1.237.
    const bool pf_next = !CL && nw == 4;
    for (int u = 2 * tile0 + warp; u < u1; u += nw) {
        const int next = pf_next && u + nw < u1 ? start + (u + nw) * 16 : -1;
        grp_tile<G, HD>(a, bt, pos, kh, start + u * 16, next, qf, acc, m, lsum GRP_PH_ARG);
    }
    GRP_STAMP(5, acc[0][0]);
    // Head 2 t4 + j's sum over the keys: the 8 lanes g8 of each t4.
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int x = 4; x < 32; x <<= 1) lsum[j] += __shfl_xor_sync(0xffffffffu, lsum[j], x);
    // The lane groups' sums (LPK divides 32): lanes 0 .. LPK - 1 then hold dims 8 lane ...
#pragma unroll
    for (int g = 0; g < G; g++) {
#pragma unroll
        for (int x = LPK; x < 32; x <<= 1)
#pragma unroll
            for (int j = 0; j < 8; j++) acc[g][j] += __shfl_xor_sync(0xffffffffu, acc[g][j], x);
        if (lane < LPK)
#pragma unroll
            for (int j = 0; j < 8; j++) sm.acc[warp][g * HD + lane * 8 + j] = acc[g][j];
        if (lane == 0) sm.m[warp][g] = m[g];
        if (lane == (g >> 1)) sm.l[warp][g] = lsum[g & 1];
    }
    __syncthreads();
    GRP_STAMP(6, 0);
    // Warp g weighs the warps' partial sums of head g (lane w: warp w); a warp without keys
    // has sum 0 and weight 0 (its acc is zeros).
    if (warp < G) {
        const float mw = lane < nw ? sm.m[lane][warp] : NEG_INF, lw = lane < nw ? sm.l[lane][warp] : 0.0f;
        const float M = warp_max(lw > 0.0f ? mw : NEG_INF);
        const float e = lw > 0.0f ? __expf(mw - M) : 0.0f;
        const float L = warp_sum(lw * e);
        if (lane < nw) sm.w[lane][warp] = e;
        if (lane == 0) {
            sm.ML[warp][0] = M;
            sm.ML[warp][1] = L;
        }
    }
    __syncthreads();
    GRP_STAMP(7, 0);
    if constexpr (CL) {
        (void)splits;
        grp_cluster_merge<G, HD>(o, s, n_splits, sm, *cl);
#if defined(HARRIER_TRACE) && defined(GRP_PHASE)
        GRP_STAMP(8, 0);
        if (threadIdx.x == 0) grp_phase_write(trace_scope_.i, ph, (u64)s | (u64)tile0 << 8 | (u64)tile1 << 20);
#endif
    } else {
        for (int i = threadIdx.x; i < GH; i += blockDim.x) {
            const int g = i / HD, d = i - g * HD;
            const float v = grp_block_sum(sm, i, g);
            const float M = sm.ML[g][0], L = sm.ML[g][1];
            attn_store(o, i, pp0 + ((size_t)g * n_splits + s) * (HD + 2), d, v, M, L, splits, n_splits);
        }
    }
}

// One 16-warp block an SM at most (34 KB of shared memory): at most 128 registers (two 8-warp
// blocks, four of 4; GRP_WARPS sizes the shared arrays, the widest block). An entry
// point a head dim, each with its own registers (one for both spilled the head dim 64 cases).
#define GRP_CASE(g, d, cl)                                                           \
    if (G == g) {                                                                    \
        grp_attention<g, d, cl>(a, part, n_splits, one_split, tok_list, sm, grp_cl); \
        return;                                                                      \
    }
#define GRP_PARAMS AttnIn a, float *part, int n_splits, int one_split, const int *tok_list
#define GRP_BODY(d, cl, cl_sm)           \
    __shared__ __align__(16) GrpSmem sm; \
    GrpCluster* const grp_cl = (cl_sm);  \
    const int G = a.nh / a.nkv;          \
    GRP_CASE(1, d, cl) GRP_CASE(2, d, cl) GRP_CASE(3, d, cl) GRP_CASE(4, d, cl)
extern "C" __global__ void __launch_bounds__(GRP_WARPS * 32, 1) paged_attention_grp64(GRP_PARAMS) { GRP_BODY(64, false, nullptr) }
extern "C" __global__ void __launch_bounds__(GRP_WARPS * 32, 1) paged_attention_grp128(GRP_PARAMS) { GRP_BODY(128, false, nullptr) }
// Launched in clusters of n_splits (2 .. GRP_CL_MAX) blocks along x; `part` unused.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define GRP_CL_BODY(d)                             \
    __shared__ __align__(16) GrpCluster cl_shared; \
    GRP_BODY(d, true, &cl_shared)
#else
#define GRP_CL_BODY(d) __trap();  // (clusters: sm_90 on; the host never launches these before)
#endif
extern "C" __global__ void __launch_bounds__(GRP_WARPS * 32, 1) paged_attention_grpc64(GRP_PARAMS) { GRP_CL_BODY(64) }
extern "C" __global__ void __launch_bounds__(GRP_WARPS * 32, 1) paged_attention_grpc128(GRP_PARAMS) { GRP_CL_BODY(128) }
#undef GRP_CL_BODY
#undef GRP_BODY
#undef GRP_PARAMS
#undef GRP_CASE
#endif

// Merges paged_attention's splits of token t, head h (block (t, h), one thread a dim), in split
// order; splits with no keys (sum 0) are skipped. At most 32 splits: warp 0 reads every
// split's (max, sum) at once (lane s: split s) and leaves their weights in shared memory while
// each thread reads its dim of up to 8 splits' sums, all loads in flight together. The loop
// this replaced read them split after split under a branch, one L2 round trip each: 4.8 us
// after its wait for 8 splits at batch 1 (H100 trace, session 15).
#define COMBINE_MAX_SPLITS 32
//
// Unlike every other kernel it lets the next launch (the o projection) be scheduled before its
// own wait: a dependent grid takes ~3 us from the trigger to its first block, which this short
// launch no longer hides (H100 trace: o's blocks started 1.6 us after the combine ended).
// Correct because the next launch still waits for this one's completion before reading
// anything this launch or attention writes, and what it reads before its wait (weights, the
// residual the previous layer's down projection wrote) is complete once q|k|v has passed its
// wait. Measured (H100, session 15): 1B 1.190 -> 1.173 ms at batch 1, 1.322 -> 1.307 at 4, 3B
// 2.944 -> 2.921. `-DCOMBINE_LATE_TRIGGER` restores the usual order, to compare.
extern "C" __global__ void attention_combine(elem* out, const float* part, int n_splits, int nh, int hd) {
#ifndef COMBINE_LATE_TRIGGER
    PDL_ENTER_TRIGGER_FIRST();
#else
    PDL_ENTER();
#endif
    __shared__ float w_sh[COMBINE_MAX_SPLITS];
    __shared__ float l_sh;
    const int t = blockIdx.x, h = blockIdx.y, stride = hd + 2;
    const float* p = part + ((size_t)t * nh + h) * n_splits * stride;
    if (threadIdx.x < 32) {
        const int s = threadIdx.x;
        float m = NEG_INF, l = 0.0f;
        if (s < n_splits) {
            m = p[s * stride];
            l = p[s * stride + 1];
        }
        // Sum -1 in split 0: one split, paged_attention wrote the output (l_sh < 0: return).
        const float l0 = __shfl_sync(0xffffffffu, l, 0);
        const float M = warp_max(l > 0.0f ? m : NEG_INF);
        const float e = l > 0.0f ? __expf(m - M) : 0.0f;
        const float L = warp_sum(l * e);
        w_sh[s] = e;
        if (s == 0) l_sh = l0 < 0.0f ? -1.0f : L;
    }
    const int d = threadIdx.x;
    float x[8];
#pragma unroll
    for (int j = 0; j < 8; j++) x[j] = d < hd && j < n_splits ? p[j * stride + 2 + d] : 0.0f;
    __syncthreads();
    const float L = l_sh;
    if (L < 0.0f || d >= hd) return;
    // Splits without keys have weight 0 (their values were never written). The first 8
    // splits' sums are added apart from the rest: one loop with the first loads hoisted
    // measured slower (H100, session 16 review: 1B batch 4 1.290 -> 1.301 ms).
    float v = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; j++) v += w_sh[j] != 0.0f ? x[j] * w_sh[j] : 0.0f;
    for (int s0 = 8; s0 < n_splits; s0 += 8) {
#pragma unroll
        for (int j = 0; j < 8; j++) x[j] = s0 + j < n_splits ? p[(s0 + j) * stride + 2 + d] : 0.0f;
#pragma unroll
        for (int j = 0; j < 8; j++) v += s0 + j < n_splits && w_sh[s0 + j] != 0.0f ? x[j] * w_sh[s0 + j] : 0.0f;
    }
    out[((size_t)t * nh + h) * hd + d] = f2e(L > 0.0f ? v / L : 0.0f);
}

// ---------------------------------------------------------------------------------------------
// Tiled causal attention for prefill chunks (bf16 only: tensor-core mma.sync m16n8k16, sm_80+).
// Block (tile, h): the tile's tokens tiles[2 tile] .. + tiles[2 tile + 1] (at most PF_QT) are
// consecutive tokens of one sequence at consecutive positions (the host cuts them so); query
// head h. Each of the PF_WARPS warps owns 16 query rows. The block walks the keys
// [start, last query position] in tiles of KT keys (64; 32 at head dim 256, for shared memory):
// the tile's K rows and V rows (transposed)
// go to shared memory once for all 64 queries; each warp computes S = Q K^T with mma, masks
// causally (and by the sliding window), runs the online softmax in fp32 on the accumulator
// fragments, rounds P to bf16 (the A operand of O += P V, as FlashAttention) and accumulates O
// in fp32. l sums the unrounded P. Head dims 64, 128 and 256 (the host uses paged_attention
// for others). The per-token kernel reads every key once per query token; this one once per 64.
#ifndef HARRIER_F32
#define PF_WARPS 4
#define PF_QT (16 * PF_WARPS)

template <int HD, int KT>
__device__ __forceinline__ void prefill_attention_tile(bf16* out, const bf16* q, int q_stride, const bf16* k_cache,
                                                       const bf16* v_cache, const int* tiles, const int* tok_row,
                                                       const int* positions, const int* block_tables, int bt_stride,
                                                       int nh, int nkv, int block_size, float scale, int window,
                                                       unsigned char* smem) {
    // Shared memory: K rows [KT][HD + 8], V transposed [HD][KT + 8], the tile's slots [KT].
    bf16 (*sK)[HD + 8] = (bf16 (*)[HD + 8])smem;
    bf16 (*sVt)[KT + 8] = (bf16 (*)[KT + 8])(smem + sizeof(bf16) * KT * (HD + 8));
    int* sSlot = (int*)(smem + sizeof(bf16) * (KT * (HD + 8) + HD * (KT + 8)));
    const int tile = blockIdx.x, h = blockIdx.y;
    const int kh = h / (nh / nkv);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, tg = lane & 3;
    const int t0 = tiles[2 * tile], cnt = tiles[2 * tile + 1];
    const int row = tok_row[t0];
    const int pos0 = positions[t0];
    const int last = pos0 + cnt - 1;
    const int* bt = block_tables + (size_t)row * bt_stride;
    const int qa = warp * 16 + g, qb = qa + 8;  // this lane's two query rows
    const bool va = qa < cnt, vb = qb < cnt;
    const int pa = pos0 + qa, pb = pos0 + qb;
    const bool warp_active = warp * 16 < cnt;
    const int warp_last = min(pos0 + warp * 16 + 15, last);
    // Q as A fragments (k = head dim), rows past the tile zero.
    u32 qf[HD / 16][4];
    {
        const bf16* ra = q + (size_t)(t0 + (va ? qa : 0)) * q_stride + (size_t)h * HD;
        const bf16* rb = q + (size_t)(t0 + (vb ? qb : 0)) * q_stride + (size_t)h * HD;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            int c = kk * 16 + tg * 2;
            qf[kk][0] = va ? *(const u32*)(ra + c) : 0u;
            qf[kk][1] = vb ? *(const u32*)(rb + c) : 0u;
            qf[kk][2] = va ? *(const u32*)(ra + c + 8) : 0u;
            qf[kk][3] = vb ? *(const u32*)(rb + c + 8) : 0u;
        }
    }
    float o[HD / 8][4];
#pragma unroll
    for (int i = 0; i < HD / 8; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float ma = NEG_INF, mb = NEG_INF, la = 0.0f, lb = 0.0f;
    const int kstart = window > 0 ? max(0, pos0 - window + 1) : 0;
    for (int kb = kstart; kb <= last; kb += KT) {
        __syncthreads();  // the previous tile is consumed
        if (threadIdx.x < KT) {
            int p = kb + threadIdx.x;
            sSlot[threadIdx.x] = p <= last ? bt[p / block_size] * block_size + p % block_size : -1;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < KT * (HD / 8); i += blockDim.x) {
            int key = i / (HD / 8), c = (i % (HD / 8)) * 8;
            int slot = sSlot[key];
            uint4 kv = make_uint4(0u, 0u, 0u, 0u), vv = make_uint4(0u, 0u, 0u, 0u);
            if (slot >= 0) {
                kv = *(const uint4*)(k_cache + ((size_t)slot * nkv + kh) * HD + c);
                vv = *(const uint4*)(v_cache + ((size_t)slot * nkv + kh) * HD + c);
            }
            *(uint4*)&sK[key][c] = kv;
            const bf16* vp = (const bf16*)&vv;
#pragma unroll
            for (int j = 0; j < 8; j++) sVt[c + j][key] = vp[j];
        }
        __syncthreads();
        // Warp-uniform skips: no queries, or every key after the warp's last query, or (window)
        // every key before its first query's window.
        if (!warp_active || kb > warp_last) continue;
        if (window > 0 && kb + KT - 1 < pos0 + warp * 16 - window + 1) continue;
        float sc[KT / 8][4];
#pragma unroll
        for (int nb = 0; nb < KT / 8; nb++) {
            sc[nb][0] = sc[nb][1] = sc[nb][2] = sc[nb][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                const bf16* kr = &sK[nb * 8 + g][kk * 16 + tg * 2];
                mma_bf16(sc[nb], qf[kk], *(const u32*)kr, *(const u32*)(kr + 8));
            }
        }
        float mxa = NEG_INF, mxb = NEG_INF;
#pragma unroll
        for (int nb = 0; nb < KT / 8; nb++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                int kp = kb + nb * 8 + tg * 2 + e;
                bool oka = va && kp <= pa && (window <= 0 || kp > pa - window);
                bool okb = vb && kp <= pb && (window <= 0 || kp > pb - window);
                float x = oka ? sc[nb][e] * scale : NEG_INF;
                float y = okb ? sc[nb][2 + e] * scale : NEG_INF;
                sc[nb][e] = x;
                sc[nb][2 + e] = y;
                mxa = fmaxf(mxa, x);
                mxb = fmaxf(mxb, y);
            }
        }
        mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 1));
        mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 2));
        mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 1));
        mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 2));
        float mna = fmaxf(ma, mxa), mnb = fmaxf(mb, mxb);
        float ca = mna == NEG_INF ? 1.0f : __expf(ma - mna);
        float cb = mnb == NEG_INF ? 1.0f : __expf(mb - mnb);
        float sa = 0.0f, sb = 0.0f;
#pragma unroll
        for (int nb = 0; nb < KT / 8; nb++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float x = sc[nb][e] == NEG_INF ? 0.0f : __expf(sc[nb][e] - mna);
                float y = sc[nb][2 + e] == NEG_INF ? 0.0f : __expf(sc[nb][2 + e] - mnb);
                sc[nb][e] = x;
                sc[nb][2 + e] = y;
                sa += x;
                sb += y;
            }
        }
        sa += __shfl_xor_sync(0xffffffffu, sa, 1);
        sa += __shfl_xor_sync(0xffffffffu, sa, 2);
        sb += __shfl_xor_sync(0xffffffffu, sb, 1);
        sb += __shfl_xor_sync(0xffffffffu, sb, 2);
        la = la * ca + sa;
        lb = lb * cb + sb;
        ma = mna;
        mb = mnb;
#pragma unroll
        for (int i = 0; i < HD / 8; i++) {
            o[i][0] *= ca;
            o[i][1] *= ca;
            o[i][2] *= cb;
            o[i][3] *= cb;
        }
        // P (accumulator layout of two key blocks) is the A fragment of one k-step.
#pragma unroll
        for (int kk = 0; kk < KT / 16; kk++) {
            u32 pf[4] = {pack_bf16(sc[2 * kk][0], sc[2 * kk][1]), pack_bf16(sc[2 * kk][2], sc[2 * kk][3]),
                         pack_bf16(sc[2 * kk + 1][0], sc[2 * kk + 1][1]), pack_bf16(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
            for (int i = 0; i < HD / 8; i++) {
                const bf16* vr = &sVt[i * 8 + g][kk * 16 + tg * 2];
                mma_bf16(o[i], pf, *(const u32*)vr, *(const u32*)(vr + 8));
            }
        }
    }
    float ia = la > 0.0f ? 1.0f / la : 0.0f, ib = lb > 0.0f ? 1.0f / lb : 0.0f;
#pragma unroll
    for (int i = 0; i < HD / 8; i++) {
        int d = i * 8 + tg * 2;
        if (va) *(u32*)(out + ((size_t)(t0 + qa) * nh + h) * HD + d) = pack_bf16(o[i][0] * ia, o[i][1] * ia);
        if (vb) *(u32*)(out + ((size_t)(t0 + qb) * nh + h) * HD + d) = pack_bf16(o[i][2] * ib, o[i][3] * ib);
    }
}

// Bytes of one instance's shared memory; the kernel's buffer is the largest (HD 256 takes
// 32-key tiles so that it fits the 48 KB of static shared memory).
#define PF_SMEM(HD, KT) (2 * ((KT) * ((HD) + 8) + (HD) * ((KT) + 8)) + 4 * (KT))
#define PF_SMEM_MAX (PF_SMEM(256, 32) > PF_SMEM(128, 64) ? PF_SMEM(256, 32) : PF_SMEM(128, 64))

extern "C" __global__ void prefill_attention(AttnIn a, const int* tiles) {
    PDL_ENTER();
    ATTN_UNPACK(a)
    __shared__ __align__(16) unsigned char smem[PF_SMEM_MAX];
    if (hd == 64)
        prefill_attention_tile<64, 64>(out, q, q_stride, k_cache, v_cache, tiles, tok_row, positions, block_tables,
                                       bt_stride, nh, nkv, block_size, scale, window, smem);
    else if (hd == 128)
        prefill_attention_tile<128, 64>(out, q, q_stride, k_cache, v_cache, tiles, tok_row, positions, block_tables,
                                        bt_stride, nh, nkv, block_size, scale, window, smem);
    else
        prefill_attention_tile<256, 32>(out, q, q_stride, k_cache, v_cache, tiles, tok_row, positions, block_tables,
                                        bt_stride, nh, nkv, block_size, scale, window, smem);
}
#endif  // HARRIER_F32

// ---------------------------------------------------------------------------------------------
// Row state for sampling. A row init (written by the host into the slot's metadata) is
// scattered into the per-row device arrays in stream order, before the step that uses it.
#define MASK_CAP 16
struct RowParams {
    float temperature;
    float top_p;
    float min_p;
    int top_k;          // <= 0: off
    u32 seed_lo, seed_hi;
    u32 generated;      // draws so far (the Philox counter of the next draw)
    u32 min_tokens;
    int host_sampled;   // 1: sampled on the host (logprobs); the kernel skips the row
    int penalties;      // 1: the row's seen bits and output counts are kept (init_row_state)
    int n_bias;         // logit_bias entries of the row (init_row_state)
    float repetition_penalty;  // 1: off
    float frequency_penalty;
    float presence_penalty;
    int mask_len;
    int mask[MASK_CAP];
};

extern "C" __global__ void apply_row_inits(RowParams* rows, const RowParams* inits, const int* init_rows, int n) {
    PDL_ENTER();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) rows[init_rows[i]] = inits[i];
}

// Sampling state of rows with penalties or logit_bias, on the device so that the host stays off
// the path between two steps: `seen` ([max_rows][ceil(vocab / 32)] bits: prompt tokens),
// `counts` ([max_rows][vocab], output-token counts saturating at 65535, bumped by
// sample_tokens) and the logit_bias entries (`bias_ids` / `bias_vals`, [max_rows][BIAS_CAP];
// RowParams.n_bias of them). init_row_state resets row rows[i] (block i) from its init: clears
// counts and bits, sets the bits of its prompt tokens data[offs[3i], offs[3i+1]), counts its
// earlier output tokens (a resumed request) data[offs[3i+1], offs[3i+2]), and copies its
// (token, f32 bits) bias pairs data[offs[3i+2], offs[3i+3]).
#define BIAS_CAP 1024
extern "C" __global__ void init_row_state(unsigned short* counts, u32* seen, int* bias_ids, float* bias_vals,
                                          int vocab, const int* rows, const int* offs, const int* data) {
    PDL_ENTER();
    int row = rows[blockIdx.x];
    int words = (vocab + 31) >> 5;
    unsigned short* c = counts + (size_t)row * vocab;
    u32* sb = seen + (size_t)row * words;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) c[i] = 0;
    for (int i = threadIdx.x; i < words; i += blockDim.x) sb[i] = 0;
    __syncthreads();
    const int* o = offs + 3 * blockIdx.x;
    int p0 = o[0], p1 = o[1], b0 = o[2], b1 = o[3];
    for (int i = p0 + threadIdx.x; i < p1; i += blockDim.x) {
        int tok = data[i];
        if (tok >= 0 && tok < vocab) atomicOr(&sb[tok >> 5], 1u << (tok & 31));
    }
    int nb = min((b1 - b0) >> 1, BIAS_CAP);
    for (int i = threadIdx.x; i < nb; i += blockDim.x) {
        bias_ids[(size_t)row * BIAS_CAP + i] = data[b0 + 2 * i];
        bias_vals[(size_t)row * BIAS_CAP + i] = __int_as_float(data[b0 + 2 * i + 1]);
    }
    if (threadIdx.x == 0) {  // one thread: counts are 16-bit (rare path: a resumed request)
        for (int i = p1; i < b0; i++) {
            int tok = data[i];
            if (tok >= 0 && tok < vocab && c[tok] < 65535) c[tok]++;
        }
    }
}

// Philox4x32-10 (Random123), as engine-core/src/sampling/philox.rs.
__device__ void philox4x32_10(u32 c[4], u32 k0, u32 k1) {
    const u32 M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
    for (int r = 0; r < 10; r++) {
        if (r > 0) {
            k0 += W0;
            k1 += W1;
        }
        u64 p0 = (u64)M0 * c[0], p1 = (u64)M1 * c[2];
        u32 n0 = (u32)(p1 >> 32) ^ c[1] ^ k0, n1 = (u32)p1, n2 = (u32)(p0 >> 32) ^ c[3] ^ k1, n3 = (u32)p0;
        c[0] = n0;
        c[1] = n1;
        c[2] = n2;
        c[3] = n3;
    }
}

__device__ double philox_uniform(u32 seed_lo, u32 seed_hi, u64 position) {
    u32 c[4] = {(u32)position, (u32)(position >> 32), 0u, 0u};
    philox4x32_10(c, seed_lo, seed_hi);
    u64 bits = (((u64)c[0]) << 21) ^ (((u64)c[1]) >> 11);
    return ((double)(bits & ((1ull << 53) - 1)) + 0.5) / 9007199254740992.0;
}

// Order-preserving float -> u32 key.
__device__ __forceinline__ u32 fkey(float f) {
    u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// (best, bi) of the whole warp in every lane: the largest value, ties to the lowest index.
__device__ __forceinline__ void warp_argmax(float& best, int& bi) {
    for (int o = 16; o > 0; o >>= 1) {
        float ob = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ob > best || (ob == best && oi < bi)) {
            best = ob;
            bi = oi;
        }
    }
}

// (max, lowest index of it) of v[lo..hi) over the block, returned to every thread; NaN
// never wins; nothing above -inf gives (-inf, 0x7fffffff).
__device__ void block_argmax_range(const float* v, int lo, int hi, float* shv, int* shi, float& best_out,
                                   int& bi_out) {
    float best = NEG_INF;
    int bi = 0x7fffffff;
    // Unrolled so that 8 loads are in flight per thread: one block scanning a whole 128k
    // vocabulary with one dependent load at a time took 52 us.
#pragma unroll 8
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float x = v[i];
        if (x > best || (x == best && i < bi)) {
            best = x;
            bi = i;
        }
    }
    warp_argmax(best, bi);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) {
        shv[warp] = best;
        shi[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        best = lane < nw ? shv[lane] : NEG_INF;
        bi = lane < nw ? shi[lane] : 0x7fffffff;
        warp_argmax(best, bi);
        if (lane == 0) {
            shv[0] = best;
            shi[0] = bi;
        }
    }
    __syncthreads();
    best_out = shv[0];
    bi_out = shi[0];
    __syncthreads();
}

// Argmax over v[0..n), ties to the lowest index, NaN never wins.
__device__ int block_argmax(const float* v, int n, float* shv, int* shi) {
    float best;
    int bi;
    block_argmax_range(v, 0, n, shv, shi, best, bi);
    return bi == 0x7fffffff ? 0 : bi;
}

// Greedy rows without logit changes (no logit_bias, penalties or min_tokens mask) take their
// argmax from ARGMAX_PARTS partial maxima per logits row, each over a slice of the vocabulary
// scanned by its own block (row_argmax_parts): one block scanning a 128k vocabulary alone
// took 52 us on the H100.
#define ARGMAX_PARTS 32
struct ArgPart {
    float v;
    int i;
};

// parts[r][p] = (max, lowest index of it) of logits row r over slice p of ARGMAX_PARTS (NaN
// never wins). grid (rows, ARGMAX_PARTS), any multiple of 32 threads up to 1,024 (the host's
// argmax_threads: 1,024 while the launch is one wave of such blocks, 8 rows on an H200, else 256).
extern "C" __global__ void __launch_bounds__(1024) row_argmax_parts(const float* logits, int vocab, ArgPart* parts) {
    PDL_ENTER();
    __shared__ float shv[32];
    __shared__ int shi[32];
    int r = blockIdx.x, p = blockIdx.y;
    int chunk = (vocab + ARGMAX_PARTS - 1) / ARGMAX_PARTS;
    int lo = p * chunk, hi = min(vocab, lo + chunk);
    float best;
    int bi;
    block_argmax_range(logits + (size_t)r * vocab, lo, hi, shv, shi, best, bi);
    if (threadIdx.x == 0) parts[(size_t)r * ARGMAX_PARTS + p] = ArgPart{best, bi};
}

// Shared scratch of the sampling functions below (one per block).
struct SampleShared {
    float f[32];
    int i[32];
    double d[32];
    double chunk_prefix[1024];
    int found;
};

// Processes row `row`'s logits lg[0..vocab) in place for its draw number `gen` (the Philox
// counter and the min_tokens test), in the CPU sampler's order: logit_bias; penalties
// (repetition over prompt and output tokens, HF's divide-or-multiply; then frequency and
// presence over output counts; the same float operations, unfused, as the CPU sampler);
// min_tokens mask; then greedy argmax, or temperature, top-k, softmax, top-p and min-p.
// Returns the token when the choice is already made (greedy rows, or nothing left above -inf),
// else -1 with lg holding the kept unnormalised probabilities (dropped tokens 0).
// blockDim.x = 1024; every thread returns the same value.
__device__ int process_logits(float* lg, int vocab, const RowParams* rp, int row, u32 gen,
                              const unsigned short* counts, const u32* seen, const int* bias_ids,
                              const float* bias_vals, const ArgPart* parts, SampleShared& sh) {
    if (parts && rp->temperature < 1e-5f && rp->n_bias == 0 && !rp->penalties &&
        !(gen < rp->min_tokens && rp->mask_len > 0)) {
        // The row's logits are unchanged: combine its partial maxima (ties: lowest index).
        __syncthreads();
        if (threadIdx.x < 32) {
            ArgPart a = parts[threadIdx.x];
            float best = a.v;
            int bi = a.i;
            warp_argmax(best, bi);
            if (threadIdx.x == 0) sh.i[0] = bi == 0x7fffffff ? 0 : bi;
        }
        __syncthreads();
        return sh.i[0];
    }
    if (rp->n_bias > 0) {  // distinct ids (a JSON map)
        const int* ids = bias_ids + (size_t)row * BIAS_CAP;
        const float* vals = bias_vals + (size_t)row * BIAS_CAP;
        __syncthreads();
        for (int i = threadIdx.x; i < min(rp->n_bias, BIAS_CAP); i += blockDim.x) {
            int id = ids[i];
            if (id >= 0 && id < vocab) lg[id] = __fadd_rn(lg[id], vals[i]);
        }
        __syncthreads();
    }
    if (rp->penalties) {
        const unsigned short* c = counts + (size_t)row * vocab;
        const u32* sb = seen + (size_t)row * ((vocab + 31) >> 5);
        float rep = rp->repetition_penalty, fp = rp->frequency_penalty, pp = rp->presence_penalty;
        __syncthreads();
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            u32 n = c[i];
            bool prompt = (sb[i >> 5] >> (i & 31)) & 1u;
            if (n == 0 && !prompt) continue;
            float l = lg[i];
            if (rep != 1.0f) l = l > 0.0f ? __fdiv_rn(l, rep) : __fmul_rn(l, rep);
            if (n > 0) l = __fsub_rn(l, __fadd_rn(__fmul_rn(fp, (float)n), pp));
            lg[i] = l;
        }
        __syncthreads();
    }
    if (gen < rp->min_tokens) {
        __syncthreads();
        if (threadIdx.x < rp->mask_len && threadIdx.x < MASK_CAP) {
            int m = rp->mask[threadIdx.x];
            if (m >= 0 && m < vocab) lg[m] = NEG_INF;
        }
        __syncthreads();
    }
    float temp = rp->temperature;
    if (temp < 1e-5f) return block_argmax(lg, vocab, sh.f, sh.i);
    float inv_t = 1.0f / temp;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) lg[i] *= inv_t;
    __syncthreads();
    int topk = rp->top_k;
    if (topk > 0 && topk < vocab) {
        // Largest key u with count(key >= u) >= k: the k-th largest value.
        u32 ans = 0;
        for (int bit = 31; bit >= 0; bit--) {
            u32 cand = ans | (1u << bit);
            float c = 0.0f;
            for (int i = threadIdx.x; i < vocab; i += blockDim.x) c += fkey(lg[i]) >= cand ? 1.0f : 0.0f;
            c = block_sum(c, sh.f);
            if (c >= (float)topk) ans = cand;
        }
        for (int i = threadIdx.x; i < vocab; i += blockDim.x)
            if (fkey(lg[i]) < ans) lg[i] = NEG_INF;
        __syncthreads();
    }
    float mx = NEG_INF;
#pragma unroll 8
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) mx = fmaxf(mx, lg[i]);
    mx = block_max(mx, sh.f);
    if (mx == NEG_INF) return block_argmax(lg, vocab, sh.f, sh.i);
    double sum = 0.0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float p = expf(lg[i] - mx);
        lg[i] = p;
        sum += (double)p;
    }
    sum = block_sum(sum, sh.d);
    if (rp->top_p < 1.0f) {
        // Keep the largest probabilities whose sum reaches top_p * sum: the largest key u with
        // S(key >= u) >= target, then drop everything below it (ties at the threshold are all
        // kept).
        double target = (double)rp->top_p * sum;
        u32 ans = 0;
        for (int bit = 31; bit >= 0; bit--) {
            u32 cand = ans | (1u << bit);
            double s = 0.0;
            for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
                float p = lg[i];
                if (p > 0.0f && fkey(p) >= cand) s += (double)p;
            }
            s = block_sum(s, sh.d);
            if (s >= target) ans = cand;
        }
        for (int i = threadIdx.x; i < vocab; i += blockDim.x)
            if (fkey(lg[i]) < ans) lg[i] = 0.0f;
        __syncthreads();
    }
    if (rp->min_p > 0.0f) {
        float th = rp->min_p;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x)
            if (lg[i] < th) lg[i] = 0.0f;
    }
    __syncthreads();
    return -1;
}

// Draws a token from the unnormalised weights w[0..n) (>= 0) with the uniform u: inverse CDF
// in token-id order (contiguous chunks per thread, a prefix over the chunks); rounding that
// runs past the end takes the last token with weight. Every thread returns the token.
__device__ int block_draw(const float* w, int n, double u, SampleShared& sh) {
    int chunk = (n + blockDim.x - 1) / blockDim.x;
    int lo = threadIdx.x * chunk, hi = min(n, lo + chunk);
    double cs = 0.0;
    int last = -1;
    for (int i = lo; i < hi; i++) {
        float p = w[i];
        if (p > 0.0f) {
            cs += (double)p;
            last = i;
        }
    }
    __syncthreads();
    sh.chunk_prefix[threadIdx.x] = cs;
    if (threadIdx.x == 0) sh.found = (int)0x80000000;
    __syncthreads();
    if (threadIdx.x == 0) {
        double acc = 0.0;
        for (int j = 0; j < blockDim.x; j++) {
            double v = sh.chunk_prefix[j];
            sh.chunk_prefix[j] = acc;
            acc += v;
        }
        sh.d[0] = acc;
    }
    __syncthreads();
    double tgt = u * sh.d[0];
    double before = sh.chunk_prefix[threadIdx.x];
    if (before <= tgt && before + cs > tgt) {
        double acc = before;
        for (int i = lo; i < hi; i++) {
            float p = w[i];
            if (p > 0.0f) {
                acc += (double)p;
                if (acc > tgt) {
                    atomicMax(&sh.found, -1 - i);  // lowest i wins (largest -1-i)
                    break;
                }
            }
        }
    }
    __syncthreads();
    int f = sh.found;
    int token;
    if (f == (int)0x80000000) {
        // Fallback (rounding): the last kept token.
        __syncthreads();
        if (threadIdx.x == 0) sh.i[0] = -1;
        __syncthreads();
        if (last >= 0) atomicMax(&sh.i[0], last);
        __syncthreads();
        token = max(sh.i[0], 0);
    } else {
        token = -1 - f;
    }
    __syncthreads();
    return token;
}

// Sum of the kept weights w[0..n) (process_logits' output), in every thread.
__device__ double block_total(const float* w, int n, SampleShared& sh) {
    double total = 0.0;
    for (int x = threadIdx.x; x < n; x += blockDim.x) total += (double)w[x];
    return block_sum(total, sh.d);
}

// Records an emitted token in its row: the draw counter, and the output counts of rows with
// penalties (one thread).
__device__ __forceinline__ void record_token(RowParams* rp, int row, int vocab, int token,
                                             unsigned short* counts) {
    rp->generated = rp->generated + 1;
    if (rp->penalties) {
        unsigned short* c = counts + (size_t)row * vocab + token;
        if (*c < 65535) *c = *c + 1;
    }
}

// Samples one token per block (the k-th sampled sequence, row sample_rows[k]) from logits
// (f32 [n, vocab], modified in place): process_logits, then the greedy token or a draw with
// philox(seed, generated). Writes out_tokens[k] and pending[row]; advances the row (and its
// output counts when it has penalties). blockDim.x = 1024.
extern "C" __global__ void __launch_bounds__(1024, 1) sample_tokens(float* logits, int vocab, const int* sample_rows, RowParams* rows,
                                         int* out_tokens, int* pending, unsigned short* counts,
                                         const u32* seen, const int* bias_ids, const float* bias_vals,
                                         const ArgPart* parts) {
    PDL_ENTER();
    __shared__ SampleShared sh;
    int k = blockIdx.x;
    int row = sample_rows[k];
    RowParams* rp = rows + row;
    if (rp->host_sampled) return;
    float* lg = logits + (size_t)k * vocab;
    u32 gen = rp->generated;
    const ArgPart* pp = parts ? parts + (size_t)k * ARGMAX_PARTS : nullptr;
    int token = process_logits(lg, vocab, rp, row, gen, counts, seen, bias_ids, bias_vals, pp, sh);
    if (token < 0) token = block_draw(lg, vocab, philox_uniform(rp->seed_lo, rp->seed_hi, (u64)gen), sh);
    if (threadIdx.x == 0) {
        out_tokens[k] = token;
        pending[row] = token;
        record_token(rp, row, vocab, token, counts);
    }
}

// ---------------------------------------------------------------------------------------------
// Speculative decoding (engine-core/src/executor/cuda/spec.rs). Per-row device state beside
// `pending`: kv_len[row] (positions whose target KV is valid: the pending token sits at
// kv_len), prev_tok[row] (the token at kv_len - 1), proposals[row][K] and, for sampled rows,
// q[row][K][vocab] (the draft's normalised distribution each proposal was drawn from).
// The host's positions of a decode entry are upper bounds (rounds still in flight may accept
// fewer tokens than it booked); spec_place puts them at the true lengths on the device.

// Philox keys of the draft's draws and of the acceptance tests: the request's seed xor these
// (engine-core/src/sampling/spec.rs, DRAFT_KEY and ACCEPT_KEY).
#define DRAFT_KEY_LO 0xf7d4af7du
#define DRAFT_KEY_HI 0xd4af7d4au
#define ACCEPT_KEY_LO 0xce97acceu
#define ACCEPT_KEY_HI 0xacce97acu

// Places decode entries at their rows' true lengths. Entry e (thread e) owns tokens
// first[e] .. first[e] + n (first == null: token e; ntok == null: n = n_const) of the step's
// metadata: token j gets position kv_len[row] + off0 + j, its KV slot through the row's block
// table, and the token id at that offset: prev_tok (-1), pending (0) or proposal off - 1.
// Rows with kv_len < 0 (the graph padding row) keep what the host wrote.
extern "C" __global__ void spec_place(int* tok_src, int* positions, int* slots, const int* tok_row,
                                      const int* first, const int* ntok, int n_const, int n_entries, int off0,
                                      const int* kv_len, const int* prev_tok, const int* pending,
                                      const int* proposals, int K, const int* block_tables, int bt_stride,
                                      int block_size) {
    PDL_ENTER();
    int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n_entries) return;
    int t0 = first ? first[e] : e;
    int n = ntok ? ntok[e] : n_const;
    int row = tok_row[t0];
    int len = kv_len[row];
    if (len < 0) return;  // a graph's padding row: the host's padding metadata stays
    for (int j = 0; j < n; j++) {
        int off = off0 + j;
        int pos = max(len + off, 0);
        int tok = off < 0 ? prev_tok[row] : off == 0 ? pending[row] : proposals[row * K + off - 1];
        tok_src[t0 + j] = tok;
        positions[t0 + j] = pos;
        slots[t0 + j] = block_tables[(size_t)row * bt_stride + pos / block_size] * block_size + pos % block_size;
    }
}

// Draft side, proposal i of each speculating row (block b: row spec_rows[b], logits row b):
// the row's processing at draw generated + i, then the greedy token, or a draw with
// philox(seed ^ DRAFT_KEY, generated + i) whose normalised distribution is kept in q.
// Penalised rows see the round's earlier proposals as output tokens (as the target will when
// it verifies them): their counts are bumped for the processing and restored after (one
// block per row: nothing else touches the row's counts meanwhile).
// Host-sampled rows propose nothing (spec_verify ignores their proposals).
extern "C" __global__ void __launch_bounds__(1024, 1) draft_sample(float* logits, int vocab, const int* spec_rows, int i, RowParams* rows,
                                        int* proposals, float* q, int K, unsigned short* counts, const u32* seen,
                                        const int* bias_ids, const float* bias_vals, const ArgPart* parts) {
    PDL_ENTER();
    __shared__ SampleShared sh;
    int b = blockIdx.x;
    int row = spec_rows[b];
    const RowParams* rp = rows + row;
    if (rp->host_sampled) return;
    float* lg = logits + (size_t)b * vocab;
    u32 gen = rp->generated + i;
    const ArgPart* pp = parts ? parts + (size_t)b * ARGMAX_PARTS : nullptr;
    const int* prop = proposals + row * K;
    unsigned short* c = counts + (size_t)row * vocab;
    bool bump = rp->penalties && i > 0;
    u32 bumped = 0;  // thread 0: which earlier proposals it counted (a count at 65535 stays)
    if (bump && threadIdx.x == 0)
        for (int j = 0; j < i; j++)
            if (c[prop[j]] < 65535) {
                c[prop[j]] = c[prop[j]] + 1;
                bumped |= 1u << j;
            }
    if (bump) __syncthreads();
    int token = process_logits(lg, vocab, rp, row, gen, counts, seen, bias_ids, bias_vals, pp, sh);
    if (token < 0) {
        double inv = 1.0 / block_total(lg, vocab, sh);
        float* qr = q + ((size_t)row * K + i) * vocab;
        for (int x = threadIdx.x; x < vocab; x += blockDim.x) qr[x] = (float)((double)lg[x] * inv);
        token = block_draw(lg, vocab, philox_uniform(rp->seed_lo ^ DRAFT_KEY_LO, rp->seed_hi ^ DRAFT_KEY_HI, (u64)gen),
                           sh);
    }
    if (bump) __syncthreads();  // every thread is done reading the counts
    if (threadIdx.x == 0) {
        for (int j = i - 1; j >= 0; j--)
            if (bumped >> j & 1u) c[prop[j]] = c[prop[j]] - 1;
        proposals[row * K + i] = token;
    }
}

// Verification (block k: the k-th sampled sequence, row sample_rows[k], its samp_draft[k]
// proposals scored by logits rows samp_first[k] ..= + samp_draft[k]), as RowSampler::verify:
// position i is processed after recording the i tokens emitted before it; greedy rows accept
// while the proposal is the argmax; sampled rows accept t with probability min(1, p(t) / q(t))
// (philox(seed ^ ACCEPT_KEY, n)), resample a rejection from norm(max(0, p - q)) and draw a
// bonus from p (philox(seed, n)); q == null: proposals are point masses (no draft model).
// A sequence without proposals is a plain sample. Writes out_tokens[k * (K + 1) + i],
// out_counts[k], pending, kv_len and prev_tok of the row. Host-sampled rows only get kv_len
// and prev_tok (the host samples their one token).
extern "C" __global__ void __launch_bounds__(1024, 1) spec_verify(float* logits, int vocab, const int* sample_rows, const int* samp_first,
                                       const int* samp_draft, const int* logit_rows, const int* tok_src,
                                       const int* positions, RowParams* rows, int* out_tokens, int* out_counts,
                                       int* pending, int* kv_len, int* prev_tok, const int* proposals,
                                       const float* q, int K, const int* prop_count, int* hist, int hist_stride,
                                       unsigned short* counts, const u32* seen, const int* bias_ids,
                                       const float* bias_vals, const ArgPart* parts) {
    PDL_ENTER();
    __shared__ SampleShared sh;
    int k = blockIdx.x;
    int row = sample_rows[k];
    int first = samp_first[k];
    RowParams* rp = rows + row;
    int t0 = logit_rows[first];
    int pos0 = positions[t0], tok0 = tok_src[t0];
    const int* prop = proposals + row * K;
    int* hrow = hist ? hist + (size_t)row * hist_stride : nullptr;
    if (rp->host_sampled) {
        if (threadIdx.x == 0) {
            kv_len[row] = pos0 + 1;
            prev_tok[row] = tok0;
            out_counts[k] = 1;
            if (hrow && pos0 >= 0 && pos0 < hist_stride) hrow[pos0] = tok0;
        }
        return;
    }
    // The proposals verified: what the host booked, or fewer when the n-gram lookup found
    // fewer (its count per row).
    int nd = samp_draft[k];
    if (prop_count) nd = min(nd, prop_count[row]);
    int emitted = 0, token = 0;
    for (int i = 0; i <= nd; i++) {
        float* lg = logits + (size_t)(first + i) * vocab;
        __syncthreads();
        u32 gen = rp->generated;
        __syncthreads();
        const ArgPart* pp = parts ? parts + (size_t)(first + i) * ARGMAX_PARTS : nullptr;
        int g = process_logits(lg, vocab, rp, row, gen, counts, seen, bias_ids, bias_vals, pp, sh);
        bool stop = true;
        if (i < nd) {
            int t = prop[i];
            if (g >= 0) {
                token = g;
                stop = g != t;
            } else {
                double inv = 1.0 / block_total(lg, vocab, sh);
                const float* qr = q ? q + ((size_t)row * K + i) * vocab : nullptr;
                double p_t = (double)lg[t] * inv;
                double q_t = qr ? (double)qr[t] : 1.0;
                double u = philox_uniform(rp->seed_lo ^ ACCEPT_KEY_LO, rp->seed_hi ^ ACCEPT_KEY_HI, (u64)gen);
                if (u * q_t < p_t) {
                    token = t;
                    stop = false;
                } else {
                    double rs = 0.0;
                    for (int x = threadIdx.x; x < vocab; x += blockDim.x) {
                        double qx = qr ? (double)qr[x] : (x == t ? 1.0 : 0.0);
                        rs += fmax((double)lg[x] * inv - qx, 0.0);
                    }
                    rs = block_sum(rs, sh.d);
                    // p == q up to rounding leaves nothing: the target's own draw.
                    if (rs > 0.0) {
                        for (int x = threadIdx.x; x < vocab; x += blockDim.x) {
                            double qx = qr ? (double)qr[x] : (x == t ? 1.0 : 0.0);
                            lg[x] = (float)fmax((double)lg[x] * inv - qx, 0.0);
                        }
                        __syncthreads();
                    }
                    token = block_draw(lg, vocab, philox_uniform(rp->seed_lo, rp->seed_hi, (u64)gen), sh);
                }
            }
        } else {
            token = g >= 0 ? g : block_draw(lg, vocab, philox_uniform(rp->seed_lo, rp->seed_hi, (u64)gen), sh);
        }
        if (threadIdx.x == 0) {
            out_tokens[k * (K + 1) + i] = token;
            record_token(rp, row, vocab, token, counts);
        }
        emitted = i + 1;
        if (stop) break;
    }
    if (threadIdx.x == 0) {
        out_counts[k] = emitted | (nd << 16);
        pending[row] = token;
        kv_len[row] = pos0 + emitted;
        prev_tok[row] = emitted == 1 ? tok0 : prop[emitted - 2];
        // The n-gram history gains the tokens whose KV this round computed and kept: the one at
        // pos0 and the accepted proposals (the new pending token is read from `pending`).
        if (hrow)
            for (int j = 0; j < emitted && pos0 + j < hist_stride; j++)
                if (pos0 + j >= 0) hrow[pos0 + j] = j == 0 ? tok0 : prop[j - 1];
    }
}

// N-gram prompt lookup on the device (no draft model; engine-core/src/spec.rs
// `ngram_propose` is the reference): per row a token history `hist[row][0 .. kv_len)` (the
// tokens with target KV; positions below hist_start[row] unknown, see ngram_init) followed by
// the pending token is the context.

// Row initialisations: block i copies the staged tokens of rows[i] (offsets[i] ..
// offsets[i + 1], the row's first tokens) into its history and sets hist_start[row] to
// starts[i] (0, or the first position of the row's first chunk when its cached prefix did
// not fit the step's staging).
extern "C" __global__ void ngram_init(int* hist, int stride, int* hist_start, const int* rows, const int* offsets,
                                      const int* starts, const int* tokens) {
    PDL_ENTER();
    int i = blockIdx.x, row = rows[i];
    int a = offsets[i], n = min(offsets[i + 1] - a, stride);
    for (int j = threadIdx.x; j < n; j += blockDim.x) hist[(size_t)row * stride + j] = tokens[a + j];
    if (threadIdx.x == 0) hist_start[row] = starts[i];
}

// Records the step's host tokens (prefill chunks, before placement: decode entries still read
// `pending`, tok_src < 0; graph padding has position -1) in their rows' histories.
extern "C" __global__ void ngram_record(int* hist, int stride, const int* tok_src, const int* positions,
                                        const int* tok_row, int n) {
    PDL_ENTER();
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    int tok = tok_src[t], pos = positions[t];
    if (tok >= 0 && pos >= 0 && pos < stride) hist[(size_t)tok_row[t] * stride + pos] = tok;
}

// Block b proposes for row spec_rows[b]: the longest suffix of the context (max_n tokens down
// to min_n) that occurs earlier in it, at its latest earlier start, and the up to K tokens
// that followed it; prop_count[row] says how many (0: no suffix recurs).
extern "C" __global__ void ngram_propose(const int* hist, int stride, const int* hist_start, const int* kv_len,
                                         const int* pending, const int* spec_rows, int min_n, int max_n,
                                         int* proposals, int* prop_count, int K) {
    PDL_ENTER();
    __shared__ int best;
    int row = spec_rows[blockIdx.x];
    if (kv_len[row] < 0) {  // a graph's padding row
        if (threadIdx.x == 0) prop_count[row] = 0;
        return;
    }
    const int* h = hist + (size_t)row * stride;
    int len = min(kv_len[row], stride) + 1, h0 = hist_start[row], last = pending[row];
    auto tok = [&](int i) { return i == len - 1 ? last : h[i]; };
    int count = 0;
    for (int n = min(max_n, len - 1 - h0); n >= min_n && count == 0; n--) {
        // Scan start positions from the latest down, a block-wide window at a time.
        for (int hi = len - n - 1; hi >= h0; hi -= blockDim.x) {
            if (threadIdx.x == 0) best = -1;
            __syncthreads();
            int s = hi - (int)threadIdx.x;
            if (s >= h0) {
                bool same = true;
                for (int j = 0; j < n && same; j++) same = tok(s + j) == tok(len - n + j);
                if (same) atomicMax(&best, s);
            }
            __syncthreads();
            int b = best;
            __syncthreads();
            if (b >= 0) {
                int from = b + n;
                count = min(K, len - from);
                for (int i = threadIdx.x; i < count; i += blockDim.x) proposals[row * K + i] = tok(from + i);
                break;
            }
        }
    }
    if (threadIdx.x == 0) prop_count[row] = count;
}

// Copies float rows: out[i] = in[i] (used to keep raw logits for host-side sampling).
extern "C" __global__ void copy_f32(float* out, const float* in, long long n) {
    PDL_ENTER();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = in[i];
}

// Structured outputs: logits row rows[m] keeps the tokens allowed by mask m (bit t % 32 of word
// t / 32 of words[m * words_per_mask ..]); every other logit becomes -inf. Grid: (vocab / 256,
// masks).
extern "C" __global__ void apply_token_mask(float* logits, int vocab, const int* rows,
                                            const unsigned* words, int words_per_mask) {
    PDL_ENTER();
    int m = blockIdx.y;
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= vocab) return;
    unsigned w = words[(long long)m * words_per_mask + (t >> 5)];
    if (!((w >> (t & 31)) & 1u)) logits[(long long)rows[m] * vocab + t] = -__int_as_float(0x7f800000);
}

// dst[index[i]] = values[i], i < n. Writes host-sampled tokens into the rows' pending slots
// (index = rows) and new block-table entries into the per-row tables (index = row * stride + j).
extern "C" __global__ void scatter_i32(int* dst, const int* index, const int* values, int n) {
    PDL_ENTER();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[index[i]] = values[i];
}

#ifndef HARRIER_F32
// ---------------------------------------------------------------------------------------------
// Small-batch GEMM (decode): y[m, n] = sum_k x[m, k] * w[n, k] for m < M <= GEMV_MAX_M, bf16 in,
// fp32 accumulation, bf16 (or f32 when f32_out) out. Memory-bound on the weights, which are read
// once with 16-byte streaming loads (no L1 allocation: x stays in L1). A warp computes
// GEMV_ROWS adjacent outputs; each lane walks k in 8-element chunks, 32 chunks apart, then the
// warp reduces. Each output's summation order depends only on k, never on M, so a row gets the
// same result in a batch of 1 or 8 (CUDA-graph padding must not change real rows).
// Needs K % 8 == 0 and 16-byte aligned rows.
#define GEMV_MAX_M 8
#define GEMV_WARPS 8
#define GEMV_ROWS 2

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

__device__ __forceinline__ float dot8(uint4 a, uint4 b) {
    float s = __uint_as_float(a.x << 16) * __uint_as_float(b.x << 16);
    s += __uint_as_float(a.x & 0xffff0000u) * __uint_as_float(b.x & 0xffff0000u);
    s += __uint_as_float(a.y << 16) * __uint_as_float(b.y << 16);
    s += __uint_as_float(a.y & 0xffff0000u) * __uint_as_float(b.y & 0xffff0000u);
    s += __uint_as_float(a.z << 16) * __uint_as_float(b.z << 16);
    s += __uint_as_float(a.z & 0xffff0000u) * __uint_as_float(b.z & 0xffff0000u);
    s += __uint_as_float(a.w << 16) * __uint_as_float(b.w << 16);
    s += __uint_as_float(a.w & 0xffff0000u) * __uint_as_float(b.w & 0xffff0000u);
    return s;
}

extern "C" __global__ void gemv_bf16(const bf16* x, const bf16* w, void* y, int M, int N, int K, int f32_out) {
    PDL_ENTER();
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int n0 = (blockIdx.x * GEMV_WARPS + warp) * GEMV_ROWS;
    if (n0 >= N) return;
    int kc = K >> 3;
    float acc[GEMV_ROWS][GEMV_MAX_M];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++)
#pragma unroll
        for (int m = 0; m < GEMV_MAX_M; m++) acc[r][m] = 0.0f;
    const uint4* wr[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++) wr[r] = (const uint4*)(w + (size_t)min(n0 + r, N - 1) * K);
    const uint4* xr = (const uint4*)x;
#pragma unroll 4
    for (int c = lane; c < kc; c += 32) {
        uint4 wv[GEMV_ROWS];
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; r++) wv[r] = ld_stream(wr[r] + c);
#pragma unroll
        for (int m = 0; m < GEMV_MAX_M; m++) {
            if (m < M) {
                uint4 xv = __ldg(xr + (size_t)m * kc + c);
#pragma unroll
                for (int r = 0; r < GEMV_ROWS; r++) acc[r][m] += dot8(wv[r], xv);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++) {
#pragma unroll
        for (int m = 0; m < GEMV_MAX_M; m++) {
            if (m < M) {
                float v = warp_sum(acc[r][m]);
                if (lane == 0 && n0 + r < N) {
                    size_t o = (size_t)m * N + n0 + r;
                    if (f32_out) ((float*)y)[o] = v;
                    else ((bf16*)y)[o] = f2bf(v);
                }
            }
        }
    }
}
// ---------------------------------------------------------------------------------------------
// Skinny GEMM on tensor cores: the fused small-batch decode path (steps of M <= 8 * NT tokens).
//   y[m, n] = epilogue(sum_k w[n, k] * in(x)[m, k]),  m < M
// A block owns R tiles of 16 rows of w and all of K, split over its SK_WARPS warps (warp w takes
// every SK_WARPS-th 32-wide k chunk); the warps' partial sums are added pairwise through shared
// memory in a fixed tree at the end: split-K with its reduction in the same launch. Per chunk,
// lane (g = lane / 4, t = lane % 4) loads 16 bytes (8 consecutive k) of rows g and g + 8 of each
// tile and of input rows g + 8 j; the k order inside an mma is a permutation both operands share
// (A's register pair (2t, 2t + 1) and B's hold the same physical k), so plain 16-byte loads feed
// mma.sync m16n8k16 with no shuffles or shared-memory staging. A warp keeps SK_LOADS 16-byte
// weight loads in flight (SK_LOADS / (2 R) chunks per round); the first round is issued before
// the norm prologue. The weights stream through L2 once (no L1 allocation); x is re-read from
// L1/L2 by every block. Each output's summation order depends on k only, never on M, so a row
// computes the same in a padded graph bucket as alone.
//   in(x): x, or with norm_w RMSNorm(x) rounded to bf16 exactly as add_rmsnorm writes it (Llama:
//   bf16(w * bf16(x * inv)); Gemma with w_off = 1: bf16(x * inv * (1 + w))), M <= 8, staged in
//   (M + 1) * K * 2 bytes of dynamic shared memory (the launch passes it).
// Epilogues (as the unfused kernels round): SK_STORE bf16(acc); SK_STORE_F32 acc (logits);
// SK_RESID y = bf16(y + bf16(acc)) in place (the residual add of add_rmsnorm); SK_SILU / SK_GELU:
// each tile is 8 gate rows and the 8 matching up rows (w is [gate; up], N = intermediate size),
// so one lane holds both: y[m, n] = bf16(bf16(act(bf16(gate))) * bf16(up)) as silu_mul.
// The _f8 instances read e4m3 weights (16 a lane-load, 64-wide chunks, converted exactly to bf16
// in registers) and multiply each sum by its row's scale before the epilogue.
// Needs K % 32 == 0 (K % 64 for _f8) and 16-byte aligned rows. SK_WARPS and SK_LOADS may be overridden with -D
// (harrier-cuda-tool check-gemv --variants compares launch shapes).
#ifndef SK_WARPS
#define SK_WARPS 16
#endif
#ifndef SK_LOADS
#define SK_LOADS 8
#endif
#define SK_ROWS 16
#define SK_STORE 0
#define SK_STORE_F32 1
#define SK_RESID 2
#define SK_SILU 3
#define SK_GELU 4
#define SK_ROPE 5

// SK_ROPE: the q|k|v projection of a decode step with RoPE and the KV write in its epilogue
// (rope_kv_write's work for models without q/k norms; the q and k rows in the paired order).
struct SkinnyRope {
    const int* positions;
    const float* inv_freq;
    const int* slot_mapping;
    bf16* k_cache;
    bf16* v_cache;
    int nh, nkv, hd;
    int rows;  // the step's tokens (rows past them, a bucket's stale padding, write nothing)
};

struct SkinnyIn {
    const bf16* x;
    const void* w;  // bf16, or e4m3 bytes in the _f8 instances
    void* y;
    const bf16* norm_w;
    const float* scale;  // _f8 instances: one scale per weight row (gated: [gate; up] rows)
    float eps, w_off;
    int M, N, K, epi;  // epi: SK_* | SK_NORM_IN | SK_NORM_OUT
    union {
        SkinnyRope rope;  // SK_ROPE
        struct {
            bf16* u;
            float* ss;
        } dout;  // SK_NORM_OUT
    };
};
// Deferred norms (the RMSNorm of the next GEMM's input split between two launches; docs/cuda.md).
// The flags reuse fields, so that the struct keeps its 120 bytes: at 152 NVRTC passed it by
// address, skinny_gemm_8 read its fields through generic loads (89 registers to 60) and the 1B's
// steps ran 2-5% slower (session 29).
//   SK_NORM_OUT (with SK_RESID): also writes dout.u = bf16(norm_weight(y', norm_w)) of the new
//   residual y' (norm_w: the next norm's weights, no prologue) and, per 16 columns, the sums of
//   squares of y' (dout.ss[m * ceil(N / 16) + n / 16], a fixed order).
//   SK_NORM_IN: x is such a u and norm_w the f32 partials (no prologue); row m's sums are
//   multiplied by rsqrt(sum of the K / 16 partials / K + eps) before the epilogue.
#define SK_NORM_IN 16
#define SK_NORM_OUT 32

// Eight e4m3 bytes (k, k + 1, ... in v.x then v.y) as eight bf16 of the same values (exact:
// e4m3's 4-bit exponent and 3-bit mantissa fit bf16). Each byte goes to the high byte of a
// 16-bit half (prmt); sign kept, exponent and mantissa shifted into bf16's fields, which reads
// as the value times 2^-120 (subnormals included); one bf16x2 multiply by 2^120 restores it.
__device__ __forceinline__ u32 e4m3x2_bf16x2(u32 y) {
    u32 h = (y & 0x80008000u) | ((y >> 4) & 0x07ff07ffu), r;
    const u32 k = 0x7b807b80u;  // bf16 2^120 in both halves
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(h), "r"(k), "r"(0x80008000u));
    return r;
}

__device__ __forceinline__ uint4 e4m3x8_bf16(u32 lo, u32 hi) {
    return make_uint4(e4m3x2_bf16x2(__byte_perm(lo, 0, 0x1404)), e4m3x2_bf16x2(__byte_perm(lo, 0, 0x3424)),
                      e4m3x2_bf16x2(__byte_perm(hi, 0, 0x1404)), e4m3x2_bf16x2(__byte_perm(hi, 0, 0x3424)));
}

__device__ __forceinline__ float sumsq8(uint4 v) {
    u32 a[4] = {v.x, v.y, v.z, v.w};
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float lo = __uint_as_float(a[i] << 16), hi = __uint_as_float(a[i] & 0xffff0000u);
        s += lo * lo + hi * hi;
    }
    return s;
}

__device__ __forceinline__ uint4 rms_norm8(uint4 xv, uint4 wv, float inv, float w_off) {
    u32 a[4] = {xv.x, xv.y, xv.z, xv.w}, b[4] = {wv.x, wv.y, wv.z, wv.w}, o[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float lo = norm_weight(__uint_as_float(a[i] << 16) * inv, __uint_as_float(b[i] << 16), w_off);
        float hi = norm_weight(__uint_as_float(a[i] & 0xffff0000u) * inv, __uint_as_float(b[i] & 0xffff0000u), w_off);
        o[i] = pack_bf16(lo, hi);
    }
    return make_uint4(o[0], o[1], o[2], o[3]);
}

// 4 bytes global -> shared without registers (cp.async, sm_80+), zero-filled when !valid
// (`base`, any valid address, is then the source); cp_async_wait_all before reading them.
__device__ __forceinline__ void cp_async4(void* dst, const void* src, const void* base, bool valid) {
    u32 d;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(d) : "l"(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(d), "l"(valid ? src : base), "r"(valid ? 4 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// A thread's cp.async copies since its last commit as one group; wait until at most N of its
// groups are still in flight (the older ones have landed).
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// DN: the _dn instances (up to 8 rows, 16 in bf16; FP8 ones for fused FP8 steps), the only
// ones that read SK_NORM_IN / SK_NORM_OUT; the others compile as before the deferred norms
// (their extra epilogue code cost the 1B's prologue steps ~2% when every instance had it:
// session 29). FP8 changes nothing there: its weights become bf16 before the MMAs, x is read
// as bf16 either way, and the row scales apply before a deferred norm's 1 / rms.
// KS > 1 (the _k2 instances, sm_90 on): the block's K chunks cut in KS contiguous parts, one
// for each block of a cluster of KS along x (block x: tile x / KS, part x % KS = its rank), so
// a launch of few row tiles streams from KS times the SMs (the 1B's o and down: 128 tiles; the
// host's SKINNY_K2). After its tree, a rank past 0 pushes warp 0's sums into rank 0's shared
// memory with st.async (counted on rank 0's mbarrier; the cluster barrier, arrived at before
// the PDL wait and waited on before the tree, orders the barrier's initialisation first), and
// rank 0 adds them in rank order and runs the epilogue: the same bits whatever the timing, and
// a row's result still depends on K only.
// XA: a round's x loads, every chunk's, all issued before its first MMA (bf16 instances of one
// n-tile but the 64-register b2 ones, where the extra registers spill); otherwise each chunk's
// loads come just before its MMAs, predicated (bf16 more than 8 rows, which never stage a
// normed input) or behind the staged input's branch.
template <int NT, int R, bool F8, int W = SK_WARPS, bool DN = false, int KS = 1, bool XA = NT == 1 && !F8>
__device__ __forceinline__ void skinny_gemm(const SkinnyIn& p) {
    constexpr int U = SK_LOADS / (2 * R) > 0 ? SK_LOADS / (2 * R) : 1;
    __shared__ float red[W / 2][R][NT][32][4];
    __shared__ float inv_sh[DN ? 8 * NT : 8];  // the rows' 1 / rms (norm prologue; deferred norm: ss_in)
    __shared__ float ss_sh[W][8];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int rank = KS > 1 ? (int)(blockIdx.x % KS) : 0;
    __shared__ __align__(16) float4 kpart[KS > 1 ? (KS - 1) * R * NT * 32 : 1];  // ranks 1..'s sums
    __shared__ __align__(8) unsigned long long kbar;
    if constexpr (KS > 1) {
        if (rank == 0 && threadIdx.x == 0) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&kbar)) : "memory");
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        __syncthreads();
        asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    }
    static_assert(!DN || NT <= 2, "deferred norms: up to 16 rows");
    const int epi = DN ? p.epi & 15 : p.epi;
    const float* ss_in = DN && (p.epi & SK_NORM_IN) ? (const float*)p.norm_w : nullptr;
    const bool norm_out = DN && (p.epi & SK_NORM_OUT) && epi == SK_RESID;
    const bool gated = epi == SK_SILU || epi == SK_GELU;
    // Tile i, plain: rows n0 + 16 i + g and + 8. Gated: gate row n0 + 8 i + g, up row N + that.
    const int n0 = (blockIdx.x / KS) * (gated ? 8 * R : 16 * R);
    const uint4* wa[R];
    const uint4* wb[R];
#pragma unroll
    for (int i = 0; i < R; i++) {
        int r0 = n0 + (gated ? 8 * i : 16 * i) + g;
        int r1 = gated ? p.N + r0 : r0 + 8;
        bool v0 = r0 < p.N, v1 = gated ? v0 : r1 < p.N;
        // A lane's 16 bytes of a chunk: 8 bf16 (32-wide chunks) or 16 e4m3 (64-wide chunks).
        const size_t row_bytes = (size_t)p.K * (F8 ? 1 : 2);
        wa[i] = (const uint4*)((const char*)p.w + (size_t)(v0 ? r0 : 0) * row_bytes) + t;
        wb[i] = (const uint4*)((const char*)p.w + (size_t)(v1 ? r1 : 0) * row_bytes) + t;
    }
    // This block's chunks [c_first, nchunks) (KS > 1: its rank's part of K's).
    const int all_chunks = p.K >> (F8 ? 6 : 5);
    const int c_first = KS > 1 ? rank * all_chunks / KS : 0;
    const int nchunks = KS > 1 ? (rank + 1) * all_chunks / KS : all_chunks;
    // (The norm prologue stages at most 8 rows, so instances of more never take it: the host's
    // skinny_norm_supports. Compiled out there, x is read by predicated loads, not a branch.)
    const bool norm = NT == 1 && p.norm_w != 0 && !(DN && (p.epi & (SK_NORM_IN | SK_NORM_OUT)));
    const uint4 zero = make_uint4(0, 0, 0, 0);
    uint4 a[R][U], b[R][U];
    int c0 = c_first + warp;
    auto load = [&](int base) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            int c = base + u * W;
#pragma unroll
            for (int i = 0; i < R; i++) {
                a[i][u] = c < nchunks ? ld_stream(wa[i] + 4 * c) : zero;
                b[i][u] = c < nchunks ? ld_stream(wb[i] + 4 * c) : zero;
            }
        }
    };
#ifndef SK_NO_EARLY  // measurement only (HARRIER_KERNEL_DEFINES): first weight loads after the wait
    load(c0);
#endif
    // Epilogue operands no launch of the last one writes, copied into shared memory before
    // waiting (cp.async: no registers held across the main loop, which would cost the 8-warp
    // instances a block per SM) so that their latency hides under the weight stream instead of
    // adding to the block's tail: the FP8 row scales (weights), SK_RESID's residual (the host
    // never has the launch just before this one write y; see SkinnyEpilogue::Residual) and
    // SK_ROPE's positions, slots and frequencies (step metadata, as paged_attention reads
    // early). Warp 0 copies and runs the epilogue. Up to 16 input rows (NT <= 2); more read
    // the residual at the end.
    constexpr bool PRE = NT <= 2;
    __shared__ float pre_sc[16 * R];                 // scales of the block's rows (gated: gate, up)
    __shared__ u32 pre_res[PRE ? 8 * NT : 1][8 * R];  // residual rows n0 .. n0 + 16 R - 1, bf16 pairs
    __shared__ int pre_pos[8 * NT], pre_slot[8 * NT];
    __shared__ float pre_freq[128];  // RoPE frequencies (hd <= 256)
    __shared__ u32 pre_nw[DN ? 8 * R : 1];  // SK_NORM_OUT: the next norm's weights of the block's columns
    if (warp == 0) {
        const bf16* y = (const bf16*)p.y;
        if (norm_out) {
            for (int e = lane; e < 8 * R; e += 32) {
                const int n = n0 + 2 * e;
                cp_async4(pre_nw + e, p.norm_w + n, p.norm_w, n < p.N);
            }
        }
        if (F8) {
            for (int e = lane; e < 16 * R; e += 32) {
                const int n = gated ? (e < 8 * R ? n0 + e : p.N + n0 + e - 8 * R) : n0 + e;
                cp_async4(pre_sc + e, p.scale + n, p.scale, (gated ? n0 + e % (8 * R) : n) < p.N);
            }
        }
        if (PRE && epi == SK_RESID) {
            for (int e = lane; e < 8 * NT * 8 * R; e += 32) {
                const int m = e / (8 * R), n = n0 + 2 * (e - m * 8 * R);
                cp_async4(&pre_res[PRE ? m : 0][e - m * 8 * R], y + (size_t)m * p.N + n, y, m < p.M && n < p.N);
            }
        }
        if (epi == SK_ROPE) {
            for (int e = lane; e < 8 * NT; e += 32) {
                cp_async4(pre_pos + e, p.rope.positions + e, p.rope.positions, e < p.rope.rows);
                cp_async4(pre_slot + e, p.rope.slot_mapping + e, p.rope.slot_mapping, e < p.rope.rows);
            }
            for (int e = lane; e < (p.rope.hd >> 1); e += 32) cp_async4(pre_freq + e, p.rope.inv_freq + e, p.rope.inv_freq, true);
        }
    }
    PDL_ENTER();
#ifdef SK_NO_EARLY
    load(c0);
#endif
    extern __shared__ uint4 xs_dyn[];
    // Deferred norm: the M rows' partial sums of squares (written by the launch before) copied
    // into dynamic shared memory now, added up by the second half's warps during the reduction
    // tree (every thread waits for its copies before the tree's first barrier).
    if (DN && ss_in) {
        float* ssd = (float*)xs_dyn;
        const int n = p.M * ((p.K + 15) >> 4);
        for (int e = threadIdx.x; e < n; e += blockDim.x) cp_async4(ssd + e, ss_in + e, ss_in, true);
        cp_async_commit();
    }
    // The normed input, staged once per block in dynamic shared memory ([M][K] bf16 after the
    // norm weights [K]): one round of loads (issued behind the first weight loads), the sums of
    // squares, then the rows normalised in place. The main loop then reads x from shared memory.
    uint4* xs = xs_dyn + (p.K >> 3);
    if (norm) {
        const int kc = p.K >> 3;
        float ss[8];
#pragma unroll
        for (int q = 0; q < 8; q++) ss[q] = 0.0f;
        for (int c = threadIdx.x; c < kc; c += blockDim.x) {
            xs_dyn[c] = __ldg((const uint4*)p.norm_w + c);
#pragma unroll
            for (int q = 0; q < 8; q++) {
                if (q < p.M) {
                    uint4 v = __ldg((const uint4*)(p.x + (size_t)q * p.K) + c);
                    xs[q * kc + c] = v;
                    ss[q] += sumsq8(v);
                }
            }
        }
#pragma unroll
        for (int q = 0; q < 8; q++) {
            float v = warp_sum(ss[q]);
            if (lane == 0) ss_sh[warp][q] = v;
        }
        __syncthreads();
        if (threadIdx.x < 8) {
            float v = 0.0f;
            for (int w = 0; w < W; w++) v += ss_sh[w][threadIdx.x];
            inv_sh[threadIdx.x] = rsqrtf(v / (float)p.K + p.eps);
        }
        __syncthreads();
        for (int i = threadIdx.x; i < p.M * kc; i += blockDim.x) {
            int q = i / kc;
            xs[i] = rms_norm8(xs[i], xs_dyn[i - q * kc], inv_sh[q], p.w_off);
        }
        __syncthreads();
    }
    float acc[R][NT][4];
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int j = 0; j < NT; j++) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;
    constexpr bool XALL = XA && !F8;
    uint4 xr[XALL ? U : 1][NT];
    while (true) {
        if (XALL && !norm) {
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int c = c0 + u * W;
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    const int m = g + 8 * j;
                    xr[XALL ? u : 0][j] = c < nchunks && m < p.M
                        ? __ldg((const uint4*)(p.x + (size_t)m * p.K + c * 32 + t * 8)) : zero;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            int c = c0 + u * W;
            if (c >= nchunks) break;
            // FP8: the 16 loaded bytes are two 8-k halves, each converted and fed like a bf16
            // chunk (k order t * 16 + 8 h + e; x is read at the same k).
#pragma unroll
            for (int h = 0; h < (F8 ? 2 : 1); h++) {
                const int k0 = F8 ? c * 64 + t * 16 + 8 * h : c * 32 + t * 8;
                uint4 wa_h[R], wb_h[R];
#pragma unroll
                for (int i = 0; i < R; i++) {
                    if (F8) {
                        wa_h[i] = h ? e4m3x8_bf16(a[i][u].z, a[i][u].w) : e4m3x8_bf16(a[i][u].x, a[i][u].y);
                        wb_h[i] = h ? e4m3x8_bf16(b[i][u].z, b[i][u].w) : e4m3x8_bf16(b[i][u].x, b[i][u].y);
                    } else {
                        wa_h[i] = a[i][u];
                        wb_h[i] = b[i][u];
                    }
                }
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    int m = g + 8 * j;
                    uint4 xv = zero;
                    if (XALL && !norm) {
                        xv = xr[XALL ? u : 0][j];
                    } else if (m < p.M) {
                        xv = norm ? xs[(m * p.K + k0) >> 3] : __ldg((const uint4*)(p.x + (size_t)m * p.K + k0));
                    }
#pragma unroll
                    for (int i = 0; i < R; i++) {
                        u32 a1[4] = {wa_h[i].x, wb_h[i].x, wa_h[i].y, wb_h[i].y};
                        u32 a2[4] = {wa_h[i].z, wb_h[i].z, wa_h[i].w, wb_h[i].w};
                        mma_bf16(acc[i][j], a1, xv.x, xv.y);
                        mma_bf16(acc[i][j], a2, xv.z, xv.w);
                    }
                }
            }
        }
        c0 += W * U;
        if (c0 >= nchunks) break;
        load(c0);
    }
    if (DN && ss_in) cp_async_wait_all();
    // Every rank started and rank 0's barrier initialised (see KS above).
    if constexpr (KS > 1) asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
    // Pairwise tree over the warps: warp w += warp w + h for h = W / 2, ..., 1.
#pragma unroll
    for (int h = W / 2; h > 0; h >>= 1) {
        if (warp >= h && warp < 2 * h) {
#pragma unroll
            for (int i = 0; i < R; i++)
#pragma unroll
                for (int j = 0; j < NT; j++)
#pragma unroll
                    for (int r = 0; r < 4; r++) red[warp - h][i][j][lane][r] = acc[i][j][r];
        }
        __syncthreads();
        if (warp < h) {
#pragma unroll
            for (int i = 0; i < R; i++)
#pragma unroll
                for (int j = 0; j < NT; j++)
#pragma unroll
                    for (int r = 0; r < 4; r++) acc[i][j][r] += red[warp][i][j][lane][r];
        }
        // Deferred norm, while the first half adds (off warp 0's path): warp W / 2 + i takes
        // rows i, i + W / 2, ...; row m's 1 / rms from its K / 16 partials in a fixed order
        // (lane l adds partials l, l + 32, ..., then a butterfly), so a row's scale never
        // depends on M or on the launch shape. (One warp for all 8 rows: the 1B's batch 8 took
        // 1.140 ms against 1.083, H200, session 29.)
        if (DN && ss_in && h == W / 2 && warp >= h) {
            const float* ssd = (const float*)xs_dyn;
            const int parts = (p.K + 15) >> 4;
            for (int m = warp - h; m < p.M && m < 8 * NT; m += h) {
                float v = 0.0f;
                for (int e = lane; e < parts; e += 32) v += ssd[m * parts + e];
                v = warp_sum(v);
                if (lane == 0) inv_sh[m] = rsqrtf(v / (float)p.K + p.eps);
            }
        }
        __syncthreads();
    }
    if (warp != 0) return;
    cp_async_wait_all();
    if constexpr (KS > 1) {
        if (rank != 0) {
            const u32 dst = cluster_map(smem_addr(kpart + (rank - 1) * R * NT * 32), 0);
            const u32 bar = cluster_map(smem_addr(&kbar), 0);
#pragma unroll
            for (int i = 0; i < R; i++)
#pragma unroll
                for (int j = 0; j < NT; j++)
                    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(
                                     dst + 16u * (u32)((i * NT + j) * 32 + lane)),
                                 "r"(__float_as_uint(acc[i][j][0])), "r"(__float_as_uint(acc[i][j][1])),
                                 "r"(__float_as_uint(acc[i][j][2])), "r"(__float_as_uint(acc[i][j][3])), "r"(bar)
                                 : "memory");
            return;
        }
        if (lane == 0)
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(&kbar)),
                         "r"((u32)((KS - 1) * R * NT * 32 * 16))
                         : "memory");
        mbar_wait_cluster(smem_addr(&kbar), 0);
#pragma unroll
        for (int q = 1; q < KS; q++)
#pragma unroll
            for (int i = 0; i < R; i++)
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    const float4 v = kpart[((q - 1) * R * NT + i * NT + j) * 32 + lane];
                    acc[i][j][0] += v.x;
                    acc[i][j][1] += v.y;
                    acc[i][j][2] += v.z;
                    acc[i][j][3] += v.w;
                }
    }
    __syncwarp();
    // Row m's sum v, scaled by its deferred norm's 1 / rms.
    auto row_scale = [&](float v, int m) { return DN && ss_in ? v * inv_sh[m] : v; };
    // Value r of lane (g, t) in tile i, n-tile j: row (r < 2 ? g : g + 8), input row 8 j + 2 t + r % 2.
    if (epi == SK_ROPE) {
        // Rows n and n + 8 of a tile are a RoPE pair of q or k (paired order), or two rows of
        // v: as rope_kv_write with the product rounded to bf16 first (what it would read).
        const SkinnyRope& ro = p.rope;
        bf16* y = (bf16*)p.y;
#pragma unroll
        for (int i = 0; i < R; i++) {
            const int n = n0 + 16 * i + g;
            if (n >= p.N) continue;
            const int h = n / ro.hd, s = n - h * ro.hd;
#pragma unroll
            for (int j = 0; j < NT; j++) {
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    const int m = 8 * j + 2 * t + r;
                    if (m >= ro.rows) continue;
                    const float a = rbf(row_scale(acc[i][j][r] * (F8 ? pre_sc[16 * i + g] : 1.0f), m));
                    const float b = rbf(row_scale(acc[i][j][r + 2] * (F8 ? pre_sc[16 * i + g + 8] : 1.0f), m));
                    const long long slot = pre_slot[m];
                    if (h >= ro.nh + ro.nkv) {
                        bf16* dst = ro.v_cache + (size_t)(slot * ro.nkv + (h - ro.nh - ro.nkv)) * ro.hd + s;
                        dst[0] = f2bf(a);
                        dst[8] = f2bf(b);
                        continue;
                    }
                    float o1, o2;
                    rope_pair(a, b, (float)pre_pos[m], pre_freq[((s >> 4) << 3) + (s & 7)], &o1, &o2);
                    bf16* dst = h < ro.nh ? y + (size_t)m * p.N + n
                                          : ro.k_cache + (size_t)(slot * ro.nkv + (h - ro.nh)) * ro.hd + s;
                    dst[0] = f2bf(o1);
                    dst[8] = f2bf(o2);
                }
            }
        }
        return;
    }
    // SK_NORM_OUT: lane (g, t)'s squares of the new residual, per tile i, n-tile j, row parity.
    float sq[R][NT][2];
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int j = 0; j < NT; j++) sq[i][j][0] = sq[i][j][1] = 0.0f;
#pragma unroll
    for (int i = 0; i < R; i++) {
#pragma unroll
        for (int j = 0; j < NT; j++) {
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const int m = 8 * j + 2 * t + (r & 1);
                if (m >= p.M || (gated && r >= 2)) continue;
                const int n = n0 + (gated ? 8 * i : 16 * i) + g + (!gated && r >= 2 ? 8 : 0);
                if (n >= p.N) continue;
                // The row's place in the block: plain 16 i + g (+ 8); gated gate 8 i + g, up + 8 R.
                const int e = n - n0;
                const float v = row_scale(acc[i][j][r] * (F8 ? pre_sc[e] : 1.0f), m);
                const size_t o = (size_t)m * p.N + n;
                if (gated) {
                    const float up = row_scale(acc[i][j][r + 2] * (F8 ? pre_sc[e + 8 * R] : 1.0f), m);
                    ((bf16*)p.y)[o] = f2bf(act_mul(rbf(v), rbf(up), epi == SK_GELU));
                } else if (epi == SK_STORE_F32) {
                    ((float*)p.y)[o] = v;
                } else if (epi == SK_RESID) {
                    bf16* y = (bf16*)p.y;
                    const u32 pr = pre_res[PRE ? m : 0][e >> 1];
                    const float res = PRE ? bf2f((bf16)(e & 1 ? pr >> 16 : pr & 0xffffu)) : bf2f(y[o]);
                    const bf16 yn = f2bf(res + rbf(v));
                    y[o] = yn;
                    if (norm_out) {  // (DN instances only: norm_out is false otherwise)
                        const float hv = bf2f(yn);
                        const u32 nw = pre_nw[e >> 1];
                        const float w = bf2f((bf16)(e & 1 ? nw >> 16 : nw & 0xffffu));
                        p.dout.u[o] = f2bf(norm_weight(hv, w, p.w_off));
                        sq[i][j][r & 1] += hv * hv;
                    }
                } else {
                    ((bf16*)p.y)[o] = f2bf(v);
                }
            }
        }
    }
    if (norm_out) {
        // A 16-column tile's sum for row m: lanes (0..7, t) hold its columns g and g + 8.
        const int parts = (p.N + 15) >> 4;
#pragma unroll
        for (int i = 0; i < R; i++)
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    float v = sq[i][j][h];
                    v += __shfl_xor_sync(0xffffffffu, v, 4);
                    v += __shfl_xor_sync(0xffffffffu, v, 8);
                    v += __shfl_xor_sync(0xffffffffu, v, 16);
                    const int m = 8 * j + 2 * t + h, tile = (n0 >> 4) + i;
                    if (g == 0 && m < p.M && tile < parts) p.dout.ss[m * parts + tile] = v;
                }
    }
}

// Instances: 8 * NT input rows (n-tiles NT), R row tiles per block (4 for the big matrices:
// fewer blocks re-read and re-normalise x).
extern "C" __global__ void __launch_bounds__(SK_WARPS * 32) skinny_gemm_8(SkinnyIn p) { skinny_gemm<1, 1, false>(p); }
extern "C" __global__ void __launch_bounds__(SK_WARPS * 32) skinny_gemm_16(SkinnyIn p) { skinny_gemm<2, 1, false>(p); }
extern "C" __global__ void __launch_bounds__(SK_WARPS * 32) skinny_gemm_32(SkinnyIn p) { skinny_gemm<4, 1, false>(p); }
extern "C" __global__ void __launch_bounds__(SK_WARPS * 32) skinny_gemm_64(SkinnyIn p) { skinny_gemm<8, 1, false>(p); }
extern "C" __global__ void __launch_bounds__(SK_WARPS * 32) skinny_gemm_8_r4(SkinnyIn p) { skinny_gemm<1, 4, false>(p); }
extern "C" __global__ void __launch_bounds__(SK_WARPS * 32) skinny_gemm_16_r4(SkinnyIn p) { skinny_gemm<2, 4, false>(p); }
// FP8 weights (e4m3, per-row scales in the epilogue; K % 64 == 0): the same shapes.
extern "C" __global__ void __launch_bounds__(SK_WARPS * 32) skinny_gemm_f8_8(SkinnyIn p) { skinny_gemm<1, 1, true>(p); }
extern "C" __global__ void __launch_bounds__(SK_WARPS * 32) skinny_gemm_f8_16(SkinnyIn p) { skinny_gemm<2, 1, true>(p); }
extern "C" __global__ void __launch_bounds__(SK_WARPS * 32) skinny_gemm_f8_32(SkinnyIn p) { skinny_gemm<4, 1, true>(p); }
extern "C" __global__ void __launch_bounds__(SK_WARPS * 32) skinny_gemm_f8_64(SkinnyIn p) { skinny_gemm<8, 1, true>(p); }
extern "C" __global__ void __launch_bounds__(SK_WARPS * 32) skinny_gemm_f8_8_r4(SkinnyIn p) { skinny_gemm<1, 4, true>(p); }
extern "C" __global__ void __launch_bounds__(SK_WARPS * 32) skinny_gemm_f8_16_r4(SkinnyIn p) { skinny_gemm<2, 4, true>(p); }
// 8-warp blocks for launches of many blocks over short rows (the host picks them: see
// skinny_w8_fits in kernels/src/lib.rs): each warp then takes twice the chunks, so fewer
// warps wait on the tree reduction and the block's fixed costs are paid by more bytes. The
// one-tile instances keep three blocks an SM (at most 85 registers): the q|k|v launches of the
// 3B and 8B shapes (320-384 blocks) then run in one wave on 132 SMs.
extern "C" __global__ void __launch_bounds__(8 * 32, 3) skinny_gemm_8_w8(SkinnyIn p) { skinny_gemm<1, 1, false, 8>(p); }
extern "C" __global__ void __launch_bounds__(8 * 32) skinny_gemm_8_r4_w8(SkinnyIn p) { skinny_gemm<1, 4, false, 8>(p); }
extern "C" __global__ void __launch_bounds__(8 * 32, 3) skinny_gemm_f8_8_w8(SkinnyIn p) { skinny_gemm<1, 1, true, 8>(p); }
extern "C" __global__ void __launch_bounds__(8 * 32) skinny_gemm_f8_8_r4_w8(SkinnyIn p) { skinny_gemm<1, 4, true, 8>(p); }
// One-tile bf16 launches of many blocks that fit one wave at two an SM or reduce over long k
// (the 1B q|k|v, the 3B and 8B o and down; the host's SKINNY_B2): 16 warps held to two blocks
// an SM (at most 64 registers; 62, no spills, where the unbound one takes 90), so a launch of
// 192-256 blocks runs in one wave on 132 SMs and the next kernel's blocks find room beside it.
extern "C" __global__ void __launch_bounds__(SK_WARPS * 32, 2) skinny_gemm_8_b2(SkinnyIn p) { skinny_gemm<1, 1, false, SK_WARPS, false, 1, false>(p); }
// The deferred norms' instances (SK_NORM_IN / SK_NORM_OUT launches, up to 8 rows), one for
// each 8-row instance above (the FP8 ones for fused FP8 steps, HARRIER_FP8_FUSED=0: none).
extern "C" __global__ void __launch_bounds__(SK_WARPS * 32) skinny_gemm_8_dn(SkinnyIn p) { skinny_gemm<1, 1, false, SK_WARPS, true>(p); }
extern "C" __global__ void __launch_bounds__(SK_WARPS * 32) skinny_gemm_8_r4_dn(SkinnyIn p) { skinny_gemm<1, 4, false, SK_WARPS, true>(p); }
extern "C" __global__ void __launch_bounds__(8 * 32, 3) skinny_gemm_8_w8_dn(SkinnyIn p) { skinny_gemm<1, 1, false, 8, true>(p); }
extern "C" __global__ void __launch_bounds__(8 * 32) skinny_gemm_8_r4_w8_dn(SkinnyIn p) { skinny_gemm<1, 4, false, 8, true>(p); }
extern "C" __global__ void __launch_bounds__(SK_WARPS * 32, 2) skinny_gemm_8_b2_dn(SkinnyIn p) { skinny_gemm<1, 1, false, SK_WARPS, true, 1, false>(p); }
// The b2 instances with K in two parts a cluster of two blocks (see KS above; sm_90 on, the
// host's SKINNY_K2): one-tile launches of up to 132 tiles from twice the SMs.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define SK_K2(...) skinny_gemm<__VA_ARGS__>(p);
#else
#define SK_K2(...) __trap();
#endif
extern "C" __global__ void __launch_bounds__(SK_WARPS * 32, 2) skinny_gemm_8_b2_k2(SkinnyIn p) { SK_K2(1, 1, false, SK_WARPS, false, 2, false) }
extern "C" __global__ void __launch_bounds__(SK_WARPS * 32, 2) skinny_gemm_8_b2_dn_k2(SkinnyIn p) { SK_K2(1, 1, false, SK_WARPS, true, 2, false) }
// The same for launches the b2 instances take (160-198 tiles over reductions from 3,072: the
// 3B's and Qwen3-4B's o and down; the host's SKINNY_K2_W8) in 8-warp blocks, three an SM: twice
// the blocks on all SMs instead of two an SM on some.
extern "C" __global__ void __launch_bounds__(8 * 32, 3) skinny_gemm_8_w8_k2(SkinnyIn p) { SK_K2(1, 1, false, 8, false, 2) }
extern "C" __global__ void __launch_bounds__(8 * 32, 3) skinny_gemm_8_w8_dn_k2(SkinnyIn p) { SK_K2(1, 1, false, 8, true, 2) }
extern "C" __global__ void __launch_bounds__(SK_WARPS * 32, 2) skinny_gemm_16_b2_k2(SkinnyIn p) { SK_K2(2, 1, false, SK_WARPS, false, 2) }
extern "C" __global__ void __launch_bounds__(SK_WARPS * 32, 2) skinny_gemm_16_b2_dn_k2(SkinnyIn p) { SK_K2(2, 1, false, SK_WARPS, true, 2) }
extern "C" __global__ void __launch_bounds__(8 * 32, 3) skinny_gemm_16_w8_k2(SkinnyIn p) { SK_K2(2, 1, false, 8, false, 2) }
extern "C" __global__ void __launch_bounds__(8 * 32, 3) skinny_gemm_16_w8_dn_k2(SkinnyIn p) { SK_K2(2, 1, false, 8, true, 2) }
#undef SK_K2
// The bf16 16-row (two n-tile) twins of the 8-row instances above, chosen by the same rules for
// steps of 9-16 rows (the host's skinny_instance; their deferred norms included).
extern "C" __global__ void __launch_bounds__(8 * 32, 3) skinny_gemm_16_w8(SkinnyIn p) { skinny_gemm<2, 1, false, 8>(p); }
extern "C" __global__ void __launch_bounds__(8 * 32) skinny_gemm_16_r4_w8(SkinnyIn p) { skinny_gemm<2, 4, false, 8>(p); }
extern "C" __global__ void __launch_bounds__(SK_WARPS * 32, 2) skinny_gemm_16_b2(SkinnyIn p) { skinny_gemm<2, 1, false>(p); }
extern "C" __global__ void __launch_bounds__(SK_WARPS * 32) skinny_gemm_16_dn(SkinnyIn p) { skinny_gemm<2, 1, false, SK_WARPS, true>(p); }
extern "C" __global__ void __launch_bounds__(SK_WARPS * 32) skinny_gemm_16_r4_dn(SkinnyIn p) { skinny_gemm<2, 4, false, SK_WARPS, true>(p); }
extern "C" __global__ void __launch_bounds__(8 * 32, 3) skinny_gemm_16_w8_dn(SkinnyIn p) { skinny_gemm<2, 1, false, 8, true>(p); }
extern "C" __global__ void __launch_bounds__(8 * 32) skinny_gemm_16_r4_w8_dn(SkinnyIn p) { skinny_gemm<2, 4, false, 8, true>(p); }
extern "C" __global__ void __launch_bounds__(SK_WARPS * 32, 2) skinny_gemm_16_b2_dn(SkinnyIn p) { skinny_gemm<2, 1, false, SK_WARPS, true>(p); }
extern "C" __global__ void __launch_bounds__(SK_WARPS * 32) skinny_gemm_f8_8_dn(SkinnyIn p) { skinny_gemm<1, 1, true, SK_WARPS, true>(p); }
extern "C" __global__ void __launch_bounds__(SK_WARPS * 32) skinny_gemm_f8_8_r4_dn(SkinnyIn p) { skinny_gemm<1, 4, true, SK_WARPS, true>(p); }
extern "C" __global__ void __launch_bounds__(8 * 32, 3) skinny_gemm_f8_8_w8_dn(SkinnyIn p) { skinny_gemm<1, 1, true, 8, true>(p); }
extern "C" __global__ void __launch_bounds__(8 * 32) skinny_gemm_f8_8_r4_w8_dn(SkinnyIn p) { skinny_gemm<1, 4, true, 8, true>(p); }

// The persistent decode step (one token: the engine's batch-1 decode steps of Llama-shaped
// models with bf16 layers, or FP8 ones in gemv_ring_f8 (see "FP8 weights in the ring" above),
// executor `ring`; and `harrier-cuda-tool bench-ring`'s chains of projections): every
// layer's projections and attention, and the output head, in one launch of one block an SM,
// where the weights never wait for the activations. A producer lane streams this block's share
// of every stage's weights, in order and across stage boundaries, into a ring of
// RING_SLOT-byte shared-memory slots with bulk async copies (cp.async.bulk, mbarrier
// completion; the body's SLOT, with CW = SLOT / 2048 consumer warps: RING_SLOT and RING_CW in
// gemv_ring and gemv_ring_f8, 24 KB and 12 in the _s24 instances, and below wherever RING_SLOT or
// RING_CW is named); RING_CW consumer warps wait per stage for the previous stage's outputs (a
// counter per stage that every block bumps once), stage its input in shared memory as bf16
// and reduce each slot against it. (Session 17 measured the projections alone against the
// engine's skinny launches: H200 1.15x / 1.14x / 1.18x on the 1B / 3B / 8B shapes.)
// A stage's items (GEMV slots, MLP and GEMVT chunks) are shared out in fixed runs, the +1
// remainders rotating over blocks from stage to stage (every block streams the same bytes in
// total), except a GEMV stage of at least 8 slots a block (the output head; the 8B's q|k|v):
// its producers claim two slots at a time from the stage's claim counter (one claim ahead, so
// the round trip runs while the slots before stream), tag the slots with their items and end
// with an empty slot tagged -1, so that a block that streams faster takes more (the head's
// blocks ended ~10 us apart in fixed runs). A warp's sums are added per slot (or over a
// claim's two), never over slots that another block could have taken: the values added do
// not depend on who took what. (Claimed MLP chunks, whose down sums would then be added per
// chunk or per fixed unit, cost 1B 1.03 -> 1.18 ms in atomics; session 19.)
// Five kinds of stage (RingStage.kind):
// - GEMV: y[N] += W[N, K] x. The flat row-major matrix is cut into slots; warp w reduces
//   weights [1024 w, +1024) of a slot (one row, as K % 1024 == 0) and adds its row's sum into
//   y with an atomic (over a run's, or a claim's, consecutive slots of one row).
// - MLP (w2 = down^T, [N, K]): y[K] += down(silu(gate x) * (up x)) with w = [gate; up] ([2N, K],
//   N the intermediate size) and no dependency inside: a block takes a contiguous run of chunks
//   of CR intermediate rows (ring_chunk_rows) and streams, per chunk, the gate
//   rows, the up rows and the down^T rows (a slot each); the chunk's CR activations are formed
//   once each (rounded as the skinny SiLU epilogue) and each thread keeps up to RING_MLP_COLS
//   down sums in registers for the whole run, added into y with vector atomics at its end. The
//   split-K down projection needs no other block's gate|up rows: the layer's second grid-wide
//   wait is gone. (CR * K / 1024 <= RING_CW: a warp a gate|up part, CR <= 16 lanes.)
// - ATTN (no weights; the producer moves on to the next stage's): x is the layer's q|k|v
//   sums (q and k rows in the paired RoPE order). Block b < nkv * S (S = gridDim.x / nkv
//   splits of the context) takes KV head b / S and split b % S: it rotates its q heads (and,
//   holding the new token's position, the new key, which it writes to the cache with v) and
//   writes its partial output and (max, sum) to `part`. Rounded as the engine's launches: q
//   and k as the skinny RoPE epilogue, the probabilities as paged_attention's V operand.
// - GEMVT (w = W^T, [K, N]): y[N] += W x, split-K: a block takes a contiguous run of chunks of
//   CR input rows (ring_chunk_rows(N), a slot each), stages only those rows of x, and keeps its
//   N column sums in registers as the MLP's down part does (N <= 32 * RING_CW * RING_MLP_COLS).
//   After an ATTN stage (o, x_form RING_X_PARTS) its rows are merged from the splits
//   (flash-decoding's combine, rounded to bf16): no block waits on another's merge and none
//   reads more than its rows' partials.
// - CVT (no weights; the last stage): y[N] (f32) = x (the head's sums), each block its share.
// LL words (session 31; NCCL's low-latency protocol): a q|k|v stage (GEMV with `ll`) stores each
// warp's piece sum (1,024 weights; y[piece], K / 1024 a row) with the launch's tag for its stage
// in one 8-byte store, and the ATTN stage stores its partials so; their readers (the ATTN stage,
// the o stage's merge) poll the words they need until each carries the tag. Neither boundary
// is a grid-wide wait: no count, no release (a MEMBAR.GPU) and no poll before the data's own
// round trip, and a block waits only for the blocks that write its inputs. A piece's value is
// one warp's sum, and the reader adds a row's pieces in order: deterministic. Tags: (launch
// epoch + 1) n + stage (u32); the epoch, done[2n], goes up by one at every launch's end (the
// last block), so no word of an earlier stage, layer or launch carries a current tag.
// Every sum (y of GEMV, GEMVT and MLP stages) is split in two f32 halves, y[0, len) and
// y[len, 2 len) (ring_split): each added value c is cut into hi = c rounded to 2^-8 and
// lo = c - hi rounded to 2^-25, so every partial sum of either half is exactly representable
// (|sum| < 2^16, at most 256 adders an address) and fp32 atomics give the same bits in any
// order: a step's outputs do not depend on which block adds first, and graph replays agree
// with eager steps bit for bit, as the launches do (plain fp32 atomics made greedy tokens of a
// random 1B differ run to run). The reader's hi + lo keeps 2^-25 absolute, far inside the bf16
// rounding of every stage input. (64-bit fixed-point atomics did the same and cost the 1B's
// step 0.95 -> 1.22 ms, 1.14 with four replicas a sum; session 18.) x_len is the length of
// the sums a stage reads (where their lo half starts).
// K % 1024 == 0 (MLP: 2K <= RING_SLOT, K <= 32 * RING_CW * RING_MLP_COLS, N % CR == 0; FP8
// stages 4 <= CR <= 16, that is 2048 <= K <= 8192, the chunks of GEMVT stages as the MLP's);
// N * K < 2^31. One block an SM, every block resident (the stages wait on each other across
// blocks). A stage zeroes `zero` (zero_len u64 words, in block shares) once it has waited:
// the host points it at sums whose readers have all finished (a stage after a grid-wide wait:
// the host's `zeroed_by`), so the next launch finds them zero; the last block to finish zeroes
// the counters (done[0, n), the stages' blocks done, and done[n, 2n), their claims; a step
// needs no memset; the first launch needs them zero; a launch must not start before the one
// before has finished, as PDL with a launch between them guarantees: the producer claims
// before its PDL wait) and bumps the LL epoch, done[2n].
// A stage's input, staged once in every block: x (x_form: the stage before's sums, bf16 for
// the embedding, or an ATTN stage's partials), or with
// `res` the residual add r = bf16(res + bf16(x)) (block 0 writes r to `res_out` for the stages
// after), and with `norm_w` RMSNorm(r) rounded as add_rmsnorm writes it (bf16(w * bf16(r * inv))).
#define RING_GEMV 0
#define RING_MLP 1
#define RING_ATTN 2
#define RING_GEMVT 3
#define RING_CVT 4
#define RING_X_SUMS 0
#define RING_X_BF16 1
#define RING_X_PARTS 2
// A GEMV stage's outputs (RingStage::ll): exactly added sums (0), LL words (1), or each row's
// f32 value stored once by the one warp that computed it whole (RING_OUT_ROWS: the head of a
// 2,048-wide model, which then writes the logits itself, with no conversion stage).
#define RING_OUT_LL 1
#define RING_OUT_ROWS 2
struct RingStage {
    const bf16* w;
    const bf16* w2;
    const float* x;
    float* y;
    const float* res;
    float* res_out;
    const bf16* norm_w;
    bf16* k_cache;
    bf16* v_cache;
    const float* inv_freq;
    float* part;
    unsigned long long* zero;
    int kind;
    int N, K;
    float eps;
    int x_form;
    int nh, nkv, hd;
    float scale;
    int zero_len;
    int x_len;
    int ll;            // GEMV: y as LL words, a 1,024-weight piece each (ring_ll_put), for an ATTN stage; or RING_OUT_ROWS
    const float* ws;   // FP8 weights where not null (gemv_ring_f8): w's scales, one an output channel
    const float* ws2;  // and w2's (MLP: down^T's columns)
};
// The decode step's token (RING_ATTN stages): the engine's step metadata for one row.
struct RingStep {
    const int* positions;
    const int* slot_mapping;
    const int* block_tables;
    const int* tok_row;
    int bt_stride, block_size;
};
#ifndef RING_CW
#define RING_CW 16
#endif
#ifndef RING_SLOT
#define RING_SLOT 32768
#endif
#define RING_MAX_SLOTS 16
// f32 beside each slot of gemv_ring_f8: an FP8 GEMV or gate|up slot's row scales (from the
// 16-byte boundary at or before its first row: with K >= 2048, at most 16 rows and 3 before).
#define RING_SLOT_SCALES 64
#define RING_MLP_COLS 16  // down sums a thread keeps: K <= RING_CW * 32 * 16
// Rows of K weights of wb bytes (2: bf16, 1: FP8) in a chunk (an MLP chunk's intermediate rows,
// a GEMVT chunk's input rows) with SLOT-byte slots: the largest power of two with CR K wb <= SLOT.
template <int SLOT>
__device__ __forceinline__ int ring_chunk_rows(int K, int wb = 2) {
    int cr = 1;
    while (2 * wb * cr * K <= SLOT) cr *= 2;
    return cr;
}
// The block's run of a stage's `items` (slots, or MLP chunks): [start, start + count); `off`
// carries the rotation.
__device__ __forceinline__ void ring_share(int items, int& off, int& start, int& count) {
    const int g = gridDim.x, base = items / g, rem = items % g;
    const int v = ((int)blockIdx.x - off + g) % g;
    count = base + (v < rem);
    start = v * base + min(v, rem);
    off = (off + rem) % g;
}
// n / d for a divisor d fixed over a loop, by a multiply-high with m = ring_div_magic(d) =
// ceil(2^32 / d) (2^32 / d for a power of two; d == 1 takes n): exact for n < 2^28 and d <= 16,
// as n (m d - 2^32) < 2^32. A division by a runtime value is ~20 instructions.
__device__ __forceinline__ unsigned int ring_div_magic(unsigned int d) { return 0xffffffffu / d + 1u; }
__device__ __forceinline__ unsigned int ring_div(unsigned int n, unsigned int d, unsigned int m) {
    return d == 1 ? n : __umulhi(n, m);
}
// Where block b's even share of len elements starts (block b + 1's start ends it).
// (32-bit: len gridDim < 2^32, as len <= the vocabulary, whose head has vocab hidden < 2^31
// weights; a 64-bit division was ~70 instructions at each of four sites.)
__device__ __forceinline__ int ring_block_part(int len, unsigned int b) { return (int)((unsigned int)len * b / gridDim.x); }
// The items (slots, or chunks) a stage of `kind`, N and K streams: none for ATTN and CVT.
template <int SLOT>
__device__ __forceinline__ int ring_items(int kind, int N, int K, int wb = 2) {
    if (kind == RING_ATTN || kind == RING_CVT) return 0;
    if (kind == RING_MLP) return N / ring_chunk_rows<SLOT>(K, wb);
    if (kind == RING_GEMVT) return K / ring_chunk_rows<SLOT>(N, wb);
    const unsigned int bytes = (unsigned int)N * (unsigned int)K * (unsigned int)wb;
    return (int)((bytes + SLOT - 1) / SLOT);
}
template <int SLOT>
__device__ __forceinline__ int ring_items(const RingStage& st, int wb = 2) { return ring_items<SLOT>(st.kind, st.N, st.K, wb); }
// Slots a claim takes, or 0 where a stage's items are shared out in fixed runs (see the
// kernel's header): GEMV stages of at least 8 slots a block (the output head, the 8B's
// q|k|v), two slots a claim (fewer slots are as even in fixed runs, and a claim's round trip
// would show).
#ifdef RING_MLP_CLAIM  // measurement: bf16 MLP chunks claimed one at a time (sums order-dependent)
#define RING_MLP_CLAIMED true
#else
#define RING_MLP_CLAIMED false
#endif
template <int SLOT>
__device__ __forceinline__ int ring_unit(int kind, int N, int K, int wb = 2) {
#ifdef RING_NO_CLAIM  // measurement: fixed runs only
    return 0;
#endif
    if (RING_MLP_CLAIMED && kind == RING_MLP && wb == 2) return 1;
    return kind == RING_GEMV && ring_items<SLOT>(kind, N, K, wb) >= 8 * (int)gridDim.x ? 2 : 0;
}
// c = hi + lo as the sums' halves take it (see the kernel's header).
__device__ __forceinline__ void ring_split(float c, float& hi, float& lo) {
    hi = rintf(c * 256.0f) * (1.0f / 256.0f);
    lo = rintf((c - hi) * 33554432.0f) * (1.0f / 33554432.0f);
}
// Sum i of a stage output of `len` sums.
__device__ __forceinline__ float ring_sum(const float* y, size_t i, size_t len) { return __ldcg(y + i) + __ldcg(y + len + i); }
// LL words (see the kernel's header): a value and its writer's tag in one single-copy-atomic
// 8-byte access, relaxed at gpu scope (L2, never a stale L1 line).
__device__ __forceinline__ void ring_ll_put(unsigned long long* y, size_t i, float v, u32 tag) {
    const unsigned long long w = ((unsigned long long)tag << 32) | __float_as_uint(v);
    asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(y + i), "l"(w) : "memory");
}
__device__ __forceinline__ unsigned long long ring_ll_ld(const unsigned long long* p) {
    unsigned long long w;
    asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(w) : "l"(p) : "memory");
    return w;
}
// Word w's value once it carries `tag` (polling from p).
__device__ __forceinline__ float ring_ll_val(unsigned long long w, const unsigned long long* p, u32 tag) {
#ifdef RING_LL_BACKOFF  // measurement: ns between polls
    while ((u32)(w >> 32) != tag) __nanosleep(RING_LL_BACKOFF), w = ring_ll_ld(p);
#else
    while ((u32)(w >> 32) != tag) w = ring_ll_ld(p);
#endif
    return __uint_as_float((u32)w);
}
// Rows a and b of a q|k|v stage's LL output (`parts` pieces a row): each the sum of its pieces
// in order, R pieces of each row a round trip (every load of a round in flight at once; R = 4
// made the 16-warp instances spill, so they take 2: the 1B's rows in one round, the 8B's two).
template <int R>
__device__ __forceinline__ void ring_ll_rows(const unsigned long long* y, int a, int b, int parts, u32 tag, float& va,
                                             float& vb) {
    const unsigned long long* pa = y + (size_t)a * parts;
    const unsigned long long* pb = y + (size_t)b * parts;
    va = 0.0f, vb = 0.0f;
    for (int p0 = 0; p0 < parts; p0 += R) {
        unsigned long long w[2 * R];
#pragma unroll
        for (int i = 0; i < R; i++)
            if (p0 + i < parts) w[i] = ring_ll_ld(pa + p0 + i), w[R + i] = ring_ll_ld(pb + p0 + i);
#pragma unroll
        for (int i = 0; i < R; i++)
            if (p0 + i < parts) va += ring_ll_val(w[i], pa + p0 + i, tag);
#pragma unroll
        for (int i = 0; i < R; i++)
            if (p0 + i < parts) vb += ring_ll_val(w[R + i], pb + p0 + i, tag);
    }
}
__device__ __forceinline__ void ring_add(float* y, size_t i, size_t len, float c) {
    float hi, lo;
    ring_split(c, hi, lo);
    atomicAdd(y + i, hi);
    atomicAdd(y + len + i, lo);
}
// FP8 weights in the ring (gemv_ring_f8; session 25): e4m3 multiplied on the tensor cores
// (mma.sync m16n8k16: e4m3 converts to f16 exactly, products and sums in f32) against the
// stage's input as f16 (bf16 to f16 is exact but for magnitudes past 65,504, saturated, or
// below 2^-14, where f16 keeps fewer bits: far from a normed input's range). On the CUDA cores
// an e4m3 weight took ~5 instructions (session 20: the consumer, not the stream, was the FP8
// ring's limit); here 16 weights take about 15 a lane.
// Four e4m3 (bytes 0..3 of p) as two f16x2: bytes 0, 1 in lo (byte 0 the low half), 2, 3 in hi.
// (The conversion instruction, F2FP: moving each byte into f16's fields with integer operations,
// as e4m3x2_bf16x2 does for bf16, took the FP8 1B's step 0.665 -> 0.757 ms; session 25.)
__device__ __forceinline__ void e4m3x4_f16x2(u32 p, u32& lo, u32& hi) {
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e4m3x2 %0, l; cvt.rn.f16x2.e4m3x2 %1, h; }"
        : "=r"(lo), "=r"(hi)
        : "r"(p));
}
// f16x2 of (lo, hi), saturated to f16's range.
__device__ __forceinline__ u32 f16x2_sat(float lo, float hi) {
    u32 r;
    asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// c += A B for one m16n8k16 tile (f16 operands, f32 sums).
__device__ __forceinline__ void mma_f16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// Where natural 8-element unit j of an FP8 stage's f16 input goes in shared memory: the 16
// inputs of lane l's 16 weights of a 512-weight piece (k from 16 (32 piece + l)) are uint4
// 64 piece + l and 64 piece + 32 + l (consecutive lanes, consecutive uint4: no bank conflicts).
__device__ __forceinline__ int ring_f8_xpos(int j) { return ((j >> 6) << 6) + ((j & 1) << 5) + ((j >> 1) & 31); }
// The dot product of a 1024-weight e4m3 unit `w` of one row with its input `xh` (the unit's
// f16 input at ring_f8_xpos order: uint4 col0 / 8 on), by the diagonal of tensor-core tiles:
// lane l's 16 weights of a piece are A's rows g = l / 4 and g + 8 at k 2t.. (t = l % 4; A
// elements as loaded, no shuffle), and the lane's 16 inputs B's column g, so that C[g][g] and
// C[g + 8][g] are the lanes' dot products (the rest of C is unused). Returns the lane's part:
// nonzero in the 8 diagonal lanes, to be summed over the warp.
__device__ __forceinline__ float ring_f8_dot(const uint4* w, const uint4* xh, int lane) {
    float ca[4] = {0.0f, 0.0f, 0.0f, 0.0f}, cb[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int it = 0; it < 2; it++) {
        const uint4 v = w[it * 32 + lane], x0 = xh[it * 64 + lane], x1 = xh[it * 64 + 32 + lane];
        u32 a[8];
        e4m3x4_f16x2(v.x, a[0], a[1]);
        e4m3x4_f16x2(v.y, a[2], a[3]);
        e4m3x4_f16x2(v.z, a[4], a[5]);
        e4m3x4_f16x2(v.w, a[6], a[7]);
        // (x0, x1 as bf16x8_f16 stages them: B's two registers of each tile adjacent.)
        mma_f16(ca, a[0], a[1], a[2], a[3], x0.x, x0.y);
        mma_f16(cb, a[0], a[1], a[2], a[3], x0.z, x0.w);
        mma_f16(ca, a[4], a[5], a[6], a[7], x1.x, x1.y);
        mma_f16(cb, a[4], a[5], a[6], a[7], x1.z, x1.w);
    }
    const int g = lane >> 2;
    return (lane & 3) == (g >> 1) ? ((g & 1) ? ca[1] + cb[3] : ca[0] + cb[2]) : 0.0f;
}
// Eight bf16 (elements 0..7) as f16 (saturated), pairs 01, 45, 23, 67: ring_f8_dot's B
// operands of one tile (01 with 45, 23 with 67) in adjacent registers as loaded (in natural
// order the MMAs' operands took moves: 89 more in the FP8 ring's code, FP8 1B 0.666 against
// 0.659 ms; session 26).
__device__ __forceinline__ uint4 bf16x8_f16(uint4 v) {
    const u32 a[4] = {v.x, v.y, v.z, v.w};
    u32 r[4];
#pragma unroll
    for (int i = 0; i < 4; i++) r[i] = f16x2_sat(__uint_as_float(a[i] << 16), __uint_as_float(a[i] & 0xffff0000u));
    return make_uint4(r[0], r[2], r[1], r[3]);
}
// Pairs of 32 columns an FP8 split-K warp keeps, at most (RING_F8_OCT accumulator sets of 8).
#define RING_F8_OCT 2
// FP8 split-K rows (an MLP chunk's down^T, a GEMVT chunk): c += h^T d over the chunk's `rows`
// (4 to 16, a multiple of 4) rows of `cols` e4m3, for this warp's P pairs of 32 columns from
// pair p0, on the tensor cores. The host rotates row r's columns by 32 ((r % rows) / 4) bytes,
// so that a lane's 4-byte loads meet no bank twice. Lane (g, t) (g = lane / 4, t = lane % 4)
// loads rows 4t..4t+3 of a pair's columns 4g..4g+3: A is two tiles (columns 4g, 4g+1 and 4g+2,
// 4g+3 as tile rows g, g+8; row 4t+i as k 2t+i, or 2t+6+i for i >= 2), B is h (hb0 = h[4t],
// h[4t+1], hb1 = h[4t+2], h[4t+3] as f16x2) in column n = p % 8 alone, so one accumulator set
// takes eight pairs: lane (g, t) ends with pair 8o+2t's columns 4g..4g+3 in c[o][0, 2, 4, 6]
// and pair 8o+2t+1's in c[o][1, 3, 5, 7].
__device__ __forceinline__ void ring_f8_rows(float (&c)[RING_F8_OCT][8], const unsigned char* d, int cols, int rows, int p0, int P,
                                             u32 hb0, u32 hb1, int lane) {
    const int g = lane >> 2, t = lane & 3;
    const bool on = 4 * t < rows;
    const unsigned char* rw = d + (size_t)(4 * t) * cols;
#pragma unroll
    for (int o = 0; o < RING_F8_OCT; o++) {
#pragma unroll
        for (int j = 0; j < 8; j++) {
            if (8 * o + j >= P) break;
            const u32 b0 = g == j ? hb0 : 0u, b1 = g == j ? hb1 : 0u;
            u32 r[4] = {0u, 0u, 0u, 0u};
            if (on) {
                int col = 32 * (p0 + 8 * o + j) + 4 * g + 32 * t;
                if (col >= cols) col -= cols;
#pragma unroll
                for (int i = 0; i < 4; i++) r[i] = *(const u32*)(rw + i * cols + col);
            }
            u32 a0, a1, a2, a3;
            e4m3x4_f16x2(__byte_perm(r[0], r[1], 0x5140), a0, a1);
            e4m3x4_f16x2(__byte_perm(r[2], r[3], 0x5140), a2, a3);
            mma_f16(c[o], a0, a1, a2, a3, b0, b1);
            e4m3x4_f16x2(__byte_perm(r[0], r[1], 0x7362), a0, a1);
            e4m3x4_f16x2(__byte_perm(r[2], r[3], 0x7362), a2, a3);
            mma_f16(c[o] + 4, a0, a1, a2, a3, b0, b1);
        }
    }
}
// The global timer (ns), for traces.
__device__ __forceinline__ unsigned long long ring_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// u64 a stage and block of a trace (`trace`, below).
#define RING_TRACE_WORDS 8
// RING_MLP_TRACE (measurement): an MLP stage's thread 0 also stamps words 3 (the first chunk's
// gate and up slots taken), 5 (the last chunk's down slot taken), 6 (its chunks done), 7 (its
// sums added) and stores in word 4 the ns it waited for full slots in the stage;
// RING_MLP_TRACE=2 (FP8) stamps in 3 its sums staged instead (its own in shared memory, the
// partner's pushed), and in 5 its partner's sums landed (a pair's), and the o stages too (3, 5,
// 7).
#ifdef RING_MLP_TRACE
#define RING_MLP_STAMP(i) \
    if (tr && ct == 0) tr[i] = ring_now()
#if RING_MLP_TRACE == 2
#define RING_MLP_STAMP1(i)
#define RING_MLP_STAMP2(i) RING_MLP_STAMP(i)
#else
#define RING_MLP_STAMP1(i) RING_MLP_STAMP(i)
#define RING_MLP_STAMP2(i)
#endif
#else
#define RING_MLP_STAMP(i)
#define RING_MLP_STAMP1(i)
#define RING_MLP_STAMP2(i)
#endif
// Keys of an attention tile (RING_ATTN), and the shared memory an ATTN stage takes beside the
// ring (in the input's place; the host sizes that region for both): the tile's K and V rows
// (bf16, KT hd each; a K row padded by 8 so that the scores' lanes, a key each, read
// different banks), the new key and value (bf16, hd each), q of the block's heads (G hd f32),
// the tile's scores / probabilities (KT G), and each head's running max, sum and correction.
// (48: a split of 16 takes 768 keys in one tile; 32 made 513-576, the benchmarks' contexts, two.)
#define RING_KT 48
#define RING_PRAGMA_STR(x) #x
#define RING_PRAGMA(x) _Pragma(RING_PRAGMA_STR(x))
static_assert(RING_KT >= 32 && RING_KT <= 64, "the softmax takes keys lane and lane + 32 of a tile");
__host__ __device__ constexpr int ring_attn_smem(int G, int hd) {
    return 4 * (RING_KT * hd + hd + G * hd + RING_KT * G + 3 * G) + 16 * RING_KT;
}
// The consumers' barrier (named barrier 1, the `nct` consumer threads; the producer warp never
// takes part). `site` names the call for -DRING_BAR_CHECK (measurement, session 47: does every
// consumer warp arrive at each of the barrier's phases? Each arriving group of a warp adds its
// size to the warp's count first; after the barrier thread 0 compares every warp's count with
// its own and keeps, per stage, the violations, the first one's site, warp and count
// difference (threads, absolute), written to trace words 3-6 at the stage's end;
// `ring_blocks.py --barriers`).
#ifdef RING_BAR_CHECK
__shared__ unsigned int ring_barc[32], ring_bad[4];
#endif
__device__ __forceinline__ void ring_cbar(int nct, int site) {
#ifdef RING_BAR_CHECK
    {
        const unsigned int m = __activemask();
        if ((threadIdx.x & 31) == (unsigned int)(__ffs(m) - 1)) atomicAdd(&ring_barc[threadIdx.x >> 5], (unsigned int)__popc(m));
    }
#endif
    asm volatile("bar.sync 1, %0;" ::"r"(nct) : "memory");
#ifdef RING_BAR_CHECK
    if (threadIdx.x == 0) {
        volatile unsigned int* c = ring_barc;
        const unsigned int mine = c[0];
        for (int w = 1; w < nct / 32; w++) {
            const unsigned int o = c[w];
            if (o < mine || ((o - mine) & 31u)) {
                if (ring_bad[0]++ == 0) ring_bad[1] = site, ring_bad[2] = w, ring_bad[3] = o < mine ? mine - o : o - mine;
            }
        }
    }
#endif
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
// One ATTN stage in this block (see the kernel's header); `wait()` waits for the q|k|v stage.
// Every dependent global round trip here runs while the weight stream saturates HBM (1-2 us
// each), so the block first copies its first tile's K and V rows from the cache into shared
// memory (cp.async; their slots need only the step's metadata) and only then waits: after the
// wait, one round trip for q|k|v. G hd <= 2 nct, hd a power of two from 16 to 256, the KV
// block size a power of two.
// `tr` (a traced launch's stage entry, else null): with -DRING_ATTN_TRACE (measurement: a
// build with the stamps always in took the untraced 1B 0.985 ms where session 21's other calls
// had 0.965-0.976, on another machine; not settled, so they stay out) thread 0 stamps its
// q|k|v loads and RoPE done (tr[3]), the first tile staged (tr[4]), its scores (tr[5]), its
// P V (tr[6]) and its partial stored (tr[7]). With -DRING_ATTN_WTRACE too (measurement, session
// 46: who is late in the scores) words 6 and 7 are the slowest warp's own scores loop (ns) and
// the last warp's end; with RING_ATTN_WTRACE=2 the other warps' last end and warp 0's start;
// with RING_ATTN_WTRACE=3 the last warp's arrival at the first tile's barrier (its K copies
// landed) and warp 0's start (is tr[4], read right after that barrier, its release?).
// `tag`: the stage's LL tag (its partials'; the q|k|v words it reads carry tag - 1); LLR:
// ring_ll_rows's round.
// The block's split is the same in every layer (a launch decodes one token): its position, key
// range, new slot, block-table row and first tile's cache rows are read by the first ATTN stage
// into `meta` (shared memory) and reused, so a later layer's stage issues its first tile's
// copies with no dependent load before its q|k|v reads (with the LL words, which need no grid
// wait, the metadata's and the block table's round trips came first: session 31).
struct RingAttnMeta {
    long long slot;  // the new token's cache slot
    int ready, pos, k0, k1, row;
    int first[RING_KT];  // the cache row of key k0 + j of the first tile (-1: the new token's)
};
template <int LLR, typename Wait>
__device__ void ring_attention(const RingStage& st, const RingStep& step, unsigned char* sm, int ct, int nct, Wait wait,
                               unsigned long long* tr, u32 tag, RingAttnMeta& meta) {
    const int G = st.nh / st.nkv, hd = st.hd, S = max(1, (int)gridDim.x / st.nkv);
    if ((int)blockIdx.x >= st.nkv * S) {
        wait();
        if (tr && ct == 0) tr[1] = ring_now();
        return;
    }
    const int kh = blockIdx.x / S, sp = blockIdx.x % S, warp = ct >> 5, lane = ct & 31;
    const int ldk = hd + 8;                  // (a K row's stride: 16 bytes of padding)
    bf16* ks = (bf16*)sm;                    // [KT][ldk]
    bf16* vs = ks + RING_KT * ldk;           // [KT][hd]
    bf16* knew = vs + RING_KT * hd;          // [hd], then the value [hd]
    bf16* vnew = knew + hd;
    float* qs = (float*)(vnew + hd);         // [G][hd]
    float* sc = qs + G * hd;                 // [KT][G]
    float* mls = sc + RING_KT * G;           // max, sum, correction: [3][G]
    // The block size and hd are powers of two (the host's condition): shifts, not divisions
    // (each division inlined ~25 instructions wherever a tile loads: session 24).
    const int bsh = __ffs(step.block_size) - 1, hsh = __ffs(hd) - 1, csh = hsh - 3;  // (csh: hd / 8 chunks a row)
    if (!meta.ready) {  // (block-uniform; set below, after every thread has read it)
        if (ct == 0) {
            const int p = step.positions[0], r = step.tok_row[0];
            const long long sl = step.slot_mapping[0];
            const int n = max(p + 1, 0), per = (n + S - 1) / S, a = min(sp * per, n);
            meta.pos = p, meta.row = r, meta.slot = sl, meta.k0 = a, meta.k1 = min(a + per, n);
        }
        ring_cbar(nct, 1);
        const int* bt0 = step.block_tables + (size_t)meta.row * step.bt_stride;
        for (int j = ct; j < min(RING_KT, meta.k1 - meta.k0); j += nct) {
            const int p = meta.k0 + j;
            meta.first[j] = p == meta.pos ? -1 : (bt0[p >> bsh] << bsh) + (p & ((1 << bsh) - 1));
        }
        ring_cbar(nct, 2);
        if (ct == 0) meta.ready = 1;
    }
    const int pos = meta.pos, k0 = meta.k0, k1 = meta.k1;
    const bool has_new = k0 <= pos && pos < k1;
    const int* bt = step.block_tables + (size_t)meta.row * step.bt_stride;
    const size_t kv_stride = (size_t)st.nkv * hd;
    // Tile [t0, t0 + kt)'s K (v = 0) or V (v = 1) rows into shared memory as one cp.async
    // group: the cached ones, and the new token's from knew / vnew (the first tile, loaded
    // before those exist, gets it later).
    auto load_rows = [&](int v, int t0, int kt) {
        bf16* rows = v ? vs : ks;
        const int ld = v ? hd : ldk;
        const bf16* cache = (v ? st.v_cache : st.k_cache) + (size_t)kh * hd;
#pragma unroll 1  // (one or two rows a thread: unrolled, the four copies took ~1,000 instructions)
        for (int u = ct; u < kt << csh; u += nct) {
            const int j = u >> csh, c = (u & ((1 << csh) - 1)) * 8, p = t0 + j;
            bf16* dst = rows + j * ld + c;
            if (p == pos) {
                if (t0 > k0) *(uint4*)dst = *(const uint4*)((v ? vnew : knew) + c);
                continue;
            }
            const int at = t0 == k0 ? meta.first[j] : (bt[p >> bsh] << bsh) + (p & ((1 << bsh) - 1));
            cp_async16(dst, cache + (size_t)at * kv_stride + c);
        }
        cp_async_commit();
    };
    load_rows(0, k0, min(RING_KT, k1 - k0));
    load_rows(1, k0, min(RING_KT, k1 - k0));
    wait();
    // q of the block's heads, rotated (the paired order: a pair sits 8 rows apart), rounded as
    // the skinny RoPE epilogue (the product to bf16, then rope_pair); the new key (into its
    // tile row and the cache) and value, in one loop of pairs (g == G the key's, G + 1 the
    // value's dims i and i + hd / 2): every LL load of a thread in one round trip. (An empty
    // split needs no q.)
    const float fpos = (float)pos;
    const int hh = hd >> 1;
    const long long slot = meta.slot;
    const int jn = pos - k0;  // the new token's row in the first tile (when < KT)
    const unsigned long long* xq = (const unsigned long long*)st.x;
    const int parts = st.K >> 10;  // (the q|k|v stage's pieces a row)
    for (int u = ct; u < (G + 2) * hh && k0 < k1; u += nct) {
        const int g = u >> (hsh - 1), i = u & (hh - 1);
        if (g >= G && !has_new) break;  // (u grows: the key's and value's pairs are last)
        if (g == G + 1) {
            const int vsrc = (st.nh + st.nkv + kh) * hd;
            float a, b;
            ring_ll_rows<LLR>(xq, vsrc + i, vsrc + i + hh, parts, tag - 1, a, b);
            const bf16 va = f2bf(a), vb = f2bf(b);
            vnew[i] = va;
            vnew[i + hh] = vb;
            if (jn < RING_KT) vs[jn * hd + i] = va, vs[jn * hd + i + hh] = vb;
            st.v_cache[slot * kv_stride + (size_t)kh * hd + i] = va;
            st.v_cache[slot * kv_stride + (size_t)kh * hd + i + hh] = vb;
            continue;
        }
        const int r = rope_row(i, 1);
        const bool key = g == G;
        const int src = (key ? st.nh + kh : kh * G + g) * hd;
        float a, b, o1, o2;
        ring_ll_rows<LLR>(xq, src + r, src + r + 8, parts, tag - 1, a, b);
        rope_pair(rbf(a), rbf(b), fpos, st.inv_freq[i], &o1, &o2);
        if (key) {
            const bf16 b1 = f2bf(o1), b2 = f2bf(o2);
            knew[r] = b1;
            knew[r + 8] = b2;
            if (jn < RING_KT) {
                ks[jn * ldk + r] = b1;
                ks[jn * ldk + r + 8] = b2;
            }
            st.k_cache[slot * kv_stride + (size_t)kh * hd + r] = b1;
            st.k_cache[slot * kv_stride + (size_t)kh * hd + r + 8] = b2;
        } else {
            qs[g * hd + r] = o1;
            qs[g * hd + r + 8] = o2;
        }
    }
    if (tr && ct == 0) tr[1] = ring_now();
#ifdef RING_ATTN_TRACE
    if (tr && ct == 0) tr[3] = ring_now();
#endif
    if (ct < G) {
        mls[ct] = NEG_INF;
        mls[G + ct] = 0.0f;
    }
#ifdef RING_ATTN_WTRACE
    // (measurement: in K row 0's padding, the slowest warp's scores and the last warp's end)
    unsigned long long* wt = (unsigned long long*)(ks + hd);
    if (ct == 0) wt[0] = 0, wt[1] = 0;
#endif
    float acc[2] = {0.0f, 0.0f};
    // Past the first tile (contexts over RING_KT keys a split), the copies overlap the
    // arithmetic: tile t + 1's K rows load while tile t's softmax and P V run, its V rows
    // while its own scores and softmax do (the groups land in order: K t, V t, K t + 1, ...).
    for (int t0 = k0; t0 < k1; t0 += RING_KT) {
        const int kt = min(RING_KT, k1 - t0);
        const bool more = t0 + RING_KT < k1;
        cp_async_wait_group<1>();  // (K of this tile; its V may still be in flight)
#if defined(RING_ATTN_WTRACE) && RING_ATTN_WTRACE == 3
        unsigned long long* arr = (unsigned long long*)sc;  // (free until the scores: a warp's slot)
        if (t0 == k0) {
            __syncwarp();
            if (lane == 0) arr[warp] = ring_now();
        }
#endif
        ring_cbar(nct, 3);
#ifdef RING_ATTN_TRACE
        if (tr && ct == 0 && t0 == k0) tr[4] = ring_now();
#endif
#if defined(RING_ATTN_WTRACE) && RING_ATTN_WTRACE == 3
        if (ct == 0 && t0 == k0) {
            unsigned long long last = 0;
            for (int w = 0; w < nct / 32; w++) last = max(last, arr[w]);
            wt[0] = last;
        }
        ring_cbar(nct, 4);  // (the slots read before the scores overwrite them)
#endif
        // Scores: thread (head g, key j), consecutive lanes consecutive keys: a warp's q
        // reads are one address (a broadcast), its K rows' 16-byte reads fall in different
        // banks (the padded stride). (Lanes a key, heads inner, made q's reads a 4-way bank
        // conflict and K's 2-way.)
#ifdef RING_ATTN_WTRACE
        const unsigned long long ws0 = ring_now();
#endif
        for (int u = ct; u < RING_KT * G; u += nct) {
            const int g = u / RING_KT, j = u - g * RING_KT;
            float v = NEG_INF;
            if (j < kt) {
                const uint4* kr = (const uint4*)(ks + j * ldk);
                const float4* qr = (const float4*)(qs + g * hd);
                float dot = 0.0f;
                for (int c = 0; c < hd / 8; c++) {
                    const uint4 kv = kr[c];
                    const float4 qa = qr[2 * c], qb = qr[2 * c + 1];
                    const float q[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
                    const u32 w[4] = {kv.x, kv.y, kv.z, kv.w};
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        dot += q[2 * e] * __uint_as_float(w[e] << 16);
                        dot += q[2 * e + 1] * __uint_as_float(w[e] & 0xffff0000u);
                    }
                }
                v = dot * st.scale;
            }
            sc[j * G + g] = v;
        }
#if defined(RING_ATTN_WTRACE) && RING_ATTN_WTRACE == 2
        if (lane == 0 && t0 == k0) {  // (the other warps' last end; warp 0's start)
            if (warp > 0) atomicMax(wt, ring_now());
            else wt[1] = ws0;
        }
#elif defined(RING_ATTN_WTRACE) && RING_ATTN_WTRACE == 3
        if (ct == 0 && t0 == k0) wt[1] = ws0;
#elif defined(RING_ATTN_WTRACE)
        if (lane == 0 && t0 == k0) {
            const unsigned long long e = ring_now();
            atomicMax(wt, e - ws0);
            atomicMax(wt + 1, e);
        }
#endif
        ring_cbar(nct, 5);  // (the scores' K reads done)
        if (more) load_rows(0, t0 + RING_KT, min(RING_KT, k1 - t0 - RING_KT));
#ifdef RING_ATTN_TRACE
        if (tr && ct == 0 && t0 == k0) tr[5] = ring_now();
#endif
        // Online softmax, a warp a head: the probabilities (rounded, as the V operand) replace
        // the scores; the sum keeps them unrounded.
        // (Keys lane and lane + 32 of the tile: 32 <= RING_KT <= 64.)
        for (int g = warp; g < G; g += nct / 32) {
            const float s0 = lane < kt ? sc[lane * G + g] : NEG_INF;
            const float s1 = lane + 32 < kt ? sc[(lane + 32) * G + g] : NEG_INF;
            const float mo = mls[g], mn = fmaxf(mo, warp_max(fmaxf(s0, s1)));
            const float pk = lane < kt ? __expf(s0 - mn) : 0.0f;
            const float p1 = lane + 32 < kt ? __expf(s1 - mn) : 0.0f;
            sc[lane * G + g] = rbf(pk);
            if (lane + 32 < RING_KT) sc[(lane + 32) * G + g] = rbf(p1);
            const float sum = warp_sum(pk + p1);
            if (lane == 0) {
                const float corr = __expf(mo - mn);
                mls[g] = mn;
                mls[G + g] = mls[G + g] * corr + sum;
                mls[2 * G + g] = corr;
            }
        }
        if (more) cp_async_wait_group<1>();  // (V of this tile; the next K may be in flight)
        else cp_async_wait_group<0>();
        ring_cbar(nct, 6);
        // P V: thread (head g, dim d), up to two.
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int u = ct + i * nct;
            if (u >= G * hd) break;
            const int g = u >> hsh, d = u & (hd - 1);
            float a = acc[i] * mls[2 * G + g];
            // (Four keys at a time: 0.2% faster than the compiler's full unroll of the loop,
            // ~7 KB of code more, and as fast as eight; one at a time 0.6% slower. Session 24.)
#ifndef RING_PV_UNROLL
#define RING_PV_UNROLL 4
#endif
            RING_PRAGMA(unroll RING_PV_UNROLL)
            for (int j = 0; j < kt; j++) a += sc[j * G + g] * bf2f(vs[j * hd + d]);
            acc[i] = a;
        }
#if defined(RING_ATTN_TRACE) && !defined(RING_ATTN_WTRACE)
        if (tr && ct == 0 && t0 == k0) tr[6] = ring_now();
#endif
        if (more) {
            ring_cbar(nct, 7);  // (the P V reads of V and the probabilities done)
            load_rows(1, t0 + RING_KT, min(RING_KT, k1 - t0 - RING_KT));
        }
    }
    // The partial of each head: its output sums and (max, sum), as LL words.
    const int idx = (kh * S + sp) * G;
    unsigned long long* part = (unsigned long long*)st.part;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int u = ct + i * nct;
        if (u < G * hd) ring_ll_put(part, (size_t)idx * hd + u, acc[i], tag);
    }
    unsigned long long* ml = part + (size_t)S * st.nh * hd;
    if (ct < G) {
        ring_ll_put(ml, 2 * (idx + ct), mls[ct], tag);
        ring_ll_put(ml, 2 * (idx + ct) + 1, mls[G + ct], tag);
    }
#ifdef RING_ATTN_WTRACE
    if (tr && ct == 0) tr[6] = wt[0], tr[7] = wt[1];  // (after the scores' barrier: every warp's)
#elif defined(RING_ATTN_TRACE)
    if (tr && ct == 0) tr[7] = ring_now();
#endif
}
// Merges a split's (max m, sum l, output o) into a running (M, L, O) (flash-decoding's
// combine); an empty split (m = -inf) changes nothing.
__device__ __forceinline__ void ring_merge(float& M, float& L, float& O, float m, float l, float o) {
    if (m == NEG_INF) return;
    const float mn = fmaxf(M, m), a = __expf(M - mn), b = __expf(m - mn);
    L = L * a + l * b;
    O = O * a + o * b;
    M = mn;
}
// The block's `rows` input rows r0.. of a GEMVT stage into xr (f32): x[r], or with
// RING_X_PARTS the attention output at r = head * hd + d merged from the ATTN stage's S split
// partials, rounded to bf16. A merged row takes P lanes (S rounded up to a power of two, at
// most 32), lane l loading splits l, l + P, ..: every split's loads in one round trip, then
// log2 P shuffle steps (loading eight splits a thread at a time took two dependent round trips
// at S = 16). Warp-uniform loop: every lane of a warp reaches the shuffles. G (q heads a KV
// head) and S come from the caller, worked out before the stage's wait; after it, shifts and a
// multiply-high (hd a power of two; h / G exact for h < 2^28), no divisions.
__device__ void ring_gemvt_rows(const RingStage& st, float* xr, int r0, int rows, int ct, int nct, int G, int S,
                                u32 tag) {
    if (st.x_form != RING_X_PARTS) {
        for (int r = ct; r < rows; r += nct) xr[r] = ring_sum(st.x, r0 + r, st.x_len);
        return;
    }
    const int hd = st.hd, nh = st.nh, hsh = __ffs(hd) - 1;
    const unsigned int gm = ring_div_magic((unsigned int)G);
    int P = 1, pl = 0;
    while (P < S && P < 32) P <<= 1, pl++;
    const int lane = ct & 31, l = lane & (P - 1);
    // (The partials are LL words: polled until they carry the ATTN stage's tag.)
    const unsigned long long* px = (const unsigned long long*)st.x;
    const unsigned long long* ml = px + (size_t)S * nh * hd;
    for (int u0 = ct - lane; u0 < rows * P; u0 += nct) {
        const int i = (u0 + lane) >> pl;
        float M = NEG_INF, L = 0.0f, O = 0.0f;
        if (i < rows) {
            const int r = r0 + i, h = r >> hsh, d = r & (hd - 1);
            const int kvh = (int)ring_div((unsigned int)h, (unsigned int)G, gm), base = kvh * S * G + h - kvh * G;
            for (int sp = l; sp < S; sp += P) {
                const int idx = base + sp * G;
                const unsigned long long *pm = ml + 2 * idx, *po = px + (size_t)idx * hd + d;
                const unsigned long long wm = ring_ll_ld(pm), wl = ring_ll_ld(pm + 1), wo = ring_ll_ld(po);
#if defined(RING_NO_MERGE_WAIT) || defined(RING_SKIP_ATTN)  // measurement: the partials as first read, tag or not
                ring_merge(M, L, O, __uint_as_float((u32)wm), __uint_as_float((u32)wl), __uint_as_float((u32)wo));
#else
                ring_merge(M, L, O, ring_ll_val(wm, pm, tag), ring_ll_val(wl, pm + 1, tag), ring_ll_val(wo, po, tag));
#endif
            }
        }
        for (int o = P >> 1; o > 0; o >>= 1) {
            const float m = __shfl_xor_sync(0xffffffffu, M, o), s = __shfl_xor_sync(0xffffffffu, L, o),
                        v = __shfl_xor_sync(0xffffffffu, O, o);
            ring_merge(M, L, O, m, s, v);
        }
        if (i < rows && l == 0) xr[i] = L > 0.0f ? rbf(O / L) : 0.0f;
    }
}
// The ring producer's wait for the copy `depth` before slot ki of round kr to land (its full
// barrier's phase of that round; the slot's next phase needs this copy's successors, so the
// parity cannot alias). Out of line: one copy of the code for the producer's put sites. (The
// FP8 instance, at ptxas's register cap, spills 4 bytes with the parameter either way.)
__device__ __noinline__ void ring_flight_wait(u32 full, unsigned int ki, unsigned int kr, int depth, int nslots) {
    if (depth >= nslots || (kr == 0 && ki < (unsigned int)depth)) return;
    const bool back = ki < (unsigned int)depth;
    mbar_wait(full + 8u * (back ? ki + nslots - depth : ki - depth), (back ? kr - 1 : kr) & 1);
}
// `trace` (null for none): per stage and block (RING_TRACE_WORDS u64 apart), the global time
// consumer thread 0 starts waiting for the stage's input, has it staged (ATTN: its q|k|v words
// read), and has finished the stage; with RING_ATTN_TRACE attention stages stamp five more
// (ring_attention). RING_NO_DEP (no grid-wide waits for inputs), RING_NO_MATH (slots released
// unread; GEMV stages' LL words written as zeros), RING_NO_RED (MLP sums never added),
// RING_MLP_NO_DOWN (down slots released unread), RING_MLP_NO_BAR (no barrier between a chunk's
// gate|up and down), RING_COUNT_RELAXED (a stage's count without its release),
// RING_NO_MERGE_WAIT (o's merge taking the attention partials as first read, whatever their
// tags) and RING_SKIP_ATTN (no attention stage at all, o's merge as RING_NO_MERGE_WAIT's: the
// bound for attention inside o's blocks, docs/cuda.md) are measurement variants with wrong
// outputs; RING_MLP_CLAIM (bf16 MLP chunks claimed, the faster SMs taking more: sums that
// depend on who took which chunk, so steps differ in their last bits) one with non-determinism.
// `depth`: the most weight copies the producer keeps in flight (0, or nslots or more: every
// free slot); `depth_mlp` the same for an MLP stage's copies, `depth_attn` for a q|k|v (LL
// GEMV) or o (GEMVT) stage's (the host's ring_depths; not read by the F8 instances).
// F8: the gemv_ring_f8 instance (FP8 layers: every q|k|v, o, gate|up and down with scales;
// the head either); gemv_ring has none of its code (one body for both cost a bf16 step 3.5%,
// session 20).
template <bool F8, int SLOT>
__device__ __forceinline__ void gemv_ring_body(const RingStage* stages, int n, unsigned int* done, int nslots,
                                               unsigned long long* trace, RingStep step, int depth, int depth_mlp, int depth_attn) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    constexpr int SLOT_UNITS = SLOT / 16, CW = SLOT / 2048;  // CW consumer warps
    static_assert(SLOT_UNITS == CW * 128, "a warp reduces 1024 weights of a slot");
    if (blockDim.x != (CW + 1) * 32) __trap();
    extern __shared__ __align__(128) unsigned char smem[];
    uint4* ring = (uint4*)smem;
    unsigned long long* full = (unsigned long long*)(smem + (size_t)nslots * SLOT);
    unsigned long long* empty = full + nslots;
    // F8: RING_SLOT_SCALES f32 a slot, the row scales of an FP8 GEMV or gate|up slot, which the
    // producer copies with its weights (a consumer's own load cost a round trip a row: the FP8
    // head ran at half the stream, session 20).
    float* sscale = (float*)(empty + nslots);
    // The stage's input, bf16 (or an ATTN stage's state, or an o stage's f32 input rows), and
    // from 2 H bytes on (H the hidden size: o's N, the MLP's K) the pair's receiving region
    // (add_out). F8: the pair's receiving region first; FP8 GEMV and MLP stages' input as f16
    // (ring_f8_xpos order) from 2 K bytes on, or an o stage's rows from 2 H on, and a paired
    // block's own sums there at the end; F8 o and MLP stages' f32 column scales from 4 H on.
    uint4* xs = (uint4*)(sscale + (F8 ? nslots * RING_SLOT_SCALES : 0));
    __shared__ float part[2][2][F8 ? 2 * CW : CW];  // MLP: [chunk parity][gate, up][unit]
    __shared__ float red_ss[CW];       // the input norm's sum of squares, by warp
    __shared__ int slot_item[RING_MAX_SLOTS];  // the item a full slot holds (-1: a stage's end)
    __shared__ __align__(8) unsigned long long pair_ready;  // the partner's sums pushed (clusters of two)
    // The partner done with its attention stage's state (in its input region, where this
    // block's o sums go: see partner_free).
    __shared__ __align__(8) unsigned long long pair_free;
    u32 crank, csize;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(crank));
    asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(csize));
    if (csize > 2) __trap();
    if (nslots > RING_MAX_SLOTS) __trap();
    unsigned int* claims = done + n;  // a claimed stage's next item
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x == 0) {
        for (int i = 0; i < nslots; i++) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(full + i)) : "memory");
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(empty + i)), "r"(CW) : "memory");
        }
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&pair_ready)) : "memory");
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&pair_free)) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
#ifdef RING_BAR_CHECK
    if (threadIdx.x < 32) ring_barc[threadIdx.x] = 0;
    if (threadIdx.x < 4) ring_bad[threadIdx.x] = 0;
#endif
    __syncthreads();
    if (csize > 1) {  // (the partner's barrier initialised before anyone arrives on it)
        asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
        asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
    }
    if (warp == CW) {
        // The producer: every slot of every stage, in the consumers' order; it waits only for
        // a free slot (the consumers' release of the round before) and, with `depth` copies
        // in flight (`depth_mlp` for an MLP stage's, `depth_attn` for a q|k|v or o stage's),
        // for the oldest to land. The weights never change, so it starts before the launches
        // this one depends on have finished (no PDL wait).
        // (`depth`: the copies in flight are a queue in front of the block's other global
        // accesses. With every free slot in flight, the 3B's 8 x 24 KB, its attention stages
        // read their q|k|v words ~1 us later and some blocks stalled 2-8 us; 64-72 KB stream
        // as fast: session 46, docs/cuda.md. An MLP stage's copies, beside its long stream,
        // may take more: the 3B's every slot, session 47. The q|k|v and o stages' copies, put
        // while the consumers run the chain around attention, one at a time: session 48.)
        if (lane != 0) return;
        unsigned long long pol;
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
        // The next slot (index ki of round kr: counted, not divided: session 24), once the
        // consumers have released it from the round before.
        unsigned int ki = 0, kr = 0;
        auto slot = [&]() -> unsigned int {
            if (kr > 0) mbar_wait(smem_addr(empty + ki), (kr - 1) & 1);
            return ki;
        };
        auto next = [&]() {
            if (++ki == (unsigned int)nslots) ki = 0, kr++;
        };
        // The copies in flight for a stage's item: `depth_mlp` for an MLP stage's, `depth_attn`
        // for a q|k|v stage's (the LL GEMVs) or an o stage's (GEMVT), `depth` for the rest (the
        // head). (Measurement: -DRING_DEPTH_HEAD=N gives the head's its own.)
        auto copy_depth = [&](const RingStage& st) -> int {
#ifdef RING_DEPTH_HEAD
            if (st.kind == RING_GEMV && st.ll != RING_OUT_LL) return RING_DEPTH_HEAD;
#endif
            if (st.kind == RING_MLP) return depth_mlp;
            // (FP8: q|k|v's and o's at `depth`, the host's rule for them; the select below in
            // the FP8 instances cost the FP8 1B 0.5%, session 48.)
            if (F8) return depth;
            return st.kind == RING_GEMVT || (st.kind == RING_GEMV && st.ll == RING_OUT_LL) ? depth_attn : depth;
        };
        // A piece of weights into the next slot, tagged with its item (the mbarrier's arrive
        // releases the tag with the slot), and (F8) `slen` bytes of row scales from `ssrc`
        // beside it (both 16-byte multiples); at most `d` copies in flight (copy_depth): the one
        // `d` before this has landed.
        auto put = [&](int d, const void* src, unsigned int len, int item, const float* ssrc = nullptr,
                       unsigned int slen = 0) {
            const unsigned int idx = slot();
            if (d > 0) ring_flight_wait(smem_addr(full), ki, kr, d, nslots);
            slot_item[idx] = item;
            const u32 fb = smem_addr(full + idx);
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(fb), "r"(len + slen) : "memory");
            if (F8 && slen > 0) {
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                                 smem_addr(sscale + idx * RING_SLOT_SCALES)),
                             "l"(ssrc), "r"(slen), "r"(fb)
                             : "memory");
            }
#ifndef RING_COPY_PARTS  // measurement: a slot in this many bulk copies
#define RING_COPY_PARTS 1
#endif
            for (unsigned int p = 0; p < RING_COPY_PARTS; p++) {
                const unsigned int a = len * p / RING_COPY_PARTS / 16 * 16, b = len * (p + 1) / RING_COPY_PARTS / 16 * 16;
#ifndef RING_NO_HINT
                asm volatile(
                    "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
                        smem_addr(ring + (size_t)idx * SLOT_UNITS) + a),
                    "l"((const unsigned char*)src + a), "r"(b - a), "r"(fb), "l"(pol)
                    : "memory");
#else
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                                 smem_addr(ring + (size_t)idx * SLOT_UNITS) + a),
                             "l"((const unsigned char*)src + a), "r"(b - a), "r"(fb)
                             : "memory");
#endif
            }
            next();
        };
        // A claimed stage's end: a slot with no data, tagged -1.
        auto put_end = [&]() {
            const unsigned int idx = slot();
            slot_item[idx] = -1;
            asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(full + idx)) : "memory");
            next();
        };
        // Item i of a stage: its piece(s), tagged i.
        // (F8: a GEMV slot's and a gate or up slot's row scales beside it.)
        auto put_item = [&](const RingStage& st, unsigned int i) {
            const unsigned int wb = F8 && st.ws ? 1 : 2;
            const int d = copy_depth(st);
            if (st.kind == RING_GEMVT) {
                const unsigned int len = ring_chunk_rows<SLOT>(st.N, wb) * st.N * wb;
                put(d, (const unsigned char*)st.w + (size_t)i * len, len, i);
            } else if (st.kind == RING_MLP) {
                const unsigned int cr = ring_chunk_rows<SLOT>(st.K, wb), len = cr * st.K * wb;
                const size_t r = (size_t)i * len;
                const float* gsc = F8 && wb == 1 ? st.ws + (size_t)i * cr : nullptr;  // (cr >= 4)
                const unsigned int sl = F8 && wb == 1 ? 4 * cr : 0;
                put(d, (const unsigned char*)st.w + r, len, i, gsc, sl);
                put(d, (const unsigned char*)st.w + (size_t)st.N * st.K * wb + r, len, i, gsc + (sl ? st.N : 0), sl);
                put(d, (const unsigned char*)st.w2 + r, len, i);
            } else {
                const unsigned int bytes = (unsigned int)st.N * (unsigned int)st.K * wb, at = i * SLOT;
                const unsigned int len = min((unsigned int)SLOT, bytes - at);
                if (F8 && wb == 1) {
                    // The slot's rows' scales from the 16-byte boundary at or before its first
                    // (the host rounds the scales' allocation to 16 bytes: the copy stays in it).
                    const unsigned int r0 = at / st.K & ~3u, r1 = (at + len - 1) / st.K + 1;
                    put(d, (const unsigned char*)st.w + at, len, i, st.ws + r0, (r1 - r0 + 3) / 4 * 16);
                } else {
                    put(d, (const unsigned char*)st.w + at, len, i);
                }
            }
        };
        int off = 0;
        RingStage nxt = stages[0];
        for (int s = 0; s < n; s++) {
            const RingStage st = nxt;
            if (s + 1 < n) nxt = stages[s + 1];  // (in flight while this stage's copies issue)
            const int wb = F8 && st.ws ? 1 : 2;
            const unsigned int items = (unsigned int)ring_items<SLOT>(st, wb), u = ring_unit<SLOT>(st.kind, st.N, st.K, wb);
            if (u > 0) {
                // Units claimed one ahead: the claim's round trip runs while the unit before
                // streams (or waits for its slots).
                const unsigned int units = (items + u - 1) / u;
                unsigned int c = atomicAdd(claims + s, 1u);
                while (c < units) {
                    const unsigned int next = atomicAdd(claims + s, 1u);
                    for (unsigned int i = c * u; i < min(items, c * u + u); i++) put_item(st, i);
                    c = next;
                }
                put_end();
                continue;
            }
            int start, count;
            ring_share(items, off, start, count);
            for (int i = start; i < start + count; i++) put_item(st, i);
        }
        return;
    }
    PDL_ENTER();
    const int ct = threadIdx.x, nct = CW * 32;
    // This launch's LL tags: (epoch + 1) n + stage (the header; the launch before, which set
    // the epoch, has finished), read from shared memory where used: held in a register for
    // the whole launch it made the 16-warp instances (at most 96 registers) spill, and FP8 1B
    // steps 5% slower (session 31).
    __shared__ u32 tag_base;
    __shared__ RingAttnMeta attn_meta;  // (ring_attention's, read by its first stage)
    if (ct == 0) {  // (both read after the barrier below)
        tag_base = (__ldcg(done + 2 * n) + 1u) * (u32)n;
        attn_meta.ready = 0;
    }
    const auto tag_of = [&](int stage) -> u32 { return *(volatile u32*)&tag_base + (u32)stage; };
    u32 pair_phase = 0, free_phase = 0;  // pair_ready's and pair_free's phases (add_out)
    // The next slot (index ki, its full barrier's phase kp: counted, not divided, in the
    // hot loops: session 24), or the one after it (ahead = 1), waited for; `release` hands the
    // next one back.
    unsigned int ki = 0, kp = 0;
#ifdef RING_MLP_TRACE
    unsigned long long blocked = 0;  // ns thread 0 waited in take() this stage
#endif
    auto take = [&](unsigned int ahead = 0) -> const uint4* {
        unsigned int idx = ki + ahead, ph = kp;
        if (idx >= (unsigned int)nslots) idx -= nslots, ph ^= 1u;
#ifdef RING_MLP_TRACE
        const unsigned long long t0 = ct == 0 ? ring_now() : 0ull;
#endif
        mbar_wait(smem_addr(full + idx), ph);
#ifdef RING_MLP_TRACE
        if (ct == 0) blocked += ring_now() - t0;
#endif
        return ring + (size_t)idx * SLOT_UNITS;
    };
    auto release = [&]() {
        __syncwarp();
        if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(empty + ki)) : "memory");
        if (++ki == (unsigned int)nslots) ki = 0, kp ^= 1u;
    };
    // Warp w's 1024 weights of a slot against the staged input from column `col` (units of
    // 8): the warp's sum, in every lane.
    auto warp_dot = [&](const uint4* src, int col) -> float {
        float p[4];
#pragma unroll
        for (int it = 0; it < 4; it++) p[it] = dot8(src[warp * 128 + it * 32 + lane], xs[col + it * 32 + lane]);
        float v = (p[0] + p[1]) + (p[2] + p[3]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        return v;
    };
    // The stage descriptors, each copied into shared memory (cp.async, 8 bytes a thread) while
    // the stage before runs: no global load at a stage's start.
    __shared__ __align__(16) RingStage sdesc[2];
    constexpr int DESC_WORDS = sizeof(RingStage) / 8;
    static_assert(sizeof(RingStage) % 8 == 0 && DESC_WORDS <= 32, "descriptor copy");
    auto fetch_desc = [&](int s) {
        if (ct < DESC_WORDS) {
            asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(smem_addr((unsigned long long*)&sdesc[s & 1] + ct)),
                         "l"((const unsigned long long*)(stages + s) + ct)
                         : "memory");
        }
    };
    fetch_desc(0);
    cp_async_wait_all();
    ring_cbar(nct, 8);
    int off = 0;
    for (int s = 0; s < n; s++) {
        const RingStage st = sdesc[s & 1];
        unsigned long long* tr = trace ? trace + ((size_t)s * gridDim.x + blockIdx.x) * RING_TRACE_WORDS : nullptr;
        if (tr && ct == 0) tr[0] = ring_now();
        // A run of fixed items, or claimed units (claim > 0; then the slots' tags say which and
        // where the block's share ends); none for ATTN and CVT stages. Worked out before the
        // wait: its divisions off the path from the wait to the stage's first slot (session 20,
        // docs/benchmarks.md).
        int start = 0, count = 0;
        const bool f8 = F8 && st.ws;  // (F8: every o and MLP stage; GEMV stages where they are)
        const int wb = f8 ? 1 : 2;
        const int claim = ring_unit<SLOT>(st.kind, st.N, st.K, wb);
        if (claim == 0 && st.kind != RING_ATTN && st.kind != RING_CVT) ring_share(ring_items<SLOT>(st, wb), off, start, count);
        // This block's share of the zeroing, and of a CVT stage's sums: 64-bit divisions, also
        // worked out before the wait (1B 0.976 -> 0.971 ms, 3B 2.265 -> 2.242; session 21).
        const int za = ring_block_part(st.zero_len, blockIdx.x), zb = ring_block_part(st.zero_len, blockIdx.x + 1);
        const int ca = st.kind == RING_CVT ? ring_block_part(st.N, blockIdx.x) : 0;
        // An o stage's heads: G q heads a KV head, S attention splits (divisions, before the
        // wait; in this order in the measured build).
        const int aG = st.x_form == RING_X_PARTS ? st.nh / st.nkv : 1;
        const int aS = st.x_form == RING_X_PARTS ? max(1, (int)gridDim.x / st.nkv) : 1;
        const int cb = st.kind == RING_CVT ? ring_block_part(st.N, blockIdx.x + 1) : 0;
        // Waits until every block has counted the stage before done, then zeroes this stage's
        // share of `zero` and fetches the next descriptor (every thread has read
        // sdesc[(s + 1) & 1] as stage s - 1's before the barrier, or before finish's of stage
        // s - 1; stage 0 has no wait, and nothing reads sdesc[1] before stage 1). ATTN stages
        // and o's merge read LL words: no grid-wide wait (and nothing to zero).
        const bool ll_in = st.kind == RING_ATTN || st.x_form == RING_X_PARTS;
        auto wait = [&]() {
#ifndef RING_NO_DEP
            if (s > 0 && !ll_in) {
                if (ct == 0) {
                    unsigned int v;
                    // (Relaxed polls, then one acquire fence: the acquire pattern without an L1
                    // invalidation a poll.)
                    do {
                        asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(done + s - 1) : "memory");
                    } while (v < gridDim.x);
                    asm volatile("fence.acquire.gpu;" ::: "memory");
                }
                ring_cbar(nct, 9);
            }
#endif
#pragma unroll 1  // (a word or none a thread)
            for (int i = za + ct; i < zb; i += nct) st.zero[i] = 0ull;
            if (s + 1 < n) fetch_desc(s + 1);
        };
        // The input norm's weights (constant) are read before the wait: one dependent round
        // trip fewer after it (K <= 16 nct: at most two 8-weight units a thread).
        uint4 gw[2] = {};
        if (st.norm_w) {
#pragma unroll
            for (int i = 0; i < 2; i++)
                if (ct + i * nct < st.K / 8) gw[i] = *((const uint4*)st.norm_w + ct + i * nct);
        }
        // F8 o and MLP stages: their column scales (o^T's, down^T's: one an output) copied into
        // shared memory before the wait too (read at the stage's end, after a wait_all).
        const int f8cols = st.kind == RING_GEMVT ? st.N : st.K;
        float* f8cs = (float*)xs + f8cols;
        if (F8 && (st.kind == RING_GEMVT || st.kind == RING_MLP)) {
            if (!f8) __trap();  // (the host's rule: FP8 layers throughout)
            const float* src = st.kind == RING_GEMVT ? st.ws : st.ws2;
            for (int i = ct; i < f8cols / 4; i += nct) cp_async16(f8cs + 4 * i, src + 4 * i);
        }
        // The end of a stage: the barrier orders every consumer's stores and atomics before
        // thread 0's count (the pattern of a cooperative grid sync: one fence a block, not a
        // fence a thread; 1B 602 -> 582 us on the H200, session 17), and the next descriptor's
        // copy before its reads. Returns whether this was the last stage (not counted here).
        // Stages whose outputs are LL words (ATTN, q|k|v) count nothing: nobody waits for them.
        auto finish = [&]() -> bool {
            cp_async_wait_all();
            ring_cbar(nct, 10);
            if (tr && ct == 0) tr[2] = ring_now();
#ifdef RING_BAR_CHECK
            if (tr && ct == 0) tr[3] = ring_bad[0], tr[4] = ring_bad[1], tr[5] = ring_bad[2], tr[6] = ring_bad[3];
            if (ct == 0) ring_bad[0] = 0;
#endif
            if (st.kind == RING_ATTN && csize == 2 && ct == 0) {  // (see partner_free)
                asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(
                                 cluster_map(smem_addr(&pair_free), crank ^ 1u))
                             : "memory");
            }
            if (s + 1 == n) return true;
            if (st.kind == RING_ATTN || (st.kind == RING_GEMV && st.ll == RING_OUT_LL)) return false;
#ifdef RING_COUNT_RELAXED
            if (ct == 0) asm volatile("red.relaxed.gpu.global.add.u32 [%0], 1;" ::"l"(done + s) : "memory");
#else
            if (ct == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(done + s) : "memory");
#endif
            return false;
        };
        if (st.kind == RING_ATTN) {  // (it waits inside, once its keys are on their way)
#ifdef RING_SKIP_ATTN
            wait();  // (no grid-wide wait for an ATTN stage: the next descriptor only)
#else
            ring_attention<CW == 16 ? 2 : 4>(st, step, (unsigned char*)xs, ct, nct, wait, tr, tag_of(s), attn_meta);
#endif
            finish();  // (never the last stage)
            continue;
        }
        wait();
        float ss = 0.0f;
        // A thread's (at most two) 8-input units, kept in registers through the norm: an FP8
        // stage writes only their f16 copy (the bf16 one's place is the pair's receiving
        // region, see add_out).
        uint4 xv[2] = {};
        const bool f16_only = f8 && st.kind != RING_GEMVT;
        // A GEMVT stage stages only its own input rows, as f32 (below).
#pragma unroll
        for (int q = 0; q < 2; q++) {
            const int j = ct + q * nct;
            if (j >= st.K / 8 || st.kind == RING_GEMVT) break;
            float v[8];
            if (st.x_form == RING_X_BF16) {
                const uint4 xb = __ldcg((const uint4*)st.x + j);
                const u32 xw[4] = {xb.x, xb.y, xb.z, xb.w};
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    v[2 * i] = __uint_as_float(xw[i] << 16);
                    v[2 * i + 1] = __uint_as_float(xw[i] & 0xffff0000u);
                }
            } else {
                const float4* hi = (const float4*)st.x + 2 * j;
                const float4* lo = (const float4*)(st.x + st.x_len) + 2 * j;
                const float4 a = __ldcg(hi), b = __ldcg(hi + 1), c = __ldcg(lo), d = __ldcg(lo + 1);
                v[0] = a.x + c.x, v[1] = a.y + c.y, v[2] = a.z + c.z, v[3] = a.w + c.w;
                v[4] = b.x + d.x, v[5] = b.y + d.y, v[6] = b.z + d.z, v[7] = b.w + d.w;
            }
            if (st.res) {
                const float4 ra = __ldcg((const float4*)st.res + 2 * j), rb = __ldcg((const float4*)st.res + 2 * j + 1);
                const float r[8] = {ra.x, ra.y, ra.z, ra.w, rb.x, rb.y, rb.z, rb.w};
#pragma unroll
                for (int i = 0; i < 8; i++) v[i] = rbf(r[i] + rbf(v[i]));
            }
#pragma unroll
            for (int i = 0; i < 8; i++) {
                v[i] = rbf(v[i]);
                ss += v[i] * v[i];
            }
            if (st.res_out && blockIdx.x == 0) {
                ((float4*)st.res_out)[2 * j] = make_float4(v[0], v[1], v[2], v[3]);
                ((float4*)st.res_out)[2 * j + 1] = make_float4(v[4], v[5], v[6], v[7]);
            }
            xv[q] = make_uint4(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]), pack_bf16(v[4], v[5]), pack_bf16(v[6], v[7]));
        }
        if (st.norm_w) {
            // Every block the whole vector's sum of squares (a few KB from L2), then each thread
            // rescales its own units.
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
            if (lane == 0) red_ss[warp] = ss;
            ring_cbar(nct, 11);
            ss = 0.0f;
            for (int w = 0; w < CW; w++) ss += red_ss[w];
            const float inv = rsqrtf(ss / st.K + st.eps);
#pragma unroll
            for (int q = 0; q < 2; q++) xv[q] = rms_norm8(xv[q], gw[q], inv, 0.0f);
        }
#pragma unroll
        for (int q = 0; q < 2; q++) {
            const int j = ct + q * nct;
            if (j >= st.K / 8 || st.kind == RING_GEMVT) break;
            // FP8: the input as f16 for the tensor cores only.
            if (f16_only) xs[st.K / 8 + ring_f8_xpos(j)] = bf16x8_f16(xv[q]);
            else xs[j] = xv[q];
        }
        // GEMVT: the block's input rows, f32 (F8: past the pair's receiving region).
        float* xr = (float*)(F8 ? xs + st.N / 8 : xs);
        if (st.kind == RING_GEMVT) {
            const int cr = ring_chunk_rows<SLOT>(st.N, wb), r0 = start * cr;
            ring_gemvt_rows(st, xr, r0, count * cr, ct, nct, aG, aS, tag_of(s - 1));
        }
        ring_cbar(nct, 12);
        if (tr && ct == 0) tr[1] = ring_now();
#ifdef RING_MLP_TRACE
        blocked = 0;
#endif
        // Thread ct's down (or GEMVT) sums: columns 8 ct .., then 8 (ct + nct) .. (wider rows).
        auto add_rows = [&](float* acc, const uint4* d, int r, float h, int cols) {
#pragma unroll
            for (int q = 0; q < RING_MLP_COLS / 8; q++) {
                if (8 * (q * nct + ct) >= cols) break;
                const uint4 wv = d[r * (cols / 8) + q * nct + ct];
                const u32 wr[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    acc[q * 8 + 2 * i] += h * __uint_as_float(wr[i] << 16);
                    acc[q * 8 + 2 * i + 1] += h * __uint_as_float(wr[i] & 0xffff0000u);
                }
            }
        };
        // A split-K stage's column sums into y. In a cluster of two (the host's choice where
        // the pairs fit), the pair adds once: the columns' 8-wide groups j alternate between
        // the pair's blocks (j % 2 == rank), each block pushes its sums of the partner's groups
        // into the partner's receiving region with st.async, which counts their bytes on the
        // partner's pair_ready (no fence: the barrier's phase completes when the bytes have
        // landed), and adds its own sums plus the partner's of its groups (the same bits in
        // either block), halving the atomics. The region: 2 `cols` bytes (f32, the groups a
        // block adds, j / 2), xs's second quarter (bf16) or first (F8, whose stages keep no
        // bf16 input there), free while the stage runs. (Session 26's pull, each block staging
        // its sums for the partner to read after a remote arrive with release, waited 2.6-2.8
        // us a layer in the MLP's tail for the release's MEMBAR.GPU; session 27.)
        // F8: the sums of the partner's groups were pushed, and this block's own are in `acc`,
        // before add_out (see below).
        auto pair_recv = [&](int cols) { return (float4*)(F8 ? xs : xs + cols / 8); };
        auto push = [&](u32 peer_recv, u32 peer_ready, int j, int half, float a, float b, float c, float d) {
            asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(
                             peer_recv + 32u * (u32)(j >> 1) + 16u * (u32)half),
                         "r"(__float_as_uint(a)), "r"(__float_as_uint(b)), "r"(__float_as_uint(c)), "r"(__float_as_uint(d)),
                         "r"(peer_ready)
                         : "memory");
        };
        // o stages (paired), before the first push: the partner done with its attention stage,
        // whose state shares the receiving region (its finish() arrives on this block's
        // pair_free; every GEMVT stage follows an ATTN stage, as the host lays the stages out).
        // No grid-wide wait stands between a layer's attention and o stages, so a block can
        // reach o's pushes while its partner still attends: session 32's counted sums, which
        // let the blocks drift further apart, made 1B steps differ run to run that way. The
        // MLP's pushes need no such wait: a block reaches them only after the grid-wide wait
        // for every block's o stage.
        auto partner_free = [&]() {
            if (st.kind != RING_GEMVT) return;
            mbar_wait_cluster(smem_addr(&pair_free), free_phase);
            free_phase ^= 1u;
        };
        auto add_out = [&](float* acc, int cols) {
            // (The MLP's pairs too: its blocks each adding all their sums lost, FP8 1B 0.657-0.662
            // against 0.642-0.644 ms, bf16 0.879 against 0.875; session 26.)
            const bool paired = csize == 2;
            float4* const recv = pair_recv(cols);
            if (paired) {
                if (!F8) {
                    partner_free();
                    const u32 peer_recv = cluster_map(smem_addr(recv), crank ^ 1u);
                    const u32 peer_ready = cluster_map(smem_addr(&pair_ready), crank ^ 1u);
#pragma unroll
                    for (int q = 0; q < RING_MLP_COLS / 8; q++) {
                        const int j = q * nct + ct;
                        if (8 * j >= cols) break;
                        if ((u32)(j & 1) == crank) continue;
                        push(peer_recv, peer_ready, j, 0, acc[q * 8], acc[q * 8 + 1], acc[q * 8 + 2], acc[q * 8 + 3]);
                        push(peer_recv, peer_ready, j, 1, acc[q * 8 + 4], acc[q * 8 + 5], acc[q * 8 + 6], acc[q * 8 + 7]);
                    }
                }
                if (ct == 0) {
                    // This phase's arrival and the bytes the partner pushes (its groups j % 2 ==
                    // crank; they may land before this: the phase waits for the arrival too).
                    const u32 bytes = 32u * (u32)((cols / 8 + 1 - (int)crank) / 2);
                    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(&pair_ready)), "r"(bytes)
                                 : "memory");
                }
                mbar_wait_cluster(smem_addr(&pair_ready), pair_phase);
                pair_phase ^= 1u;
                RING_MLP_STAMP2(5);
            }
            for (int q = 0; q < RING_MLP_COLS / 8; q++) {
                const int j = q * nct + ct;
                if (8 * j >= cols) break;
                if (paired) {
                    if ((u32)(j & 1) != crank) continue;
                    const float4 a = recv[2 * (j >> 1)], b = recv[2 * (j >> 1) + 1];
                    const float p[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
                    for (int i = 0; i < 8; i++) acc[q * 8 + i] += p[i];
                }
                float hi[8], lo[8];
#pragma unroll
                for (int i = 0; i < 8; i++) ring_split(acc[q * 8 + i], hi[i], lo[i]);
                float* y = st.y + 8 * (q * nct + ct);
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const float* v = h ? lo : hi;
                    float* yh = y + h * cols;
                    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(yh), "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3])
                                 : "memory");
                    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(yh + 4), "f"(v[4]), "f"(v[5]), "f"(v[6]),
                                 "f"(v[7])
                                 : "memory");
                }
            }
        };
        // An MLP chunk's activations: lane r < cr forms activation r from the chunk's gate and
        // up part sums (rounded as the skinny SiLU epilogue); the lanes take theirs by shuffle.
        auto chunk_act = [&](int c, int cr, int parts) -> float {
            float hl = 0.0f;
            if (lane < cr) {
                float g = 0.0f, u = 0.0f;
                for (int p = 0; p < parts; p++) {
                    g += part[c & 1][0][lane * parts + p];
                    u += part[c & 1][1][lane * parts + p];
                }
                hl = rbf(act_mul(rbf(g), rbf(u), false));
            }
            return hl;
        };
        // A chunk's gate and up slots done with: released, then (the barrier) every warp's part
        // sums in, and the activations formed.
        auto gate_up_done = [&](int c, int cr, int parts) -> float {
            release();
            release();
#ifndef RING_MLP_NO_BAR
            ring_cbar(nct, 13);
#endif
            return chunk_act(c, cr, parts);
        };
        if (st.kind == RING_CVT) {
            for (int i = ca + ct; i < cb; i += nct) st.y[i] = ring_sum(st.x, i, st.x_len);
        } else if (st.kind == RING_GEMVT || st.kind == RING_MLP) {
            // Split-K stages: column sums in registers, added once at the end (one add_out in
            // the code for both: it is large).
            float acc[RING_MLP_COLS];
#pragma unroll
            for (int q = 0; q < RING_MLP_COLS; q++) acc[q] = 0.0f;
            const int cols = st.kind == RING_GEMVT ? st.N : st.K;
            if (F8) {
                // FP8 (every o and MLP stage of the instance): warp w keeps P pairs of 32 columns
                // from pair w P in tensor-core accumulators (ring_f8_rows; cols % (32 CW) == 0).
                const int cr = ring_chunk_rows<SLOT>(cols, 1), P = cols / (32 * CW), p0 = warp * P, t4 = 4 * (lane & 3);
                float c8[RING_F8_OCT][8];
#pragma unroll
                for (int o = 0; o < RING_F8_OCT; o++)
#pragma unroll
                    for (int i = 0; i < 8; i++) c8[o][i] = 0.0f;
                if (st.kind == RING_GEMVT) {
                    for (int c = 0; c < count; c++) {
                        const unsigned char* d = (const unsigned char*)take();
                        float h[4];
#pragma unroll
                        for (int i = 0; i < 4; i++) h[i] = t4 + i < cr ? xr[c * cr + t4 + i] : 0.0f;
                        ring_f8_rows(c8, d, cols, cr, p0, P, f16x2_sat(h[0], h[1]), f16x2_sat(h[2], h[3]), lane);
                        release();
                    }
                } else {
                    // A chunk: cr rows of gate, of up and of down^T (e4m3, cr K <= SLOT);
                    // gate|up: the chunk's cr * parts units of 1024 weights (unit v: row v / parts,
                    // columns 1024 (v % parts) on), warp w units w and w + CW; their row
                    // scales from beside the slots, taken before the slots are released.
                    const int parts = st.K / 1024, units = cr * parts;
                    const int va = warp, vb = warp + CW, ra = va / parts, rb = vb / parts;
                    const uint4* xh = xs + st.K / 8;
                    const uint4* xa = xh + (va % parts) * 128;
                    const uint4* xb = xh + (vb % parts) * 128;
                    for (int c = 0; c < count; c++) {
                        const unsigned int gi = ki, ui = ki + 1 == (unsigned int)nslots ? 0u : ki + 1;
                        const uint4* gs = take();
                        const uint4* us = take(1);
                        if (c == 0) RING_MLP_STAMP1(3);
                        // The units' rows' scales (rows past the chunk: unused, in the slot's side).
                        // Each used before the slots are released: a scale read then but used
                        // after the release (its load still in flight) made steps differ run to
                        // run, as if the producer's next copy into the slot's side had raced it.
                        const float s[4] = {sscale[gi * RING_SLOT_SCALES + ra], sscale[ui * RING_SLOT_SCALES + ra],
                                            sscale[gi * RING_SLOT_SCALES + rb], sscale[ui * RING_SLOT_SCALES + rb]};
                        float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // gate a, up a, gate b, up b
#ifndef RING_NO_MATH
                        // Both units' four dots in one branch-free block (a unit past the chunk's
                        // is unit 0 again, read and dropped), so that their MMA chains interleave:
                        // behind a branch each, FP8 1B 0.656 against 0.645-0.649 ms (session 26).
                        {
                            const int ua = va < units ? va : 0, ub = vb < units ? vb : 0;
                            v[0] = ring_f8_dot(gs + ua * 64, xa, lane), v[1] = ring_f8_dot(us + ua * 64, xa, lane);
                            v[2] = ring_f8_dot(gs + ub * 64, xb, lane), v[3] = ring_f8_dot(us + ub * 64, xb, lane);
                            if (va >= units) v[0] = v[1] = 0.0f;
                            if (vb >= units) v[2] = v[3] = 0.0f;
                        }
#endif
#pragma unroll
                        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
                            for (int i = 0; i < 4; i++) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);
#pragma unroll
                        for (int i = 0; i < 4; i++) v[i] *= s[i];  // (before the slots' release)
                        if (lane == 0) {
                            if (va < units) part[c & 1][0][va] = v[0], part[c & 1][1][va] = v[1];
                            if (vb < units) part[c & 1][0][vb] = v[2], part[c & 1][1][vb] = v[3];
                        }
                        // The activations of the scaled sums (as the skinny FP8 kernels' epilogue).
                        const float hl = gate_up_done(c, cr, parts);
                        float h[4];
#pragma unroll
                        for (int i = 0; i < 4; i++) h[i] = __shfl_sync(0xffffffffu, hl, t4 + i);
                        const unsigned char* d = (const unsigned char*)take();
                        if (c == count - 1) RING_MLP_STAMP1(5);
#if !defined(RING_NO_MATH) && !defined(RING_MLP_NO_DOWN)
                        ring_f8_rows(c8, d, cols, cr, p0, P, f16x2_sat(h[0], h[1]), f16x2_sat(h[2], h[3]), lane);
#endif
                        release();
                    }
                    RING_MLP_STAMP(6);
                }
                const bool paired = csize == 2;
                if (count > 0 || paired) {
                    // The block's column sums, scaled by their columns' scales, in column order
                    // into `red`, then thread ct's add_out columns from it: every column, in the
                    // input's place, or paired, only the block's own groups (j % 2 == crank, at
                    // j / 2) past the receiving region (the f16 input's place: every warp is past
                    // its last slot), the partner's pushed to it (add_out).
                    cp_async_wait_all();  // (the scales)
                    ring_cbar(nct, 14);
                    float4* red = paired ? (float4*)(xs + cols / 8) : (float4*)xs;
                    if (paired) partner_free();
                    const u32 peer_recv = cluster_map(smem_addr(pair_recv(cols)), crank ^ 1u);
                    const u32 peer_ready = cluster_map(smem_addr(&pair_ready), crank ^ 1u);
                    const int g = lane >> 2, t = lane & 3;
#pragma unroll
                    for (int o = 0; o < RING_F8_OCT; o++)
#pragma unroll
                        for (int k = 0; k < 2; k++) {
                            const int pl = 8 * o + 2 * t + k;
                            if (pl >= P) continue;
                            const int col = 32 * (p0 + pl) + 4 * g, j = col >> 3, half = (col >> 2) & 1;
                            const float4 sc = *(const float4*)(f8cs + col);
                            const float4 v =
                                make_float4(c8[o][k] * sc.x, c8[o][2 + k] * sc.y, c8[o][4 + k] * sc.z, c8[o][6 + k] * sc.w);
                            if (!paired) red[col / 4] = v;
                            else if ((u32)(j & 1) == crank) red[2 * (j >> 1) + half] = v;
                            else push(peer_recv, peer_ready, j, half, v.x, v.y, v.z, v.w);
                        }
                    ring_cbar(nct, 15);
#pragma unroll
                    for (int q = 0; q < RING_MLP_COLS / 8; q++) {
                        const int j = q * nct + ct;
                        if (8 * j >= cols) break;
                        if (paired && (u32)(j & 1) != crank) continue;
                        const int r = paired ? j >> 1 : j;
                        const float4 a = red[2 * r], b = red[2 * r + 1];
                        acc[q * 8] = a.x, acc[q * 8 + 1] = a.y, acc[q * 8 + 2] = a.z, acc[q * 8 + 3] = a.w;
                        acc[q * 8 + 4] = b.x, acc[q * 8 + 5] = b.y, acc[q * 8 + 6] = b.z, acc[q * 8 + 7] = b.w;
                    }
                    RING_MLP_STAMP2(3);
                }
            } else if (st.kind == RING_GEMVT) {
                const int cr = ring_chunk_rows<SLOT>(st.N);
                for (int c = 0; c < count; c++) {
                    const uint4* d = take();
#pragma unroll 4
                    for (int r = 0; r < cr; r++) add_rows(acc, d, r, xr[c * cr + r], st.N);
                    release();
                }
            } else {
                // A chunk: cr rows of gate, of up and of down^T, a slot each (cr K bf16 <=
                // SLOT); gate|up: warp w < cr * parts reduces row w / parts, columns
                // 1024 (w % parts) on.
                const int cr = ring_chunk_rows<SLOT>(st.K), parts = st.K / 1024;
                const bool dots = warp < cr * parts;
                const int col = (warp % parts) * 128;  // (units of 8 weights)
                const bool claimed = RING_MLP_CLAIMED && claim > 0;
                for (int c = 0; claimed || c < count; c++) {
                    const unsigned int si = ki;
                    // The gate and up slots together (their loads and shuffles interleave).
                    const uint4* gs = take();
                    if (claimed && slot_item[si] < 0) {  // (the block's claims are over)
                        release();
                        break;
                    }
#ifndef RING_NO_MATH
                    const uint4* us = take(1);
                    if (c == 0) RING_MLP_STAMP1(3);
                    if (dots) {
                        float pg[4], pu[4];
#pragma unroll
                        for (int it = 0; it < 4; it++) {
                            const uint4 xv = xs[col + it * 32 + lane];
                            pg[it] = dot8(gs[warp * 128 + it * 32 + lane], xv);
                            pu[it] = dot8(us[warp * 128 + it * 32 + lane], xv);
                        }
                        float g = (pg[0] + pg[1]) + (pg[2] + pg[3]);
                        float u = (pu[0] + pu[1]) + (pu[2] + pu[3]);
#pragma unroll
                        for (int o = 16; o > 0; o >>= 1) {
                            g += __shfl_xor_sync(0xffffffffu, g, o);
                            u += __shfl_xor_sync(0xffffffffu, u, o);
                        }
                        if (lane == 0) {
                            part[c & 1][0][warp] = g;
                            part[c & 1][1][warp] = u;
                        }
                    }
                    const float hl = gate_up_done(c, cr, parts);
                    const uint4* d = take();
                    if (c == count - 1) RING_MLP_STAMP1(5);
#ifndef RING_MLP_NO_DOWN
#pragma unroll 4
                    for (int r = 0; r < cr; r++) add_rows(acc, d, r, __shfl_sync(0xffffffffu, hl, r), st.K);
#endif
                    release();
#else
                    release(), take(), release(), take(), release();
#endif
                }
                RING_MLP_STAMP(6);
            }
            bool add = count > 0 || csize == 2 || (RING_MLP_CLAIMED && claim > 0);  // (a pair meets even with nothing)
#ifdef RING_NO_RED
            add = add && st.kind != RING_MLP;
#endif
            if (add) add_out(acc, cols);
#if RING_MLP_TRACE == 2
            RING_MLP_STAMP(7);
#else
            if (st.kind == RING_MLP) RING_MLP_STAMP(7);
#endif
#ifdef RING_MLP_TRACE
            if (st.kind == RING_MLP && tr && ct == 0) tr[4] = blocked;
#endif
        } else if (F8 && f8) {
            // FP8 GEMV: a slot holds 2 CW pieces of 1024 weights (piece p: row p / parts, columns
            // 1024 (p % parts) on); warp w reduces pieces 2w and 2w + 1 (ring_f8_dot; one row
            // where K % 2048 == 0, one atomic add: w and w + CW, two rows, cost the head
            // its atomics twice), the two shuffles interleaved, and scales each piece's sum by
            // its row's scale, copied beside the slot (from row rs on), before the slot's
            // release (see the MLP's).
            const unsigned int elems = (unsigned int)st.N * (unsigned int)st.K;
            const unsigned int parts = (unsigned int)st.K / 1024, rmul = ring_div_magic(parts);
            const uint4* xh = xs + st.K / 8;
            if (st.ll == RING_OUT_ROWS && st.K != 2048) __trap();
            float acc = 0.0f, sc = 1.0f;
            int row = -1, unit = -1;
            for (int i = 0; claim > 0 || i < count; i++) {
                const unsigned int si = ki;  // (the slot's index: its row scales)
                const uint4* src = take();
                const int item = claim > 0 ? slot_item[si] : start + i;
                if (item < 0) {
                    release();
                    break;
                }
#ifndef RING_NO_MATH
                const unsigned int pc0 = (unsigned int)item * (2u * CW), rs = ring_div(pc0, parts, rmul) & ~3u;
                float v[2] = {0.0f, 0.0f};
                unsigned int pr[2];  // the pieces' rows
                const bool in[2] = {(pc0 + 2 * warp) * 1024u < elems, (pc0 + 2 * warp + 1) * 1024u < elems};  // (a last slot may be short)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const unsigned int pc = pc0 + 2 * warp + h;
                    pr[h] = ring_div(pc, parts, rmul);
                    // (Unconditional, as the MLP's: a piece past a short last slot reads stale
                    // bytes of the slot, dropped.)
                    v[h] = ring_f8_dot(src + (2 * warp + h) * 64, xh + (pc - pr[h] * parts) * 128, lane);
                    if (!in[h]) v[h] = 0.0f;
                }
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) {
                    v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
                    v[1] += __shfl_xor_sync(0xffffffffu, v[1], o);
                }
                if (st.ll == RING_OUT_ROWS) {  // (K == 2048: the two pieces are one row)
                    if (lane == 0 && in[0]) {
                        const float rsc = sscale[si * RING_SLOT_SCALES + pr[0] - rs];
                        st.y[pr[0]] = v[0] * rsc + v[1] * rsc;
                    }
                    release();
                    continue;
                }
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    if (!in[h]) break;
                    if (st.ll) {  // (the piece's scaled sum as an LL word)
                        if (lane == 0)
                            ring_ll_put((unsigned long long*)st.y, pc0 + 2 * warp + h,
                                        v[h] * sscale[si * RING_SLOT_SCALES + pr[h] - rs], tag_of(s));
                        continue;
                    }
                    const int r = (int)pr[h], un = claim > 0 ? item >> 1 : 0;
                    if (r != row || un != unit) {
                        if (row >= 0 && lane == 0) ring_add(st.y, row, st.N, acc);
                        row = r, unit = un;
                        acc = 0.0f;
                        sc = sscale[si * RING_SLOT_SCALES + r - (int)rs];
                    }
                    acc += v[h] * sc;
                }
#else
                // (LL words still go out, zero, or the stages that poll them would wait forever.)
                if (st.ll == RING_OUT_LL && lane == 0) {
                    const unsigned int pc0 = (unsigned int)item * (2u * CW);
                    for (int h = 0; h < 2; h++)
                        if ((pc0 + 2 * warp + h) * 1024u < elems)
                            ring_ll_put((unsigned long long*)st.y, pc0 + 2 * warp + h, 0.0f, tag_of(s));
                }
#endif
                release();
            }
            if (row >= 0 && lane == 0) ring_add(st.y, row, st.N, acc);
        } else if (st.ll == RING_OUT_ROWS) {
            // bf16 rows of 2,048 (RING_OUT_ROWS): a slot holds CW / 2 rows, row r its pieces 2r
            // and 2r + 1; the warps of one half take a slot's rows whole (a warp's work per two
            // slots as a piece a slot, one reduction where two were), the halves alternating by
            // item, and store them: no sums, no atomics.
            if (st.K != 2048) __trap();
            for (int i = 0; claim > 0 || i < count; i++) {
                const uint4* src = take();
                const int item = claim > 0 ? slot_item[ki] : start + i;
                if (item < 0) {
                    release();
                    break;
                }
#ifndef RING_NO_MATH
                const int r = warp - (item & 1) * (CW / 2);
                const unsigned int row = (unsigned int)item * (CW / 2) + (unsigned int)r;
                if (r >= 0 && r < CW / 2 && row < (unsigned int)st.N) {
                    float p[8];
#pragma unroll
                    for (int h = 0; h < 2; h++)
#pragma unroll
                        for (int it = 0; it < 4; it++)
                            p[4 * h + it] = dot8(src[(2 * r + h) * 128 + it * 32 + lane], xs[h * 128 + it * 32 + lane]);
                    float v = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
#pragma unroll
                    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
                    if (lane == 0) st.y[row] = v;
                }
#endif
                release();
            }
        } else {
            const unsigned int elems = (unsigned int)st.N * (unsigned int)st.K;
            // A warp's 1024 weights are piece e / 1024 of the matrix, row piece / parts
            // (ring_div: pieces < 2^21 as N K < 2^31), not a division every slot.
            const unsigned int parts = (unsigned int)st.K / 1024, rmul = ring_div_magic(parts);
            float acc = 0.0f;
            int row = -1, unit = -1;  // a row's sum over consecutive slots of one unit (or run)
            for (int i = 0; claim > 0 || i < count; i++) {
                const uint4* src = take();
                const int item = claim > 0 ? slot_item[ki] : start + i;
                if (item < 0) {
                    release();
                    break;
                }
                const unsigned int e = (unsigned int)item * (SLOT / 2) + warp * 1024;
#ifndef RING_NO_MATH
                if (e < elems) {  // (the last slot of a stage may be short)
                    const unsigned int piece = e / 1024, pr = ring_div(piece, parts, rmul);
                    const int r = (int)pr, un = claim > 0 ? item >> 1 : 0;  // (a claim is two slots)
                    const float v = warp_dot(src, (int)(piece - pr * parts) * 128);
                    if (st.ll) {  // (the piece's sum as an LL word)
                        if (lane == 0) ring_ll_put((unsigned long long*)st.y, piece, v, tag_of(s));
                    } else {
                        if (r != row || un != unit) {
                            if (row >= 0 && lane == 0) ring_add(st.y, row, st.N, acc);
                            row = r, unit = un;
                            acc = 0.0f;
                        }
                        acc += v;
                    }
                }
#else
                // (LL words still go out, zero, or the stages that poll them would wait forever.)
                if (st.ll && e < elems && lane == 0) ring_ll_put((unsigned long long*)st.y, e / 1024, 0.0f, tag_of(s));
#endif
                release();
            }
            if (row >= 0 && lane == 0) ring_add(st.y, row, st.N, acc);
        }
        if (!finish()) continue;
        // The last stage: the last block to finish it (every block past its last wait) zeroes
        // the counters for the next launch. (Thread 0's finding shared by the barrier's
        // reduction: a shared word for it took the static shared memory a 128-byte unit over.)
        unsigned int old = 0, last;
        if (ct == 0) asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(done + s) : "memory");
        const unsigned int mine = ct == 0 && old + 1u == gridDim.x;
        asm volatile("{ .reg .pred p, q; setp.ne.u32 p, %1, 0; bar.red.or.pred q, 1, %2, p; selp.u32 %0, 1, 0, q; }"
                     : "=r"(last)
                     : "r"(mine), "r"(nct)
                     : "memory");
        if (last) {
            for (int i = ct; i < 2 * n; i += nct) done[i] = 0;  // (and the claims)
            if (ct == 0) done[2 * n] += 1u;                     // (the LL epoch)
        }
    }
#else
    __trap();
#endif
}
extern "C" __global__ void __launch_bounds__((RING_CW + 1) * 32, 1) gemv_ring(const RingStage* stages, int n, unsigned int* done,
                                                                           int nslots, unsigned long long* trace,
                                                                           RingStep step, int depth, int depth_mlp, int depth_attn) {
    gemv_ring_body<false, RING_SLOT>(stages, n, done, nslots, trace, step, depth, depth_mlp, depth_attn);
}
extern "C" __global__ void __launch_bounds__((RING_CW + 1) * 32, 1) gemv_ring_f8(const RingStage* stages, int n,
                                                                              unsigned int* done, int nslots,
                                                                              unsigned long long* trace, RingStep step, int depth, int depth_mlp, int depth_attn) {
    gemv_ring_body<true, RING_SLOT>(stages, n, done, nslots, trace, step, depth, depth_mlp, depth_attn);
}
// 24 KB slots (12 consumer warps), bf16 and FP8 layers: for hidden sizes whose MLP and o
// chunks (power-of-two rows of K) fill only 24 KB of a 32 KB slot, as the 3B's 4 rows of 3,072
// (8 in FP8) do; the host's `ring_slot_bytes` picks them (session 30).
extern "C" __global__ void __launch_bounds__((24576 / 2048 + 1) * 32, 1) gemv_ring_s24(const RingStage* stages, int n,
                                                                                    unsigned int* done, int nslots,
                                                                                    unsigned long long* trace, RingStep step, int depth, int depth_mlp, int depth_attn) {
    gemv_ring_body<false, 24576>(stages, n, done, nslots, trace, step, depth, depth_mlp, depth_attn);
}
extern "C" __global__ void __launch_bounds__((24576 / 2048 + 1) * 32, 1) gemv_ring_f8_s24(const RingStage* stages, int n,
                                                                                       unsigned int* done, int nslots,
                                                                                       unsigned long long* trace, RingStep step, int depth, int depth_mlp, int depth_attn) {
    gemv_ring_body<true, 24576>(stages, n, done, nslots, trace, step, depth, depth_mlp, depth_attn);
}

// FP8 weights to bf16 for the steps the skinny kernels do not take (cuBLAS then reads the
// copy): w[n, k] = bf16(e4m3(q[n, k]) * scale[n]); 8 weights a thread, k % 8 == 0.
extern "C" __global__ void dequant_fp8_rows(const unsigned char* q, const float* scale, bf16* w, int k,
                                            long long groups) {
    PDL_ENTER();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < groups;
         i += (long long)gridDim.x * blockDim.x) {
        const long long e = i * 8;
        const float s = __ldg(scale + e / k);
        const uint2 v = *(const uint2*)(q + e);
        const uint4 b = e4m3x8_bf16(v.x, v.y);
        const u32 in[4] = {b.x, b.y, b.z, b.w};
        u32 out[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            out[j] = pack_bf16(__uint_as_float(in[j] << 16) * s, __uint_as_float(in[j] & 0xffff0000u) * s);
        }
        *(uint4*)(w + e) = make_uint4(out[0], out[1], out[2], out[3]);
    }
}


// Per-token FP8 activations for the FP8 tensor-core GEMM (cuBLASLt; sm_89+, the host only
// launches it there): row m of x (bf16, K wide, K % 8 == 0) becomes e4m3 bytes xq[m] with scale
// xs[m] = amax / 448 (1 when amax is 0 or not finite) and q = e4m3(x / scale), rounded to
// nearest even and saturated: model::fp8's rule for weights (`quantize_rows`), so the host
// computes the same bytes. One block per row.
extern "C" __global__ void quantize_fp8_rows(const bf16* x, unsigned char* xq, float* xs, int K) {
    PDL_ENTER();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    __shared__ float sh[32];
    const int m = blockIdx.x;
    const uint4* xr = (const uint4*)(x + (size_t)m * K);
    const int groups = K >> 3;
    float amax = 0.0f;
    for (int i = threadIdx.x; i < groups; i += blockDim.x) {
        const uint4 v = xr[i];
        const u32 a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; j++)
            amax = fmaxf(amax, fmaxf(fabsf(__uint_as_float(a[j] << 16)), fabsf(__uint_as_float(a[j] & 0xffff0000u))));
    }
    amax = block_max(amax, sh);
    const float scale = (amax > 0.0f && amax <= 3.4028235e38f) ? amax / 448.0f : 1.0f;
    if (threadIdx.x == 0) xs[m] = scale;
    uint2* qr = (uint2*)(xq + (size_t)m * K);
    for (int i = threadIdx.x; i < groups; i += blockDim.x) {
        const uint4 v = xr[i];
        const u32 a[4] = {v.x, v.y, v.z, v.w};
        u32 o[2];
#pragma unroll
        for (int j = 0; j < 4; j += 2) {
            const float f0 = __fdiv_rn(__uint_as_float(a[j] << 16), scale);
            const float f1 = __fdiv_rn(__uint_as_float(a[j] & 0xffff0000u), scale);
            const float f2 = __fdiv_rn(__uint_as_float(a[j + 1] << 16), scale);
            const float f3 = __fdiv_rn(__uint_as_float(a[j + 1] & 0xffff0000u), scale);
            unsigned short p01, p23;
            // The first source goes to the upper byte: element k + 1 there, k in the lower one.
            asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(p01) : "f"(f1), "f"(f0));
            asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(p23) : "f"(f3), "f"(f2));
            o[j >> 1] = (u32)p01 | ((u32)p23 << 16);
        }
        qr[i] = make_uint2(o[0], o[1]);
    }
#endif
}

// The scales of an FP8 GEMM run with unit scales, in place: y[m, n] = y[m, n] * (xs[m] * ws[n])
// for m < M, n < N, rows ld apart; bf16 y (rounded again), or f32 with f32_out (logits). Pairs
// of elements per thread (N and ld even).
extern "C" __global__ void fp8_rescale(void* y, const float* xs, const float* ws, int M, int N, int ld,
                                       int f32_out) {
    PDL_ENTER();
    const int half = N >> 1;
    const long long pairs = (long long)M * half;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < pairs;
         i += (long long)gridDim.x * blockDim.x) {
        const int m = (int)(i / half), n = (int)(i - (long long)m * half) * 2;
        const float sx = __ldg(xs + m);
        const float s0 = sx * __ldg(ws + n), s1 = sx * __ldg(ws + n + 1);
        const size_t o = (size_t)m * ld + n;
        if (f32_out) {
            float2* p = (float2*)((float*)y + o);
            float2 v = *p;
            v.x *= s0;
            v.y *= s1;
            *p = v;
        } else {
            u32* p = (u32*)((bf16*)y + o);
            const u32 v = *p;
            *p = pack_bf16(__uint_as_float(v << 16) * s0, __uint_as_float(v & 0xffff0000u) * s1);
        }
    }
}
#endif  // HARRIER_F32
