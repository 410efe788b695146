// ctxfs window attention and the log-sum-exp merge (kernels/src/gpu/mod.rs documents the
// layouts and the launch geometry). NVRTC compiles this at run time, so it includes no header:
// f16 is read as raw bits and converted with PTX, as cuda_fp16.h itself does.

#define THREADS 128    // threads per block, every kernel
#define WARPS (THREADS / 32)
#define TILE 32        // tokens a block attends at a time: one per lane in the softmax step
// q heads per block; a GQA group is spread over blockIdx.z. One: an attention block's time is
// its chain of dependent instructions, which grows with its q heads, and the q heads of a group
// read their kv head's rows from L2 after the first.
#define GMAX 1
#define MAX_PARTS 257  // the window's splits (at most 256) and the host's partial
#define MERGE_BATCH 16 // splits whose partials a merging thread loads at once
#define MAX_CLUSTER 16 // splits of a cluster launch (attend_cluster): at most MERGE_BATCH

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

// The attention kernels' geometry for head dim D. The window is token-major,
// [capacity][kv_heads][D] f16. LANES threads share a row (16 bytes each), so a pass of the
// block covers ROWS rows and a tile PASSES passes.
template <int D>
struct Geometry {
    static constexpr int VECS = D / 8;
    static constexpr int LANES = VECS <= 8 ? 8 : (VECS <= 16 ? 16 : 32);
    static constexpr int ROWS = THREADS / LANES;
    static constexpr int PASSES = TILE / ROWS;
    // The warps' sums of o, and later the merge's weights: one buffer, used in turn.
    static constexpr int RED = WARPS * GMAX * D, MERGE = GMAX * MAX_PARTS;
    static constexpr int SCRATCH = RED > MERGE ? RED : MERGE;
    static_assert(D % 8 == 0 && VECS <= 32, "head dim: a multiple of 8, at most 256");
};

// An attention block's shared memory.
template <int D>
struct alignas(16) Shared {
    // The q heads' queries; once the tiles are done, the block's partial o (normalised).
    float q[GMAX][D];
    // The scores of a tile, in two buffers that tiles use in turn.
    float p[2][GMAX][TILE];
    float m[GMAX], l[GMAX];
    float scratch[Geometry<D>::SCRATCH];
    float ml[2 * GMAX];
    int last;
};

// One tile of TILE tokens from t0 (kv/vv: this thread's vectors of its keys and values) into
// scores buffer BUF: scores, the online softmax (m, l) and the weighted values added to acc.
// One barrier: every warp computes the softmax of every head itself (the same values in
// each), and takes the weights of its rows from the lanes that hold them; the next tile
// writes the other scores buffer, and the one after it this one only once every warp has
// passed the next tile's barrier, so after reading this one.
template <int D, int BUF>
__device__ __forceinline__ void attend_tile(Shared<D>& s, const Vec16 (&kv)[Geometry<D>::PASSES],
                                            const Vec16 (&vv)[Geometry<D>::PASSES], float (&acc)[GMAX][8],
                                            float (&m)[GMAX], float (&l)[GMAX], int t0, int len, int heads,
                                            float scale) {
    using G = Geometry<D>;
    const int tid = threadIdx.x, lane = tid & 31;
    const int c = tid % G::LANES, r = tid / G::LANES;
    const bool reads = c < G::VECS;

    // Scores: each thread's 8 products, summed over the row's LANES threads by shuffles.
#pragma unroll
    for (int p = 0; p < G::PASSES; ++p) {
        float k[8];
        unpack8(kv[p], k);
        const int t = p * G::ROWS + r;
#pragma unroll
        for (int g = 0; g < GMAX; ++g) {
            if (g < heads) {
                float sc = 0.f;
                if (reads) {
#pragma unroll
                    for (int i = 0; i < 8; ++i) sc = fmaf(k[i], s.q[g][c * 8 + i], sc);
                }
#pragma unroll
                for (int off = G::LANES / 2; off > 0; off >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, off);
                if (c == 0) s.p[BUF][g][t] = t0 + t < len ? sc * scale : neg_inf();
            }
        }
    }
    __syncthreads();

    // Online softmax over the tile, lane = token; what the earlier tiles summed is rescaled.
    float e[GMAX];
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
        e[g] = 0.f;
        if (g < heads) {
            const float z = s.p[BUF][g][lane];
            const float m_new = fmaxf(m[g], warp_max(z));
            e[g] = z == neg_inf() ? 0.f : __expf(z - m_new);
            const float sum = warp_sum(e[g]);
            const float corr = m[g] == neg_inf() ? 0.f : __expf(m[g] - m_new);
            l[g] = l[g] * corr + sum;
            m[g] = m_new;
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[g][i] *= corr;
        }
    }

    // Values: this tile's rows, weighted.
