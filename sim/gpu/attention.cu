// One layer of attention over bf16 K/V, grouped-query, with three ways of
// finding a token's K/V: only the addressing differs between them.
//
//   paged        vLLM's pool: per layer, K and V caches of [block][16][kv_head][dim],
//                a request's blocks through a block table (16-token blocks).
//   token_major  per-request allocations at arbitrary offsets, a token's KV of
//                every layer together: this layer's K of token t at
//                base[b] + t * token_stride + layer_offset, its V kv_heads * dim after.
//   per_layer    one allocation per layer and per K/V, requests at a uniform
//                batch stride: K of (b, t) at b * batch_stride + t * kv_heads * dim.
//
// A launch covers `queries` query tokens per request, the last ones of a
// context of `context` tokens (causal): queries = 1 is a decode step, more is
// a prefill-shaped launch (a chunk over the tokens before it). Grid
// (batch, kv_heads, queries); block = WARPS warps; each warp walks a strided
// share of the keys with an online softmax for the group's query heads, lanes
// splitting head_dim (128: 4 values a lane); the warps combine at the end.
// Compiled by NVRTC (sim/gpu/build_ptx.py) with no headers: bf16 is handled
// as its bits.

#define HEAD_DIM 128
#define PER_LANE (HEAD_DIM / 32)
#define MAX_GROUP 8
#define WARPS 4
#define BLOCK_TOKENS 16

enum Mode { PAGED = 0, TOKEN_MAJOR = 1, PER_LAYER = 2 };

struct Kv {
    const unsigned short *k;      // paged: K cache; token_major: the whole buffer; per_layer: K allocation
    const unsigned short *v;      // paged: V cache; per_layer: V allocation; token_major: unused
    const int *block_table;       // paged: [batch][max_blocks]
    const long long *req_base;    // token_major: element offset of each request's allocation
    long long token_stride;       // token_major: elements between tokens (all layers' K and V)
    long long layer_offset;       // token_major: this layer's K within a token
    long long batch_stride;       // per_layer: elements between requests
    int max_blocks;               // paged
};

__device__ __forceinline__ float bf16_to_float(unsigned short x) {
    return __uint_as_float(((unsigned int)x) << 16);
}

template <int MODE>
__device__ __forceinline__ void kv_address(const Kv &kv, int b, int t, int kvh, int kv_heads,
                                           const unsigned short **k, const unsigned short **v) {
    long long head = (long long)kvh * HEAD_DIM;
    if (MODE == PAGED) {
        long long block = kv.block_table[(long long)b * kv.max_blocks + t / BLOCK_TOKENS];
        long long off = (block * BLOCK_TOKENS + t % BLOCK_TOKENS) * kv_heads * HEAD_DIM + head;
        *k = kv.k + off;
        *v = kv.v + off;
    } else if (MODE == TOKEN_MAJOR) {
        long long off = kv.req_base[b] + (long long)t * kv.token_stride + kv.layer_offset + head;
        *k = kv.k + off;
        *v = kv.k + off + (long long)kv_heads * HEAD_DIM;
    } else {
        long long off = (long long)b * kv.batch_stride + (long long)t * kv_heads * HEAD_DIM + head;
        *k = kv.k + off;
        *v = kv.v + off;
    }
}

// q: [batch][queries][heads][HEAD_DIM] float; out the same.
template <int MODE>
__device__ void attention(const float *q, float *out, Kv kv, int heads, int kv_heads, int context,
                          int queries, float scale) {
    const int b = blockIdx.x, kvh = blockIdx.y, qi = blockIdx.z;
    const int group = heads / kv_heads;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int keys = context - queries + qi + 1;  // causal
    float qv[MAX_GROUP][PER_LANE], acc[MAX_GROUP][PER_LANE], m[MAX_GROUP], l[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        const float *qp = q + (((long long)b * queries + qi) * heads + kvh * group + g) * HEAD_DIM;
        for (int i = 0; i < PER_LANE; i++) {
            qv[g][i] = qp[lane * PER_LANE + i] * scale;
            acc[g][i] = 0.f;
        }
        m[g] = -1e30f;
        l[g] = 0.f;
    }
    for (int t = warp; t < keys; t += WARPS) {
        const unsigned short *kp, *vp;
        kv_address<MODE>(kv, b, t, kvh, kv_heads, &kp, &vp);
        float kf[PER_LANE], vf[PER_LANE];
        // 4 bf16 a lane: one 8-byte load each of K and V.
        uint2 kw = *reinterpret_cast<const uint2 *>(kp + lane * PER_LANE);
        uint2 vw = *reinterpret_cast<const uint2 *>(vp + lane * PER_LANE);
        kf[0] = __uint_as_float(kw.x << 16); kf[1] = __uint_as_float(kw.x & 0xffff0000u);
        kf[2] = __uint_as_float(kw.y << 16); kf[3] = __uint_as_float(kw.y & 0xffff0000u);
        vf[0] = __uint_as_float(vw.x << 16); vf[1] = __uint_as_float(vw.x & 0xffff0000u);
        vf[2] = __uint_as_float(vw.y << 16); vf[3] = __uint_as_float(vw.y & 0xffff0000u);
        for (int g = 0; g < group; g++) {
            float s = 0.f;
            for (int i = 0; i < PER_LANE; i++) s += qv[g][i] * kf[i];
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            float mn = fmaxf(m[g], s);
            float c = __expf(m[g] - mn), p = __expf(s - mn);
            l[g] = l[g] * c + p;
            for (int i = 0; i < PER_LANE; i++) acc[g][i] = acc[g][i] * c + p * vf[i];
            m[g] = mn;
        }
    }
    // Combine the warps' partial softmaxes.
    __shared__ float sm[WARPS][MAX_GROUP], sl[WARPS][MAX_GROUP];
    __shared__ float sacc[WARPS][MAX_GROUP][HEAD_DIM];
    for (int g = 0; g < group; g++) {
        if (lane == 0) {
            sm[warp][g] = m[g];
            sl[warp][g] = l[g];
        }
        for (int i = 0; i < PER_LANE; i++) sacc[warp][g][lane * PER_LANE + i] = acc[g][i];
    }
    __syncthreads();
    for (int x = threadIdx.x; x < group * HEAD_DIM; x += blockDim.x) {
        int g = x / HEAD_DIM, d = x % HEAD_DIM;
        float mx = -1e30f;
        for (int w = 0; w < WARPS; w++) mx = fmaxf(mx, sm[w][g]);
        float num = 0.f, den = 0.f;
        for (int w = 0; w < WARPS; w++) {
            float c = __expf(sm[w][g] - mx);
            num += sacc[w][g][d] * c;
            den += sl[w][g] * c;
        }
        out[(((long long)b * queries + qi) * heads + kvh * group + g) * HEAD_DIM + d] = num / den;
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
attention_paged(const float *q, float *out, Kv kv, int heads, int kv_heads, int context, int queries, float scale) {
    attention<PAGED>(q, out, kv, heads, kv_heads, context, queries, scale);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
attention_token_major(const float *q, float *out, Kv kv, int heads, int kv_heads, int context, int queries,
                      float scale) {
    attention<TOKEN_MAJOR>(q, out, kv, heads, kv_heads, context, queries, scale);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
attention_per_layer(const float *q, float *out, Kv kv, int heads, int kv_heads, int context, int queries,
                    float scale) {
    attention<PER_LAYER>(q, out, kv, heads, kv_heads, context, queries, scale);
}
