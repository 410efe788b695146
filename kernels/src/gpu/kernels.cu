// ctxfs window attention and the log-sum-exp merge (kernels/src/gpu/mod.rs documents the
// layouts and the launch geometry). NVRTC compiles this at run time, so it includes no header:
// f16 is read as raw bits and converted with PTX, as cuda_fp16.h itself does.

#define THREADS 128    // threads per block, both kernels
#define WARPS (THREADS / 32)
#define TILE 32        // tokens a block attends at a time: one per lane in the softmax step
#define GMAX 8         // q heads per block; a larger GQA group is spread over blockIdx.z
#define MAX_PARTS 257  // the window's splits (at most 256) and the host's partial
#define MERGE_BATCH 16 // splits whose partials a merging thread loads at once

// Eight f16, loaded as one 16-byte access.
struct alignas(16) Vec16 {
    unsigned int x, y, z, w;
};

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// The two f16 of a word (lower address first) as f32.
__device__ __forceinline__ void unpack2(unsigned int word, float& lo, float& hi) {
    asm("{.reg .f16 l, h;\n\t"
        "mov.b32 {l, h}, %2;\n\t"
        "cvt.f32.f16 %0, l;\n\t"
        "cvt.f32.f16 %1, h;\n\t}"
        : "=f"(lo), "=f"(hi)
        : "r"(word));
}

__device__ __forceinline__ void unpack8(const Vec16& v, float* f) {
    unpack2(v.x, f[0], f[1]);
    unpack2(v.y, f[2], f[3]);
    unpack2(v.z, f[4], f[5]);
    unpack2(v.w, f[6], f[7]);
}

// Four floats, loaded as one 16-byte access.
struct alignas(16) F4 {
    float x, y, z, w;
};