#pragma unroll
    for (int p = 0; p < G::PASSES; ++p) {
        float v[8];
        unpack8(vv[p], v);
        const int t = p * G::ROWS + r;
#pragma unroll
        for (int g = 0; g < GMAX; ++g) {
            if (g < heads) {
                const float w = __shfl_sync(0xffffffffu, e[g], t);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[g][i] = fmaf(w, v[i], acc[g][i]);
            }
        }
    }
}

// Partial attention of one split of the window (tokens [split · tokens_per_block,
// (split + 1) · tokens_per_block) ∩ [0, len), in tiles of TILE tokens) for the q heads
// [q0, q0 + heads) of kv head kvh: leaves the normalised o in s.q, m = max z in s.m and
// l = sum exp(z - m) in s.l.
//
// The K/V tile is read once for all q heads of the group. Two tiles' loads are in flight:
// the first two are issued before the queries are read, and each next one as its tile
// before last is attended.
template <int D>
__device__ __forceinline__ void attend_split(Shared<D>& s, const Vec16* __restrict__ keys,
                                             const Vec16* __restrict__ values, const float* __restrict__ q, int len,
                                             int kv_heads, int kvh, int q0, int heads, int split, int tokens_per_block,
                                             float scale) {
    using G = Geometry<D>;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int c = tid % G::LANES;  // the row's 16-byte vector this thread reads
    const int r = tid / G::LANES;  // the row of a pass this thread reads
    const size_t token_stride = (size_t)kv_heads * G::VECS;
    const int start = split * tokens_per_block, end = min(len, start + tokens_per_block);
    const int tiles = (end - start + TILE - 1) / TILE;
    int tile = 0;

    Vec16 ka[G::PASSES], va[G::PASSES], kb[G::PASSES], vb[G::PASSES];
    const auto load = [&](Vec16(&k)[G::PASSES], Vec16(&v)[G::PASSES], int at) {
        load_tile<G::PASSES, G::ROWS, G::VECS>(k, keys, start + at * TILE, end, r, c, token_stride, kvh);
        load_tile<G::PASSES, G::ROWS, G::VECS>(v, values, start + at * TILE, end, r, c, token_stride, kvh);
    };
    if (tiles > 0) load(ka, va, 0);
    if (tiles > 1) load(kb, vb, 1);
    for (int i = tid; i < heads * D; i += THREADS) s.q[i / D][i % D] = q[(size_t)q0 * D + i];
    __syncthreads();

    float acc[GMAX][8], m[GMAX], l[GMAX];
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
        m[g] = neg_inf();
        l[g] = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = 0.f;
    }

    // Tiles alternate between the two register buffers and the two scores buffers: a and 0
    // take even ones, b and 1 odd ones.
    while (tile < tiles) {
        attend_tile<D, 0>(s, ka, va, acc, m, l, start + tile * TILE, end, heads, scale);
        if (tile + 2 < tiles) load(ka, va, tile + 2);
        if (++tile == tiles) break;
        attend_tile<D, 1>(s, kb, vb, acc, m, l, start + tile * TILE, end, heads, scale);
        if (tile + 2 < tiles) load(kb, vb, tile + 2);
        ++tile;
    }
    if (tid == 0) {
#pragma unroll
        for (int g = 0; g < GMAX; ++g) {
            s.m[g] = m[g];
            s.l[g] = l[g];
        }
    }

    // Sum the rows' accumulators: by shuffles within a warp, then across warps in shared memory.
    float(*red)[GMAX][D] = reinterpret_cast<float(*)[GMAX][D]>(s.scratch);
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
        if (g < heads) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                float sum = acc[g][i];
