// Harrier's CUDA kernels, compiled at engine start with NVRTC (see kernels/src/lib.rs).
//
// Conventions: bf16 storage (as raw 16-bit words, converted here; no CUDA headers needed),
// fp32 arithmetic. Where the rounding points of Hugging Face's bf16 modules are cheap to
// reproduce (RMSNorm, RoPE, SiLU-and-mul, residual adds) they are reproduced, so bf16 parity
// with transformers is as close as the GEMMs allow. Every kernel is `extern "C"`.
//
// Index types: token rows `t < T`, sequences `s < S`, backend rows `row < max_rows`.

typedef unsigned short bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define NEG_INF (__int_as_float(0xff800000))

__device__ __forceinline__ float bf2f(bf16 x) { return __uint_as_float(((u32)x) << 16); }

// Round to nearest even; NaN stays NaN.
__device__ __forceinline__ bf16 f2bf(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

// Rounds through bf16 (a bf16 tensor op's result).
__device__ __forceinline__ float rbf(float f) { return bf2f(f2bf(f)); }

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

// ---------------------------------------------------------------------------------------------
// Embedding: out[t] = table[token(t)], where token(t) = tok_src[t] if >= 0 (from the host), else
// pending[-tok_src[t] - 1] (the row's last sampled token, written on the device by sampling).
extern "C" __global__ void embed_tokens(bf16* out, const bf16* table, const int* tok_src, const int* pending,
                                        int hidden, int vocab) {
    int t = blockIdx.x;
    int s = tok_src[t];
    int tok = s >= 0 ? s : pending[-s - 1];
    if (tok < 0 || tok >= vocab) tok = 0;
    const bf16* row = table + (size_t)tok * hidden;
    bf16* o = out + (size_t)t * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = row[i];
}

// ---------------------------------------------------------------------------------------------
// Residual add + RMSNorm, Hugging Face's bf16 rounding points:
//   x = bf16(resid + delta)            (when delta != 0; written back to resid)
//   out = bf16(w * bf16(x * rsqrt(mean(x^2) + eps)))
// Block i handles row src = rows ? rows[i] : i and writes out row i (rows: the final norm over
// the rows that want logits).
extern "C" __global__ void add_rmsnorm(bf16* resid, const bf16* delta, const bf16* w, bf16* out, const int* rows,
                                       int hidden, float eps) {
    __shared__ float sh[32];
    int i = blockIdx.x;
    int src = rows ? rows[i] : i;
    bf16* x = resid + (size_t)src * hidden;
    const bf16* d = delta ? delta + (size_t)src * hidden : 0;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
        float v = bf2f(x[j]);
        if (d) {
            v = rbf(v + bf2f(d[j]));
            x[j] = f2bf(v);
        }
        ss += v * v;
    }
    ss = block_sum(ss, sh);
    float inv = rsqrtf(ss / (float)hidden + eps);
    bf16* o = out + (size_t)i * hidden;
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
        float v = bf2f(x[j]);
        o[j] = f2bf(bf2f(w[j]) * rbf(v * inv));
    }
}

