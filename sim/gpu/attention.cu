// Decode attention over bf16 K/V of one layer, grouped-query (4 query heads
// a KV head, head dim 128), written the way FlashAttention's and FlashInfer's
// decode kernels are: memory-bound, split-KV across CTAs, 16-byte vector
// loads, several keys in flight per warp, the block table read once per
// 16-token tile. Five addressings, one implementation: only the place of a
// tile differs.
//
//   dense           one buffer [batch][context][kv_head][dim] per K and V.
//   paged           vLLM's pool: K and V caches of [block][16][kv_head][dim],
//                   a request's blocks through a block table.
//   block_in_chunk  the arena's layer-major chunks: a request's chunks through
//                   a block table (chunk numbers), each chunk holding
//                   `block_tokens` tokens of every layer as
//                   [layer][K|V][token][kv_head][dim]; the block stride is the chunk.
//   token_major     per-request allocations at shuffled offsets, a token's KV
//                   of every layer together: this layer's K of token t at
//                   req_base[b] + layer_offset + t * token_stride, V v_offset after.
//   per_layer       one allocation per request and per K/V of this layer, at
//                   shuffled offsets: K of (b, t) at k + req_base[b] + t * token_stride.
//
// A launch covers `queries` query tokens per request, the last ones of a
// context of `context` tokens (causal). Grid (batch, kv_heads, queries *
// splits): each CTA covers one split of the keys for the 4 query heads of
// one KV head; its 4 warps take 16-token tiles in turn; in a warp each half
// (16 lanes x 16 bytes = one 256-byte key row) walks 8 keys of the tile with
// all 16 loads (8 K, 8 V) issued before the math. Each CTA writes a partial
// softmax (max, sum, weighted V); `attention_reduce` merges the splits.
// Compiled by NVRTC (sim/gpu/build_ptx.py) with no headers: bf16 is handled
// as its bits.

#define HEAD_DIM 128
#define GROUP 4          // query heads per KV head (Llama-3-8B: 32 / 8)
#define VEC 8            // bf16 per 16-byte load
#define HALF 16          // lanes per key row (HEAD_DIM / VEC)
#define TILE 16          // keys per tile; a block holds a multiple of it
#define KEYS_PER_HALF 8  // TILE / 2
#define WARPS 4
#define PARTS (WARPS * 2)

enum Mode { DENSE = 0, PAGED = 1, BLOCK_IN_CHUNK = 2, TOKEN_MAJOR = 3, PER_LAYER = 4 };
// Kernel variants for the measurement's own checks: FAST is the kernel;
// SLOW reads the block table and scalar 2-byte values for every key (a
// deliberately slow kernel the bandwidth rule must reject); BROKEN leaves out
// the last key (a wrong kernel the verification must reject).
enum Variant { FAST = 0, SLOW = 1, BROKEN = 2 };

struct Kv {
    const unsigned short *k;      // K base (token_major, block_in_chunk: the whole buffer)
    const unsigned short *v;      // V base (dense, paged, per_layer)
    const int *block_table;       // paged, block_in_chunk: [batch][max_blocks]
    const long long *req_base;    // token_major, per_layer: element offset of each request
    long long block_stride;       // paged, block_in_chunk: elements between block numbers
    long long token_stride;       // elements between consecutive tokens inside a tile
    long long layer_offset;       // block_in_chunk: this layer's K in a chunk; token_major: in a token
    long long v_offset;           // block_in_chunk, token_major: elements from a token's K to its V
    long long batch_stride;       // dense: elements between requests
    int block_tokens;             // paged, block_in_chunk: tokens per block (a multiple of TILE)
    int max_blocks;               // paged, block_in_chunk: block table row length
};

// Element offsets of token t0's K and V (t0 a multiple of TILE for FAST).
template <int MODE>
__device__ __forceinline__ void tile_base(const Kv &kv, int b, int t0, long long *ko, long long *vo) {
    if (MODE == DENSE) {
        *ko = (long long)b * kv.batch_stride + (long long)t0 * kv.token_stride;
        *vo = *ko;
    } else if (MODE == PAGED || MODE == BLOCK_IN_CHUNK) {
        long long block = kv.block_table[(long long)b * kv.max_blocks + t0 / kv.block_tokens];
        long long off = block * kv.block_stride + (long long)(t0 % kv.block_tokens) * kv.token_stride;
        if (MODE == BLOCK_IN_CHUNK) {
            off += kv.layer_offset;
            *ko = off;
            *vo = off + kv.v_offset;
        } else {
            *ko = off;
            *vo = off;
        }
    } else if (MODE == TOKEN_MAJOR) {
        long long off = kv.req_base[b] + kv.layer_offset + (long long)t0 * kv.token_stride;
        *ko = off;
        *vo = off + kv.v_offset;
    } else {
        long long off = kv.req_base[b] + (long long)t0 * kv.token_stride;
        *ko = off;
        *vo = off;
    }
}