#pragma unroll
                for (int off = G::LANES; off < 32; off <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
                if (lane < G::LANES && c < G::VECS) red[warp][g][c * 8 + i] = sum;
            }
        }
    }
    __syncthreads();
    for (int i = tid; i < heads * D; i += THREADS) {
        const int g = i / D, d = i % D;
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) sum += red[w][g][d];
        const float lg = s.l[g];
        s.q[g][d] = lg > 0.f ? sum / lg : 0.f;
    }
    __syncthreads();
}

// Partial attention of one split of the window (attend_split) for the q heads
// [first, first + heads) of kv head blockIdx.y's group, blockIdx.z · GMAX = first, written to
// split_o [q_heads][splits][D] and split_ml [q_heads][splits][2].
//
// With fused, the last block of a (kv head, q-head chunk) to finish also merges that chunk's
// splits (and the host's partials) into out, as the merge kernel would: one launch instead of
// two. Each block counts itself in done[blockIdx.y * gridDim.z + blockIdx.z]; the last resets
// the counter to 0 for the next launch, which the stream orders after this one.
template <int D>
__device__ __forceinline__ void attend(const Vec16* __restrict__ keys, const Vec16* __restrict__ values,
                                       const float* __restrict__ q, float* __restrict__ split_o,
                                       float* __restrict__ split_ml, int len, int kv_heads, int group,
                                       int tokens_per_block, float scale, int fused,
                                       const float* __restrict__ host, int has_host, float* __restrict__ out,
                                       unsigned int* __restrict__ done) {
    __shared__ Shared<D> s;
    const int tid = threadIdx.x;
    const int split = blockIdx.x, splits = gridDim.x;
    const int kvh = blockIdx.y;
    const int first = blockIdx.z * GMAX;
    const int heads = min(GMAX, group - first);
    const int q0 = kvh * group + first;
    attend_split<D>(s, keys, values, q, len, kv_heads, kvh, q0, heads, split, tokens_per_block, scale);

    for (int i = tid; i < heads * D; i += THREADS) {
        const int g = i / D, d = i % D;
        split_o[((size_t)(q0 + g) * splits + split) * D + d] = s.q[g][d];
    }
    if (tid < heads) {
        const size_t at = ((size_t)(q0 + tid) * splits + split) * 2;
        split_ml[at] = s.m[tid];
        split_ml[at + 1] = s.l[tid];
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
        s.last = last;
    }
    __syncthreads();
    if (!s.last) return;
    __threadfence();
    merge_heads(split_o, split_ml, splits, host, has_host, out, kv_heads * group, D, q0, heads, s.scratch, s.ml);
}

// Distributed shared memory (thread-block clusters, sm_90): the shared-window address of p,
// and that address in the block of rank `rank` of this block's cluster.
__device__ __forceinline__ unsigned int shared_address(const void* p) {
    unsigned int a;
    asm("{.reg .u64 t;\n\tcvta.to.shared.u64 t, %1;\n\tcvt.u32.u64 %0, t;\n\t}" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ unsigned int cluster_address(unsigned int a, int rank) {
    unsigned int r;
    asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
    return r;
}

// Stores to another block's shared memory (cluster addresses) that count their bytes on that
// block's mbarrier `bar` (a cluster address too): no fence, the barrier's phase completes once
// every byte it expects has landed.
__device__ __forceinline__ void send4(unsigned int to, const F4& v, unsigned int bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
                 :
                 : "r"(to), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(bar)
                 : "memory");
}

__device__ __forceinline__ void send2(unsigned int to, float x, float y, unsigned int bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];"
                 :
                 : "r"(to), "f"(x), "f"(y), "r"(bar)
                 : "memory");
}