// Loads that bypass L1: the last block of a fused launch reads partials other blocks wrote,
// which its multiprocessor's L1 does not see (global memory is coherent only at L2).
__device__ __forceinline__ F4 load_cg4(const float* p) {
    F4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ float load_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// Loads rows [t0, t0 + TILE) ∩ [0, len) of kv head kvh (zeros elsewhere): this thread's
// 16-byte vector c of row r of each pass.
template <int PASSES, int ROWS, int VECS>
__device__ __forceinline__ void load_tile(Vec16 (&dst)[PASSES], const Vec16* __restrict__ src, int t0, int len,
                                          int r, int c, size_t token_stride, int kvh) {
#pragma unroll
    for (int p = 0; p < PASSES; ++p) {
        const int t = t0 + p * ROWS + r;
        if (c < VECS && t < len) {
            dst[p] = src[(size_t)t * token_stride + (size_t)kvh * VECS + c];
        } else {
            dst[p] = Vec16{0u, 0u, 0u, 0u};
        }
    }
}

// Merges, for the q heads [q0, q0 + heads) (heads <= GMAX), the window's splits and, with
// has_host, the host's partial, exactly as Partial::merge does (empty parts, l == 0,
// contribute nothing): m = max m_i, w_i = exp(m_i - m) l_i, l = sum w_i, o = sum w_i o_i / l.
// The whole block takes part: a warp per head for (m, l), then every thread on 4-float slices
// of o, the splits' loads of a slice issued together (the first batch before the weights). host and out hold o [q_heads][dim], then
// m [q_heads], then l [q_heads]; split_o is [q_heads][splits][dim] and split_ml
// [q_heads][splits][2]. w_s holds GMAX × MAX_PARTS floats, ml_s 2 × GMAX.
__device__ __forceinline__ void merge_heads(const float* __restrict__ split_o, const float* __restrict__ split_ml,
                                            int splits, const float* __restrict__ host, int has_host,
                                            float* __restrict__ out, int q_heads, int dim, int q0, int heads,
                                            float* w_s, float* ml_s) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int parts = splits + (has_host ? 1 : 0);
    const size_t ms = (size_t)q_heads * dim;  // where m starts in host and out; l follows

    const int slices = dim / 4, items = heads * slices;
    // Item e is 4 floats (slice e % slices) of head e / slices's o. The first batch of this
    // thread's first item is loaded before the weights are known, so that its L2 round trip
    // overlaps the one for (m, l).
    F4 x[MERGE_BATCH];
    const auto load_batch = [&](int e, int i0) {
        const float* o = split_o + (size_t)(q0 + e / slices) * splits * dim + 4 * (e % slices);
#pragma unroll
        for (int j = 0; j < MERGE_BATCH; ++j)
            x[j] = i0 + j < splits ? load_cg4(o + (size_t)(i0 + j) * dim) : F4{0.f, 0.f, 0.f, 0.f};
    };
    if (tid < items) load_batch(tid, 0);

    for (int g = warp; g < heads; g += WARPS) {
        const int h = q0 + g;
        float mx = neg_inf();
        for (int i = lane; i < parts; i += 32) {
            const float m = i < splits ? load_cg(split_ml + ((size_t)h * splits + i) * 2) : host[ms + h];
            const float l = i < splits ? load_cg(split_ml + ((size_t)h * splits + i) * 2 + 1) : host[ms + q_heads + h];
            if (l > 0.f) mx = fmaxf(mx, m);
        }
        mx = warp_max(mx);
        float sum = 0.f;
        for (int i = lane; i < parts; i += 32) {
            const float m = i < splits ? load_cg(split_ml + ((size_t)h * splits + i) * 2) : host[ms + h];
            const float l = i < splits ? load_cg(split_ml + ((size_t)h * splits + i) * 2 + 1) : host[ms + q_heads + h];
            const float w = l > 0.f ? expf(m - mx) * l : 0.f;
            w_s[g * MAX_PARTS + i] = w;
            sum += w;
        }
        sum = warp_sum(sum);
        if (lane == 0) {
            ml_s[2 * g] = mx;
            ml_s[2 * g + 1] = sum;
        }
    }
    __syncthreads();

    for (int e = tid; e < items; e += THREADS) {
        const int g = e / slices, c = e % slices, h = q0 + g;
        const float* w = w_s + g * MAX_PARTS;
        F4 acc{0.f, 0.f, 0.f, 0.f};
        // MERGE_BATCH splits' loads in flight before the first is used: one L2 round trip per
        // batch rather than per split.
        for (int i0 = 0; i0 < splits; i0 += MERGE_BATCH) {
            if (e != tid || i0 != 0) load_batch(e, i0);
#pragma unroll
            for (int j = 0; j < MERGE_BATCH; ++j) {
                const float wj = i0 + j < splits ? w[i0 + j] : 0.f;
                // A part of weight 0 adds nothing, whatever its o.
                if (wj != 0.f) {
                    acc.x = fmaf(wj, x[j].x, acc.x);
                    acc.y = fmaf(wj, x[j].y, acc.y);
                    acc.z = fmaf(wj, x[j].z, acc.z);
                    acc.w = fmaf(wj, x[j].w, acc.w);
                }
            }
        }
        if (has_host && w[splits] != 0.f) {
            const F4 y = *reinterpret_cast<const F4*>(host + (size_t)h * dim + 4 * c);
            acc.x = fmaf(w[splits], y.x, acc.x);
            acc.y = fmaf(w[splits], y.y, acc.y);
            acc.z = fmaf(w[splits], y.z, acc.z);
            acc.w = fmaf(w[splits], y.w, acc.w);
        }
        const float l = ml_s[2 * g + 1];
        const F4 r = l > 0.f ? F4{acc.x / l, acc.y / l, acc.z / l, acc.w / l} : F4{0.f, 0.f, 0.f, 0.f};
        *reinterpret_cast<F4*>(out + (size_t)h * dim + 4 * c) = r;
    }
    if (tid < heads) {
        const float l = ml_s[2 * tid + 1];
        out[ms + q0 + tid] = l > 0.f ? ml_s[2 * tid] : neg_inf();
        out[ms + q_heads + q0 + tid] = l;
    }
}