template <int MODE>
__device__ __forceinline__ const unsigned short *v_base(const Kv &kv) {
    return (MODE == BLOCK_IN_CHUNK || MODE == TOKEN_MAJOR) ? kv.k : kv.v;
}

__device__ __forceinline__ void unpack(uint4 w, float *f) {
    f[0] = __uint_as_float(w.x << 16); f[1] = __uint_as_float(w.x & 0xffff0000u);
    f[2] = __uint_as_float(w.y << 16); f[3] = __uint_as_float(w.y & 0xffff0000u);
    f[4] = __uint_as_float(w.z << 16); f[5] = __uint_as_float(w.z & 0xffff0000u);
    f[6] = __uint_as_float(w.w << 16); f[7] = __uint_as_float(w.w & 0xffff0000u);
}

// 8 bf16 at p, read as scalars (the SLOW variant).
__device__ __forceinline__ uint4 load_scalar(const unsigned short *p) {
    uint4 w;
    w.x = (unsigned)p[0] | ((unsigned)p[1] << 16);
    w.y = (unsigned)p[2] | ((unsigned)p[3] << 16);
    w.z = (unsigned)p[4] | ((unsigned)p[5] << 16);
    w.w = (unsigned)p[6] | ((unsigned)p[7] << 16);
    return w;
}

// q: [batch][queries][heads][HEAD_DIM] float. Partials per (request, query,
// query head, split): part_ml [..][2] (max, sum), part_acc [..][HEAD_DIM].
template <int MODE, int VARIANT>
__device__ void attention(const float *q, float *part_ml, float *part_acc, Kv kv, int kv_heads,
                          int context, int queries, int splits, float scale) {
    const int b = blockIdx.x, kvh = blockIdx.y;
    const int qi = blockIdx.z / splits, split = blockIdx.z % splits;
    const int heads = kv_heads * GROUP;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int half = lane / HALF, hl = lane % HALF;
    int keys = context - queries + qi + 1;  // causal
    if (VARIANT == BROKEN) keys -= 1;
    // Every query of the launch splits the same tile range, so that the
    // splits of one query line up with the partial slots.
    const int tiles = (context + TILE - 1) / TILE;
    const int per_split = (tiles + splits - 1) / splits;
    const int tile_lo = split * per_split;
    int tile_hi = tile_lo + per_split;
    const int key_tiles = (keys + TILE - 1) / TILE;
    if (tile_hi > key_tiles) tile_hi = key_tiles;

    float qv[GROUP][VEC], acc[GROUP][VEC], m[GROUP], l[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
        const float *qp = q + (((long long)b * queries + qi) * heads + kvh * GROUP + g) * HEAD_DIM + hl * VEC;
#pragma unroll
        for (int i = 0; i < VEC; i++) {
            qv[g][i] = qp[i] * scale;
            acc[g][i] = 0.f;
        }
        m[g] = -1e30f;
        l[g] = 0.f;
    }
    const long long head = (long long)kvh * HEAD_DIM + hl * VEC;
    const unsigned short *vb = v_base<MODE>(kv);
    for (int tile = tile_lo + warp; tile < tile_hi; tile += WARPS) {
        const int t0 = tile * TILE;
        uint4 kw[KEYS_PER_HALF], vw[KEYS_PER_HALF];
        long long ko, vo;
        if (VARIANT != SLOW) tile_base<MODE>(kv, b, t0, &ko, &vo);
#pragma unroll
        for (int i = 0; i < KEYS_PER_HALF; i++) {
            const int t = t0 + 2 * i + half;
            if (t < keys) {
                if (VARIANT == SLOW) {
                    tile_base<MODE>(kv, b, t - t % TILE, &ko, &vo);
                    const long long in = (long long)(t % TILE) * kv.token_stride + head;
                    kw[i] = load_scalar(kv.k + ko + in);
                    vw[i] = load_scalar(vb + vo + in);
                } else {
                    const long long in = (long long)(2 * i + half) * kv.token_stride + head;
                    kw[i] = *reinterpret_cast<const uint4 *>(kv.k + ko + in);
                    vw[i] = *reinterpret_cast<const uint4 *>(vb + vo + in);
                }
            } else {
                kw[i] = make_uint4(0, 0, 0, 0);
                vw[i] = make_uint4(0, 0, 0, 0);
            }
        }
        float s[GROUP][KEYS_PER_HALF];
#pragma unroll
        for (int i = 0; i < KEYS_PER_HALF; i++) {
            float kf[VEC];
            unpack(kw[i], kf);
#pragma unroll
            for (int g = 0; g < GROUP; g++) {
                float d = 0.f;
#pragma unroll
                for (int j = 0; j < VEC; j++) d += qv[g][j] * kf[j];
                // Sum over the 16 lanes of this half (xor stays inside it).
#pragma unroll
                for (int o = HALF / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
                s[g][i] = (t0 + 2 * i + half < keys) ? d : -1e30f;
            }
        }
#pragma unroll
        for (int g = 0; g < GROUP; g++) {
            float mt = m[g];
#pragma unroll
            for (int i = 0; i < KEYS_PER_HALF; i++) mt = fmaxf(mt, s[g][i]);
            const float c = __expf(m[g] - mt);
            l[g] *= c;
#pragma unroll
            for (int j = 0; j < VEC; j++) acc[g][j] *= c;
            m[g] = mt;
        }
#pragma unroll
        for (int i = 0; i < KEYS_PER_HALF; i++) {
            float vf[VEC];
            unpack(vw[i], vf);
#pragma unroll
            for (int g = 0; g < GROUP; g++) {
                const float p = __expf(s[g][i] - m[g]);
                l[g] += p;
#pragma unroll
                for (int j = 0; j < VEC; j++) acc[g][j] += p * vf[j];
            }
        }
    }
    // Merge the 8 half-warps' partial softmaxes into the CTA's.
    __shared__ float sm[PARTS][GROUP], sl[PARTS][GROUP];
    __shared__ float sacc[PARTS][GROUP][HEAD_DIM];
    const int part = warp * 2 + half;
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
        if (hl == 0) {
            sm[part][g] = m[g];
            sl[part][g] = l[g];
        }
#pragma unroll
        for (int j = 0; j < VEC; j++) sacc[part][g][hl * VEC + j] = acc[g][j];
    }
    __syncthreads();
    for (int x = threadIdx.x; x < GROUP * HEAD_DIM; x += blockDim.x) {
        const int g = x / HEAD_DIM, d = x % HEAD_DIM;
        float mx = -1e30f;
        for (int p = 0; p < PARTS; p++) mx = fmaxf(mx, sm[p][g]);
        float num = 0.f, den = 0.f;
        for (int p = 0; p < PARTS; p++) {
            const float c = __expf(sm[p][g] - mx);
            num += sacc[p][g][d] * c;
            den += sl[p][g] * c;
        }
        const long long slot = (((long long)b * queries + qi) * heads + kvh * GROUP + g) * splits + split;
        part_acc[slot * HEAD_DIM + d] = num;
        if (d == 0) {
            part_ml[slot * 2] = mx;
            part_ml[slot * 2 + 1] = den;
        }
    }
}