// What the blocks of a cluster send each other to merge: every split's o of the items this
// block merges, o[k · splits + split] for its k-th item, and every split's (m, l) per q head.
// Then each warp's weights and (m, l) of the merge, per q head.
template <int D>
struct alignas(16) ClusterMerge {
    F4 o[GMAX * D / 4 + MAX_CLUSTER];
    float ml[GMAX][MAX_CLUSTER][2];
    float w[WARPS][GMAX][MAX_CLUSTER + 1];
    float merged[WARPS][GMAX][2];
    unsigned long long bar;
};

// attend and the merge in one launch of thread-block clusters: the window's splits of a
// (kv head, chunk of q heads) are one cluster (gridDim.x = splits <= MAX_CLUSTER blocks).
// Block `split` merges the 4-float items split, split + splits, ... of the chunk's o: each
// block sends its partial's slices of those items, and its (m, l), to the block that merges
// them, straight into that block's shared memory (st.async, counted on its mbarrier), and the
// merging block combines them with the host's partials exactly as merge_heads does (the same
// weights, sums and order). No partial goes through global memory, and no block waits for
// more than the bytes it merges; block 0 writes (m, l).
template <int D>
__device__ __forceinline__ void attend_cluster(const Vec16* __restrict__ keys, const Vec16* __restrict__ values,
                                               const float* __restrict__ q, int len, int kv_heads, int group,
                                               int tokens_per_block, float scale, const float* __restrict__ host,
                                               int has_host, float* __restrict__ out) {
    __shared__ Shared<D> s;
    __shared__ ClusterMerge<D> cm;
    constexpr int SLICES = D / 4;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int split = blockIdx.x, splits = gridDim.x;
    const int kvh = blockIdx.y;
    const int first = blockIdx.z * GMAX;
    const int heads = min(GMAX, group - first);
    const int q0 = kvh * group + first;
    const int q_heads = kv_heads * group;
    const size_t ms = (size_t)q_heads * D;  // where m starts in host and out; l follows
    const int items = heads * SLICES;

    // The barrier counts what the cluster sends here: 16 bytes per item of this block and
    // split, 8 per q head and split. Every block's barrier is set up before any block sends
    // (the cluster barrier below: arrived at here, waited for once the window is attended).
    const unsigned int bar = shared_address(&cm.bar);
    if (tid == 0) {
        const int mine = split < items ? (items - split + splits - 1) / splits : 0;
        const unsigned int bytes = (unsigned int)(splits * (16 * mine + 8 * heads));
        asm volatile(
            "mbarrier.init.shared::cta.b64 [%0], 1;\n\t"
            "fence.mbarrier_init.release.cluster;\n\t"
            "{.reg .b64 state;\n\tmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n\t}" ::"r"(bar),
            "r"(bytes)
            : "memory");
    }
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");

    // The host's part, loaded now so that it arrives while the window is attended.
    float host_m[GMAX], host_l[GMAX];
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
        host_m[g] = neg_inf();
        host_l[g] = 0.f;
        if (has_host && g < heads) {
            host_m[g] = host[ms + q0 + g];
            host_l[g] = host[ms + q_heads + q0 + g];
        }
    }
    const int e0 = split + splits * tid;
    F4 host_o{0.f, 0.f, 0.f, 0.f};
    if (has_host && e0 < items)
        host_o = *reinterpret_cast<const F4*>(host + (size_t)(q0 + e0 / SLICES) * D + 4 * (e0 % SLICES));

    attend_split<D>(s, keys, values, q, len, kv_heads, kvh, q0, heads, split, tokens_per_block, scale);
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");

    // Send this split's partial to the blocks that merge it.
    for (int e = tid; e < items; e += THREADS) {
        const int owner = e % splits, k = e / splits;
        const F4 v = *reinterpret_cast<const F4*>(&s.q[e / SLICES][4 * (e % SLICES)]);
        send4(cluster_address(shared_address(&cm.o[k * splits + split]), owner), v, cluster_address(bar, owner));
    }
    for (int i = tid; i < heads * splits; i += THREADS) {
        const int g = i / splits, owner = i % splits;
        send2(cluster_address(shared_address(&cm.ml[g][split][0]), owner), s.m[g], s.l[g],
              cluster_address(bar, owner));
    }
    // Wait for what the cluster sent here.
    for (unsigned int done = 0; !done;) {
        asm volatile(
            "{.reg .pred p;\n\tmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], 0;\n\t"
            "selp.u32 %0, 1, 0, p;\n\t}"
            : "=r"(done)
            : "r"(bar)
            : "memory");
    }

    // The weights, as merge_heads computes them, in every warp: part i in lane i.
    const int parts = splits + (has_host ? 1 : 0);
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
        if (g < heads) {
            float m = neg_inf(), l = 0.f;
            if (lane < splits) {
                m = cm.ml[g][lane][0];
                l = cm.ml[g][lane][1];
            } else if (lane < parts) {
                m = host_m[g];
                l = host_l[g];
            }
            const float mx = warp_max(l > 0.f ? fmaxf(neg_inf(), m) : neg_inf());
            const float w = l > 0.f ? expf(m - mx) * l : 0.f;
            if (lane < parts) cm.w[warp][g][lane] = w;
            const float sum = warp_sum(lane < parts ? w : 0.f);
            if (lane == 0) {
                cm.merged[warp][g][0] = mx;
                cm.merged[warp][g][1] = sum;
            }
        }
    }
    __syncwarp();

    for (int k = tid, e = e0; e < items; k += THREADS, e += splits * THREADS) {
        const int g = e / SLICES, c = e % SLICES, h = q0 + g;
        const float* w = cm.w[warp][g];
        F4 acc{0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < MAX_CLUSTER; ++j) {
            const float wj = j < splits ? w[j] : 0.f;
            // A part of weight 0 adds nothing, whatever its o.
            if (wj != 0.f) {
                const F4 x = cm.o[k * splits + j];
                acc.x = fmaf(wj, x.x, acc.x);
                acc.y = fmaf(wj, x.y, acc.y);
                acc.z = fmaf(wj, x.z, acc.z);
                acc.w = fmaf(wj, x.w, acc.w);
            }
        }
        if (has_host && w[splits] != 0.f) {
            const F4 y = e == e0 ? host_o : *reinterpret_cast<const F4*>(host + (size_t)h * D + 4 * c);
            acc.x = fmaf(w[splits], y.x, acc.x);
            acc.y = fmaf(w[splits], y.y, acc.y);
            acc.z = fmaf(w[splits], y.z, acc.z);
            acc.w = fmaf(w[splits], y.w, acc.w);
        }
        const float l = cm.merged[warp][g][1];
        const F4 r = l > 0.f ? F4{acc.x / l, acc.y / l, acc.z / l, acc.w / l} : F4{0.f, 0.f, 0.f, 0.f};
        *reinterpret_cast<F4*>(out + (size_t)h * D + 4 * c) = r;
    }
    if (split == 0 && tid < heads) {
        const float l = cm.merged[0][tid][1];
        out[ms + q0 + tid] = l > 0.f ? cm.merged[0][tid][0] : neg_inf();
        out[ms + q_heads + q0 + tid] = l;
    }
}