// Partial attention of one split of the window (tiles_per_block tiles of TILE tokens) for the
// q heads [first, first + heads) of kv head blockIdx.y's group: normalised o, m = max z and
// l = sum exp(z - m), written to split_o [q_heads][splits][D] and split_ml [q_heads][splits][2].
//
// With fused, the last block of a (kv head, q-head chunk) to finish also merges that chunk's
// splits (and the host's partials) into out, as the merge kernel would: one launch instead of
// two. Each block counts itself in done[blockIdx.y * gridDim.z + blockIdx.z]; the last resets
// the counter to 0 for the next launch, which the stream orders after this one.
//
// The window is token-major, [capacity][kv_heads][D] f16. LANES threads share a row (16 bytes
// each), so a pass of the block covers ROWS rows and a tile PASSES passes. The K/V tile is read
// once for all q heads of the group. Every load of a tile is issued before the first is used:
// the first tile's before the queries are read, each next tile's keys as soon as the current
// keys are scored, and its values once the current values are summed.
template <int D>
__device__ __forceinline__ void attend(const Vec16* __restrict__ keys, const Vec16* __restrict__ values,
                                       const float* __restrict__ q, float* __restrict__ split_o,
                                       float* __restrict__ split_ml, int len, int kv_heads, int group,
                                       int tiles_per_block, float scale, int fused,
                                       const float* __restrict__ host, int has_host, float* __restrict__ out,
                                       unsigned int* __restrict__ done) {
    constexpr int VECS = D / 8;
    constexpr int LANES = VECS <= 8 ? 8 : (VECS <= 16 ? 16 : 32);
    constexpr int ROWS = THREADS / LANES;
    constexpr int PASSES = TILE / ROWS;
    static_assert(D % 8 == 0 && VECS <= 32, "head dim: a multiple of 8, at most 256");

    __shared__ float q_s[GMAX][D];
    __shared__ float p_s[GMAX][TILE];
    __shared__ float m_s[GMAX], l_s[GMAX], corr_s[GMAX];
    // The warps' sums of o, and later (fused) the merge's weights: one buffer, used in turn.
    constexpr int RED = WARPS * GMAX * D, MERGE = GMAX * MAX_PARTS;
    __shared__ float scratch[RED > MERGE ? RED : MERGE];
    __shared__ float ml_s[2 * GMAX];
    __shared__ int last_s;
    float(*red_s)[GMAX][D] = reinterpret_cast<float(*)[GMAX][D]>(scratch);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int c = tid % LANES;  // the row's 16-byte vector this thread reads
    const int r = tid / LANES;  // the row of a pass this thread reads
    const bool reads = c < VECS;
    const int split = blockIdx.x, splits = gridDim.x;
    const int kvh = blockIdx.y;
    const int first = blockIdx.z * GMAX;
    const int heads = min(GMAX, group - first);
    const int q0 = kvh * group + first;
    const size_t token_stride = (size_t)kv_heads * VECS;
    const int tiles = (len + TILE - 1) / TILE;
    const int tile_end = min(tiles, (split + 1) * tiles_per_block);
    int tile = split * tiles_per_block;

    Vec16 kv[PASSES], vv[PASSES];
    if (tile < tile_end) {
        load_tile<PASSES, ROWS, VECS>(kv, keys, tile * TILE, len, r, c, token_stride, kvh);
        load_tile<PASSES, ROWS, VECS>(vv, values, tile * TILE, len, r, c, token_stride, kvh);
    }
    for (int i = tid; i < heads * D; i += THREADS) q_s[i / D][i % D] = q[(size_t)q0 * D + i];
    if (tid < GMAX) {
        m_s[tid] = neg_inf();
        l_s[tid] = 0.f;
    }
    __syncthreads();

    float acc[GMAX][8];
#pragma unroll
    for (int g = 0; g < GMAX; ++g)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = 0.f;

    for (; tile < tile_end; ++tile) {
        const int t0 = tile * TILE;
        const bool more = tile + 1 < tile_end;

        // Scores: each thread's 8 products, summed over the row's LANES threads by shuffles.
#pragma unroll
        for (int p = 0; p < PASSES; ++p) {
            float k[8];
            unpack8(kv[p], k);
            const int t = p * ROWS + r;
#pragma unroll
            for (int g = 0; g < GMAX; ++g) {
                if (g < heads) {
                    float s = 0.f;
                    if (reads) {
#pragma unroll
                        for (int i = 0; i < 8; ++i) s = fmaf(k[i], q_s[g][c * 8 + i], s);
                    }
#pragma unroll
                    for (int off = LANES / 2; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
                    if (c == 0) p_s[g][t] = t0 + t < len ? s * scale : neg_inf();
                }
            }
        }
        if (more) load_tile<PASSES, ROWS, VECS>(kv, keys, t0 + TILE, len, r, c, token_stride, kvh);
        __syncthreads();

        // Online softmax over the tile: warp w takes heads w, w + WARPS, ...; lane = token.
        for (int g = warp; g < heads; g += WARPS) {
            const float z = p_s[g][lane];
            const float m_old = m_s[g];
            const float m_new = fmaxf(m_old, warp_max(z));
            const float e = z == neg_inf() ? 0.f : __expf(z - m_new);
            const float sum = warp_sum(e);
            p_s[g][lane] = e;
            if (lane == 0) {
                const float corr = m_old == neg_inf() ? 0.f : __expf(m_old - m_new);
                corr_s[g] = corr;
                l_s[g] = l_s[g] * corr + sum;
                m_s[g] = m_new;
            }
        }
        __syncthreads();

        // Values: rescale what the earlier tiles summed, add this tile's weighted rows.
#pragma unroll
        for (int g = 0; g < GMAX; ++g) {
            if (g < heads) {
                const float corr = corr_s[g];
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[g][i] *= corr;
            }
        }
#pragma unroll
        for (int p = 0; p < PASSES; ++p) {
            float v[8];
            unpack8(vv[p], v);
            const int t = p * ROWS + r;
#pragma unroll
            for (int g = 0; g < GMAX; ++g) {
                if (g < heads) {
                    const float w = p_s[g][t];
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[g][i] = fmaf(w, v[i], acc[g][i]);
                }
            }
        }
        if (more) load_tile<PASSES, ROWS, VECS>(vv, values, t0 + TILE, len, r, c, token_stride, kvh);
        __syncthreads();  // the next tile rewrites p_s and corr_s
    }

    // Sum the rows' accumulators: by shuffles within a warp, then across warps in shared memory.
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
        if (g < heads) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                float s = acc[g][i];
#pragma unroll
                for (int off = LANES; off < 32; off <<= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
                if (lane < LANES && reads) red_s[warp][g][c * 8 + i] = s;
            }
        }
    }
    __syncthreads();
    for (int i = tid; i < heads * D; i += THREADS) {
        const int g = i / D, d = i % D;
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) s += red_s[w][g][d];
        const float l = l_s[g];
        split_o[((size_t)(q0 + g) * splits + split) * D + d] = l > 0.f ? s / l : 0.f;
    }
    if (tid < heads) {
        const size_t at = ((size_t)(q0 + tid) * splits + split) * 2;
        split_ml[at] = m_s[tid];
        split_ml[at + 1] = l_s[tid];
    }
    if (!fused) return;

    // The last block of the chunk merges: each block's writes are made visible device-wide
    // before it counts itself, so the block that counts last sees every split.
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        unsigned int* counter = done + blockIdx.y * gridDim.z + blockIdx.z;
        const bool last = atomicAdd(counter, 1u) == (unsigned int)(splits - 1);
        if (last) *counter = 0u;
        last_s = last;
    }
    __syncthreads();
    if (!last_s) return;
    __threadfence();
    merge_heads(split_o, split_ml, splits, host, has_host, out, kv_heads * group, D, q0, heads, scratch, ml_s);
}