// ---------------------------------------------------------------------------------------------
// Per token: (Qwen3) per-head RMSNorm of q and k, RoPE (rotate-half, bf16 cos/sin as HF), q
// rotated in place, k and v stored in the paged cache at slot_mapping[t]
// (cache layout [num_blocks * block_size, nkv, hd]). One warp per head; hd <= 256, hd % 64 == 0.
extern "C" __global__ void rope_kv_write(bf16* qkv, int qkv_stride, int nh, int nkv, int hd, const int* positions,
                                         const float* inv_freq, const bf16* q_norm, const bf16* k_norm, float eps,
                                         const int* slot_mapping, bf16* k_cache, bf16* v_cache) {
    int t = blockIdx.x;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    int half = hd >> 1;
    float pos = (float)positions[t];
    long long slot = slot_mapping[t];
    bf16* row = qkv + (size_t)t * qkv_stride;
    for (int h = warp; h < nh + 2 * nkv; h += nw) {
        bf16* x = row + (size_t)h * hd;
        if (h >= nh + nkv) {
            int kh = h - nh - nkv;
            bf16* dst = v_cache + (size_t)(slot * nkv + kh) * hd;
            for (int i = lane; i < hd; i += 32) dst[i] = x[i];
            continue;
        }
        bool is_q = h < nh;
        const bf16* nw_ = is_q ? q_norm : k_norm;
        float inv = 1.0f;
        if (nw_) {
            float ss = 0.0f;
            for (int i = lane; i < hd; i += 32) {
                float v = bf2f(x[i]);
                ss += v * v;
            }
            ss = warp_sum(ss);
            inv = rsqrtf(ss / (float)hd + eps);
        }
        bf16* dst = is_q ? x : k_cache + (size_t)(slot * nkv + (h - nh)) * hd;
        for (int i = lane; i < half; i += 32) {
            float a = bf2f(x[i]), b = bf2f(x[i + half]);
            if (nw_) {
                a = rbf(bf2f(nw_[i]) * rbf(a * inv));
                b = rbf(bf2f(nw_[i + half]) * rbf(b * inv));
            }
            float ang = pos * inv_freq[i];
            float c = rbf(cosf(ang)), s = rbf(sinf(ang));
            float o1 = rbf(rbf(a * c) + rbf(-b * s));
            float o2 = rbf(rbf(b * c) + rbf(a * s));
            dst[i] = f2bf(o1);
            dst[i + half] = f2bf(o2);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// out[r, i] = bf16(bf16(silu(gate)) * up), rows of gu = [gate | up].
extern "C" __global__ void silu_mul(bf16* out, const bf16* gu, int inter, long long total) {
    for (long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x; k < total; k += (long long)gridDim.x * blockDim.x) {
        long long r = k / inter;
        int i = (int)(k - r * inter);
        float g = bf2f(gu[r * 2 * inter + i]);
        float u = bf2f(gu[r * 2 * inter + inter + i]);
        float a = rbf(g / (1.0f + expf(-g)));
        out[k] = f2bf(a * u);
    }
}

// ---------------------------------------------------------------------------------------------
// Paged attention, decode and prefill alike: token t (of sequence tok_seq[t], at position
// positions[t]) attends causally to positions [start, positions[t]] of its sequence through its
// block table (start = positions[t] - window + 1 with a sliding window, else 0). The new
// chunk's K/V must already be in the cache (rope_kv_write). q is read from the qkv rows
// (stride q_stride).
//
// Grid (T, nh), ATT_WARPS warps per block. Keys go in tiles of 32, tile i to warp
// i % ATT_WARPS, one key per lane: each lane computes its key's full dot product with q
// (q scaled, in shared memory; K rows read with 16-byte loads), the warp does one max and one
// sum per tile (online softmax), then accumulates V with the lanes splitting head_dim
// (coalesced rows, weights broadcast by shuffles). Warps merge their (max, sum, acc) at the end.
// Measured on the H200 (1B shape, 500-token context, batch 1): 124 us per layer with one key
// per warp step and a warp reduction per key, 36 us with 16 warps of that, lane-per-key below.
#define ATT_WARPS 16
extern "C" __global__ void paged_attention(bf16* out, const bf16* q, int q_stride, const bf16* k_cache,
                                           const bf16* v_cache, const int* tok_seq, const int* positions,
                                           const int* block_tables, int bt_stride, int nh, int nkv, int hd,
                                           int block_size, float scale, int window) {
    __shared__ float sq[256];
    __shared__ float sm_m[ATT_WARPS], sm_l[ATT_WARPS];
    __shared__ float sm_acc[ATT_WARPS][256];
    int t = blockIdx.x, h = blockIdx.y;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int nv = hd >> 5;
    int kh = h / (nh / nkv);
    int pos = positions[t];
    const int* bt = block_tables + (size_t)tok_seq[t] * bt_stride;
    int start = window > 0 ? max(0, pos - window + 1) : 0;
    const bf16* qp = q + (size_t)t * q_stride + (size_t)h * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) sq[d] = bf2f(qp[d]) * scale;
    __syncthreads();
    float acc[8];
#pragma unroll
    for (int j = 0; j < 8; j++) acc[j] = 0.0f;
    float m = NEG_INF, l = 0.0f;
    for (int base = start + warp * 32; base <= pos; base += ATT_WARPS * 32) {
        int p = base + lane;
        float s = NEG_INF;
        int slot = 0;
        if (p <= pos) {
            slot = bt[p / block_size] * block_size + p % block_size;
            const uint4* kp = (const uint4*)(k_cache + ((size_t)slot * nkv + kh) * hd);
            float dot = 0.0f;
            for (int c = 0; c < (hd >> 3); c++) {
                uint4 w = kp[c];
                const float* qc = sq + c * 8;
                dot += qc[0] * __uint_as_float(w.x << 16) + qc[1] * __uint_as_float(w.x & 0xffff0000u);
                dot += qc[2] * __uint_as_float(w.y << 16) + qc[3] * __uint_as_float(w.y & 0xffff0000u);
                dot += qc[4] * __uint_as_float(w.z << 16) + qc[5] * __uint_as_float(w.z & 0xffff0000u);
                dot += qc[6] * __uint_as_float(w.w << 16) + qc[7] * __uint_as_float(w.w & 0xffff0000u);
            }
            s = dot;
        }
        // Lane 0's key (p = base) is always valid, so the tile max is finite.
        float m_new = fmaxf(m, warp_max(s));
        float corr = __expf(m - m_new);
        float pe = p <= pos ? __expf(s - m_new) : 0.0f;
        l = l * corr + warp_sum(pe);
#pragma unroll
        for (int j = 0; j < 8; j++) acc[j] *= corr;
        int n_keys = min(32, pos - base + 1);
        for (int i = 0; i < n_keys; i++) {
            float wgt = __shfl_sync(0xffffffffu, pe, i);
            int slot_i = __shfl_sync(0xffffffffu, slot, i);
            const bf16* vp = v_cache + ((size_t)slot_i * nkv + kh) * hd + lane * nv;
#pragma unroll
            for (int j = 0; j < 8; j++)
                if (j < nv) acc[j] += wgt * bf2f(vp[j]);
        }
        m = m_new;
    }
    if (lane == 0) {
        sm_m[warp] = m;
        sm_l[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < 8; j++)
        if (j < nv) sm_acc[warp][lane * nv + j] = acc[j];
    __syncthreads();
    float M = NEG_INF;
    for (int w = 0; w < ATT_WARPS; w++) M = fmaxf(M, sm_m[w]);
    float L = 0.0f;
    for (int w = 0; w < ATT_WARPS; w++) L += sm_l[w] * __expf(sm_m[w] - M);
    bf16* o = out + (size_t)t * nh * hd + (size_t)h * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float v = 0.0f;
        for (int w = 0; w < ATT_WARPS; w++) v += sm_acc[w][d] * __expf(sm_m[w] - M);
        o[d] = f2bf(v / L);
    }
}

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
    int host_sampled;   // 1: sampled on the host (penalties, logprobs); the kernel skips the row
    int mask_len;
    int mask[MASK_CAP];
};

extern "C" __global__ void apply_row_inits(RowParams* rows, const RowParams* inits, const int* init_rows, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) rows[init_rows[i]] = inits[i];
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

// Argmax over v[0..n), ties to the lowest index, NaN never wins.
__device__ int block_argmax(const float* v, int n, float* shv, int* shi) {
    float best = NEG_INF;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float x = v[i];
        if (x > best || (x == best && i < bi)) {
            best = x;
            bi = i;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ob = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ob > best || (ob == best && oi < bi)) {
            best = ob;
            bi = oi;
        }
    }
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
        for (int o = 16; o > 0; o >>= 1) {
            float ob = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ob > best || (ob == best && oi < bi)) {
                best = ob;
                bi = oi;
            }
        }
        if (lane == 0) shi[0] = bi;
    }
    __syncthreads();
    int r = shi[0];
    __syncthreads();
    return r == 0x7fffffff ? 0 : r;
}