#define ATTEND(D)                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                     \
        attend_d##D(const Vec16* __restrict__ keys, const Vec16* __restrict__ values,                       \
                    const float* __restrict__ q, float* __restrict__ split_o, float* __restrict__ split_ml, \
                    int len, int kv_heads, int group, int tokens_per_block, float scale, int fused,           \
                    const float* __restrict__ host, int has_host, float* __restrict__ out,                   \
                    unsigned int* __restrict__ done) {                                                        \
        attend<D>(keys, values, q, split_o, split_ml, len, kv_heads, group, tokens_per_block, scale, fused,    \
                  host, has_host, out, done);                                                                 \
    }

#define ATTEND_CLUSTER(D)                                                                                  \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                  \
        attend_cluster_d##D(const Vec16* __restrict__ keys, const Vec16* __restrict__ values,            \
                            const float* __restrict__ q, int len, int kv_heads, int group,                \
                            int tokens_per_block, float scale, const float* __restrict__ host, int has_host, \
                            float* __restrict__ out) {                                                     \
        attend_cluster<D>(keys, values, q, len, kv_heads, group, tokens_per_block, scale, host, has_host, out); \
    }

ATTEND(64)
ATTEND(80)
ATTEND(96)
ATTEND(128)
ATTEND(256)
ATTEND_CLUSTER(64)
ATTEND_CLUSTER(80)
ATTEND_CLUSTER(96)
ATTEND_CLUSTER(128)
ATTEND_CLUSTER(256)

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