// Merges the splits: out [batch][queries][heads][HEAD_DIM]. Grid: one CTA
// per (request, query, head); HEAD_DIM threads.
extern "C" __global__ void __launch_bounds__(HEAD_DIM)
attention_reduce(const float *part_ml, const float *part_acc, float *out, int splits) {
    const long long row = blockIdx.x;
    const int d = threadIdx.x;
    float mx = -1e30f;
    for (int s = 0; s < splits; s++) mx = fmaxf(mx, part_ml[(row * splits + s) * 2]);
    float num = 0.f, den = 0.f;
    for (int s = 0; s < splits; s++) {
        const long long slot = row * splits + s;
        const float c = __expf(part_ml[slot * 2] - mx);
        num += part_acc[slot * HEAD_DIM + d] * c;
        den += part_ml[slot * 2 + 1] * c;
    }
    out[row * HEAD_DIM + d] = num / den;
}

#define KERNEL(NAME, MODE, VARIANT)                                                                   \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                          \
    NAME(const float *q, float *part_ml, float *part_acc, Kv kv, int kv_heads, int context,           \
         int queries, int splits, float scale) {                                                      \
        attention<MODE, VARIANT>(q, part_ml, part_acc, kv, kv_heads, context, queries, splits, scale); \
    }

KERNEL(attention_dense, DENSE, FAST)
KERNEL(attention_paged, PAGED, FAST)
KERNEL(attention_block_in_chunk, BLOCK_IN_CHUNK, FAST)
KERNEL(attention_token_major, TOKEN_MAJOR, FAST)
KERNEL(attention_per_layer, PER_LAYER, FAST)
KERNEL(attention_paged_slow, PAGED, SLOW)
KERNEL(attention_paged_broken, PAGED, BROKEN)