#define ATTEND(D)                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                     \
        attend_d##D(const Vec16* __restrict__ keys, const Vec16* __restrict__ values,                       \
                    const float* __restrict__ q, float* __restrict__ split_o, float* __restrict__ split_ml, \
                    int len, int kv_heads, int group, int tiles_per_block, float scale, int fused,           \
                    const float* __restrict__ host, int has_host, float* __restrict__ out,                   \
                    unsigned int* __restrict__ done) {                                                        \
        attend<D>(keys, values, q, split_o, split_ml, len, kv_heads, group, tiles_per_block, scale, fused,    \
                  host, has_host, out, done);                                                                 \
    }

ATTEND(64)
ATTEND(80)
ATTEND(96)
ATTEND(128)
ATTEND(256)

// One block per (kv head, chunk of at most GMAX q heads of its group), as the attention's
// grid: merges the window's splits of those q heads with the host's partials (merge_heads).
extern "C" __global__ void __launch_bounds__(THREADS)
    merge(const float* __restrict__ split_o, const float* __restrict__ split_ml, int splits,
          const float* __restrict__ host, int has_host, float* __restrict__ out, int q_heads, int group, int dim) {
    __shared__ float w_s[GMAX * MAX_PARTS];
    __shared__ float ml_s[2 * GMAX];
    const int first = blockIdx.y * GMAX;
    merge_heads(split_o, split_ml, splits, host, has_host, out, q_heads, dim, blockIdx.x * group + first,
                min(GMAX, group - first), w_s, ml_s);
}