// Samples one token per block (the k-th sampled sequence, row sample_rows[k]) from logits
// (f32 [n, vocab], modified in place), in the CPU sampler's order: min_tokens mask; greedy
// argmax, or temperature, top-k, softmax, top-p, min-p and inverse-CDF sampling in token-id
// order with philox(seed, generated). Writes out_tokens[k] and pending[row]; advances the row.
// blockDim.x = 1024.
extern "C" __global__ void sample_tokens(float* logits, int vocab, const int* sample_rows, RowParams* rows,
                                         int* out_tokens, int* pending) {
    __shared__ float shf[32];
    __shared__ int shi[32];
    __shared__ double shd[32];
    __shared__ double chunk_prefix[1024];
    __shared__ int found;
    int k = blockIdx.x;
    int row = sample_rows[k];
    RowParams* rp = rows + row;
    if (rp->host_sampled) return;
    float* lg = logits + (size_t)k * vocab;
    u32 gen = rp->generated;
    if (gen < rp->min_tokens) {
        __syncthreads();
        if (threadIdx.x < rp->mask_len && threadIdx.x < MASK_CAP) {
            int m = rp->mask[threadIdx.x];
            if (m >= 0 && m < vocab) lg[m] = NEG_INF;
        }
        __syncthreads();
    }
    int token;
    float temp = rp->temperature;
    if (temp < 1e-5f) {
        token = block_argmax(lg, vocab, shf, shi);
    } else {
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
                c = block_sum(c, shf);
                if (c >= (float)topk) ans = cand;
            }
            for (int i = threadIdx.x; i < vocab; i += blockDim.x)
                if (fkey(lg[i]) < ans) lg[i] = NEG_INF;
            __syncthreads();
        }
        float mx = NEG_INF;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) mx = fmaxf(mx, lg[i]);
        mx = block_max(mx, shf);
        if (mx == NEG_INF) {
            token = block_argmax(lg, vocab, shf, shi);
        } else {
            double sum = 0.0;
            for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
                float p = expf(lg[i] - mx);
                lg[i] = p;
                sum += (double)p;
            }
            sum = block_sum(sum, shd);
            if (rp->top_p < 1.0f) {
                // Keep the largest probabilities whose sum reaches top_p * sum: the largest key u
                // with S(key >= u) >= target, then drop everything below it (ties at the
                // threshold are all kept).
                double target = (double)rp->top_p * sum;
                u32 ans = 0;
                for (int bit = 31; bit >= 0; bit--) {
                    u32 cand = ans | (1u << bit);
                    double s = 0.0;
                    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
                        float p = lg[i];
                        if (p > 0.0f && fkey(p) >= cand) s += (double)p;
                    }
                    s = block_sum(s, shd);
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
                __syncthreads();
            }
            // Inverse CDF in token-id order: contiguous chunks per thread, prefix over chunks.
            int chunk = (vocab + blockDim.x - 1) / blockDim.x;
            int lo = threadIdx.x * chunk, hi = min(vocab, lo + chunk);
            double cs = 0.0;
            int last = -1;
            for (int i = lo; i < hi; i++) {
                float p = lg[i];
                if (p > 0.0f) {
                    cs += (double)p;
                    last = i;
                }
            }
            chunk_prefix[threadIdx.x] = cs;
            if (threadIdx.x == 0) found = (int)0x80000000;
            __syncthreads();
            if (threadIdx.x == 0) {
                double acc = 0.0;
                for (int j = 0; j < blockDim.x; j++) {
                    double v = chunk_prefix[j];
                    chunk_prefix[j] = acc;
                    acc += v;
                }
                shd[0] = acc;
            }
            __syncthreads();
            double total = shd[0];
            double u = philox_uniform(rp->seed_lo, rp->seed_hi, (u64)gen);
            double tgt = u * total;
            double before = chunk_prefix[threadIdx.x];
            if (before <= tgt && before + cs > tgt) {
                double acc = before;
                for (int i = lo; i < hi; i++) {
                    float p = lg[i];
                    if (p > 0.0f) {
                        acc += (double)p;
                        if (acc > tgt) {
                            atomicMax(&found, -1 - i);  // lowest i wins (largest -1-i)
                            break;
                        }
                    }
                }
            }
            // Fallback (rounding): the last kept token.
            __syncthreads();
            int f = found;
            if (f == (int)0x80000000) {
                shi[0] = -1;
                __syncthreads();
                if (last >= 0) atomicMax(&shi[0], last);
                __syncthreads();
                token = max(shi[0], 0);
            } else {
                token = -1 - f;
            }
        }
    }
    if (threadIdx.x == 0) {
        out_tokens[k] = token;
        pending[row] = token;
        rp->generated = gen + 1;
    }
}

// Copies float rows: out[i] = in[i] (used to keep raw logits for host-side sampling).
extern "C" __global__ void copy_f32(float* out, const float* in, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = in[i];
}

// Writes host-sampled tokens into the rows' pending slots (rows[i] <- tokens[i]) and advances
// nothing else (the host sampler keeps its own counter for such rows).
extern "C" __global__ void scatter_pending(int* pending, const int* rows, const int* tokens, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) pending[rows[i]] = tokens[i];
}