// ---------------------------------------------------------------------------------------------
// The exact kNN of the index build (knn.rs): every query's k keys of largest inner product.

#define KNN_THREADS 256 // threads per block of both kNN kernels
#define KNN_TILE 64     // queries and keys of a knn_scores block: 16 × 16 threads of 4 × 4
#define KNN_CHUNK 32    // dimensions staged in shared memory at a time

__device__ __forceinline__ float half_to_float(unsigned short bits) {
    float f;
    asm("{.reg .f16 h;\n\t"
        "mov.b16 h, %1;\n\t"
        "cvt.f32.f16 %0, h;\n\t}"
        : "=f"(f)
        : "h"(bits));
    return f;
}

// scores[q][key] = queries[q] · keys[key] for q < m, key < n: keys [n][dim] f16, queries
// [m][dim] f32, scores [m][n]. Each score is one chain of fused multiply-adds from dimension
// 0 up, starting at +0 (f32::mul_add in that order gives the same bits). Grid (n / 64, m / 64).
extern "C" __global__ void __launch_bounds__(KNN_THREADS)
    knn_scores(const unsigned short* __restrict__ keys, int n, int dim, const float* __restrict__ queries, int m,
               float* __restrict__ scores) {
    // Dimension-major, padded by one: the staging stores (consecutive dimensions of a row
    // across the warp) fall in distinct banks.
    __shared__ float qs[KNN_CHUNK][KNN_TILE + 1];
    __shared__ float ks[KNN_CHUNK][KNN_TILE + 1];
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int k0 = blockIdx.x * KNN_TILE, q0 = blockIdx.y * KNN_TILE;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
    for (int j0 = 0; j0 < dim; j0 += KNN_CHUNK) {
        for (int e = threadIdx.x; e < KNN_TILE * KNN_CHUNK; e += KNN_THREADS) {
            const int r = e / KNN_CHUNK, c = e % KNN_CHUNK, j = j0 + c;
            const int q = q0 + r, key = k0 + r;
            qs[c][r] = q < m && j < dim ? queries[(size_t)q * dim + j] : 0.f;
            ks[c][r] = key < n && j < dim ? half_to_float(keys[(size_t)key * dim + j]) : 0.f;
        }
        __syncthreads();
        // Only the real dimensions: adding a padded 0 would turn a -0 sum into +0.
        const int chunk = min(KNN_CHUNK, dim - j0);
        for (int c = 0; c < chunk; ++c) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                a[i] = qs[c][ty + 16 * i];
                b[i] = ks[c][tx + 16 * i];
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int q = q0 + ty + 16 * i;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int key = k0 + tx + 16 * j;
            if (q < m && key < n) scores[(size_t)q * n + key] = acc[i][j];
        }
    }
}

// An f32's bits as an unsigned integer of the same order as f32::total_cmp.
__device__ __forceinline__ unsigned int total_order(float f) {
    const unsigned int u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// One block per row of scores ([rows][n]): the row's k best (1 <= k <= n) into ids and best
// ([rows][k]), unordered, the ties at the k-th score resolved to the lowest ids. The k-th
// score is found by a radix select on its total_order bits, a byte at a time from the top
// (a histogram per warp, so that equal bytes contend within a warp only); then every id above
// it is written, then the lowest ids equal to it, in id order, until k are.
extern "C" __global__ void __launch_bounds__(KNN_THREADS)
    knn_select(const float* __restrict__ scores, int n, int k, unsigned int* __restrict__ ids,
               float* __restrict__ best) {
    constexpr int warps = KNN_THREADS / 32;
    __shared__ unsigned int hist[warps][256];
    __shared__ unsigned int chosen_prefix, chosen_remaining, written;
    __shared__ unsigned int warp_ties[warps];
    const float* row = scores + (size_t)blockIdx.x * n;
    unsigned int* out_ids = ids + (size_t)blockIdx.x * k;
    float* out_best = best + (size_t)blockIdx.x * k;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    // The k-th largest: `prefix` holds its bytes found so far (those under `mask`), and
    // `remaining` how many of the best k share them.
    unsigned int prefix = 0, mask = 0, remaining = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < warps * 256; i += KNN_THREADS) (&hist[0][0])[i] = 0;
        __syncthreads();
        for (int i = tid; i < n; i += KNN_THREADS) {
            const unsigned int u = total_order(row[i]);
            if ((u & mask) == prefix) atomicAdd(&hist[warp][(u >> shift) & 255u], 1u);
        }
        __syncthreads();
        // KNN_THREADS >= 256: a thread per byte value sums the warps' counts.
        if (tid < 256) {
            unsigned int sum = 0;
#pragma unroll
            for (int w = 0; w < warps; ++w) sum += hist[w][tid];
            hist[0][tid] = sum;
        }
        __syncthreads();
        if (tid == 0) {
            unsigned int above = 0;
            int b = 255;
            for (; b > 0 && above + hist[0][b] < remaining; --b) above += hist[0][b];
            chosen_prefix = prefix | ((unsigned int)b << shift);
            chosen_remaining = remaining - above;
        }
        __syncthreads();
        prefix = chosen_prefix;
        remaining = chosen_remaining;
        mask |= 255u << shift;
    }

    // Every score above the k-th: k - remaining of them.
    if (tid == 0) written = 0;
    __syncthreads();
    for (int i = tid; i < n; i += KNN_THREADS) {
        const float s = row[i];
        if (total_order(s) > prefix) {
            const unsigned int at = atomicAdd(&written, 1u);
            out_ids[at] = i;
            out_best[at] = s;
        }
    }
    // Then `remaining` ties, the lowest ids first: a block-wide count of the ties before each
    // thread, chunk by chunk in id order.
    const unsigned int greater = k - remaining;
    unsigned int filled = 0;
    for (int base = 0; base < n && filled < remaining; base += KNN_THREADS) {
        const int i = base + tid;
        const bool tie = i < n && total_order(row[i]) == prefix;
        const unsigned int ballot = __ballot_sync(0xffffffffu, tie);
        if (lane == 0) warp_ties[warp] = __popc(ballot);
        __syncthreads();
        unsigned int before = filled + __popc(ballot & ((1u << lane) - 1u)), chunk = 0;
        for (int w = 0; w < warps; ++w) {
            if (w < warp) before += warp_ties[w];
            chunk += warp_ties[w];
        }
        if (tie && before < remaining) {
            out_ids[greater + before] = i;
            out_best[greater + before] = row[i];
        }
        __syncthreads();
        filled += chunk;
    }
}

// ---------------------------------------------------------------------------------------------
// The PQ scan of a context's codes held on the device (codes.rs): every token's approximate
// score for each query of a GQA group.

#define PQ_THREADS 256   // threads per pq_scan block
#define PQ_TOKENS 1024   // tokens per pq_scan block: its table is loaded once for them
#define PQ_TABLE 256     // entries of a subspace's table, one byte each

// scores[q][t] = bias[q] + step[q] · Σ_j luts[q][j][code(t, j)] for t < lim, the byte sums
// exact integers and the score rounded as the CPU rounds it (a product, then a sum, no fused
// multiply-add): the same bits as ctxfs_kernels::pq_scores. codes: blocks of per_block tokens
// (the last one tokens - b·per_block), each subspace-major (token u's code in subspace j at
// byte j·r + u of its block). Grid (lim / 1024, queries); m·256 bytes of dynamic shared
// memory hold the query's tables.
extern "C" __global__ void __launch_bounds__(PQ_THREADS)
    pq_scan(const unsigned char* __restrict__ codes, int tokens, int per_block, int m,
            const unsigned int* __restrict__ luts, const float* __restrict__ bias,
            const float* __restrict__ step, int lim, float* __restrict__ scores) {
    extern __shared__ unsigned int table_words[];
    const unsigned char* table = reinterpret_cast<const unsigned char*>(table_words);
    const int q = blockIdx.y;
    const unsigned int* lut = luts + (size_t)q * m * (PQ_TABLE / 4);
    for (int i = threadIdx.x; i < m * (PQ_TABLE / 4); i += PQ_THREADS) table_words[i] = lut[i];
    __syncthreads();
    const int end = min(lim, (int)(blockIdx.x + 1) * PQ_TOKENS);
    for (int t = blockIdx.x * PQ_TOKENS + threadIdx.x; t < end; t += PQ_THREADS) {
        const int b = t / per_block, u = t - b * per_block;
        const int r = min(per_block, tokens - b * per_block);
        const unsigned char* c = codes + (size_t)b * per_block * m + u;
        unsigned int sum = 0;
        for (int j = 0; j < m; ++j) sum += table[j * PQ_TABLE + c[(size_t)j * r]];
        scores[(size_t)q * lim + t] = __fadd_rn(bias[q], __fmul_rn(step[q], (float)sum));
    }
}

// samples[q][j] = scores[q][j·stride] for j < count = ⌈lim / stride⌉: every stride-th score
// of each query's row of lim ([queries][lim]). Grid (⌈count / 256⌉, queries).
extern "C" __global__ void __launch_bounds__(PQ_THREADS)
    pq_sample(const float* __restrict__ scores, int lim, int stride, int count, float* __restrict__ samples) {
    const int q = blockIdx.y, j = blockIdx.x * PQ_THREADS + threadIdx.x;
    if (j < count) samples[(size_t)q * count + j] = scores[(size_t)q * lim + (size_t)j * stride];
}

// Each query's tokens t < lim whose score reaches cuts[q] (in f32::total_cmp's order): reached[q]
// counts them all (it must be zero before), and the first cap of them to be found are written
// to ids and kept ([queries][cap]), in no order. A warp takes one atomic slot range for its
// hits. Grid (⌈lim / 1024⌉, queries).
extern "C" __global__ void __launch_bounds__(PQ_THREADS)
    pq_reaching(const float* __restrict__ scores, int lim, const float* __restrict__ cuts, int cap,
                unsigned int* __restrict__ reached, unsigned int* __restrict__ ids, float* __restrict__ kept) {
    const int q = blockIdx.y, lane = threadIdx.x & 31;
    const unsigned int cut = total_order(cuts[q]);
    const float* row = scores + (size_t)q * lim;
    const int end = min(lim, (int)(blockIdx.x + 1) * PQ_TOKENS);
    // Every thread of a warp takes each pass (the ballot needs them all).
    for (int base = blockIdx.x * PQ_TOKENS; base < end; base += PQ_THREADS) {
        const int t = base + threadIdx.x;
        const float s = t < end ? row[t] : 0.f;
        const bool hit = t < end && total_order(s) >= cut;
        const unsigned int ballot = __ballot_sync(0xffffffffu, hit);
        if (ballot == 0) continue;
        unsigned int first = 0;
        if (lane == 0) first = atomicAdd(&reached[q], (unsigned int)__popc(ballot));
        first = __shfl_sync(0xffffffffu, first, 0);
        if (hit) {
            const unsigned int at = first + __popc(ballot & ((1u << lane) - 1u));
            if (at < (unsigned int)cap) {
                ids[(size_t)q * cap + at] = (unsigned int)t;
                kept[(size_t)q * cap + at] = s;
            }
        }
    }
}
