// Decode attention on the CPU: one query per sequence over its paged KV, read in place.
//
// The torch path (`heron.core.ops.attention`) first gathers every sequence's blocks into one
// tensor, then attends: the context crosses memory three times and small-M matmuls run far
// below the machine's rate. Here each task walks its keys' blocks straight from the cache,
// scores every query head against a key while its row is in L1, and prefetches the next
// block's row as it goes.
//
// Layout: q, out [B, H * G, D] (query heads grouped by KV head); k_cache, v_cache
// [num_blocks, block_size, H, D]; block_tables [B, table_stride] int32; seq_lens [B] int32.
// All contiguous; q and out float32, the caches float32, or bfloat16 with CACHE_BF16
// defined (widened to float32 as they load: all arithmetic is float32). D is HEAD_DIM (a
// multiple of 16), fixed at compile time.
//
// A task is one sequence's keys [k0, k1): a two-pass softmax over them (scores, then
// weighted values), leaving its max logit, sum of exponentials and unnormalized output per
// head; a second loop merges a sequence's tasks. Long contexts with few sequences split into
// several tasks so every thread has work.
//
// Built with OpenMP where the compiler has it: in a process that imported torch, the
// libgomp.so.1 torch loaded is the one this library binds to, so both share one thread pool
// and torch.set_num_threads governs both.

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#ifndef HEAD_DIM
#error "HEAD_DIM must be defined"
#endif
static_assert(HEAD_DIM % 16 == 0, "HEAD_DIM must be a multiple of 16");

namespace {

constexpr int D = HEAD_DIM;
constexpr int NV = D / 16;  // vectors per head row

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

inline v16 load(const float *p) { return *reinterpret_cast<const v16u *>(p); }
inline void store(float *p, v16 x) { *reinterpret_cast<v16u *>(p) = x; }

#ifdef CACHE_BF16
typedef uint16_t cache_t;  // bfloat16: a float32's upper half
typedef uint16_t v16h __attribute__((vector_size(32), aligned(2), may_alias));
inline v16 load_cache(const cache_t *p)
{
    v16i wide = __builtin_convertvector(*reinterpret_cast<const v16h *>(p), v16i) << 16;
    return (v16)wide;
}
#else
typedef float cache_t;
inline v16 load_cache(const cache_t *p) { return load(p); }
#endif
constexpr int LINE = 64 / sizeof(cache_t);  // cache elements a cache line holds

inline float hsum(v16 x)
{
    v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7)
         + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

// exp for x <= 0 (logits minus their max), relative error ~2e-7: x = k ln2 + r with
// |r| <= ln2 / 2, exp(r) by Cephes' expf polynomial, 2^k through the exponent bits.
// Below -87 it returns exp(-87) ~ 2e-38 rather than 0, which no sum of weights can notice.
inline v16 vexp(v16 x)
{
    const v16 lo = v16{} - 87.0f;
    x = x < lo ? lo : x;
    const v16 shifter = v16{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
    v16 k = (x * 1.44269504088896341f + shifter) - shifter;
    v16 r = x - k * 0.693359375f + k * 2.12194440e-4f;
    v16 p = v16{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    v16i bits = (__builtin_convertvector(k, v16i) + 127) << 23;
    return p * (v16)bits;  // a vector cast keeps the bits
}

struct Sequence {
    const float *q;         // [Hq, D]
    const int32_t *table;   // its block ids
};

// Calls visit(j, r) for each key j in [k0, k1) of a sequence whose blocks are `table`, r
// the key's [H, D] row of `cache`: a block at a time, prefetching the next block's rows.
template <typename Visit>
inline void for_each_key(const cache_t *cache, const int32_t *table, int k0, int k1, int bs,
                         int row, Visit visit)
{
    for (int t = k0; t < k1;) {
        const int off = t % bs, end = t - off + bs < k1 ? t - off + bs : k1;
        const cache_t *r = cache + ((int64_t)table[t / bs] * bs + off) * row;
        const cache_t *next = end < k1 ? cache + (int64_t)table[t / bs + 1] * bs * row : r;
        for (int j = t; j < end; ++j, r += row, next += row) {
            for (int c = 0; c < row; c += LINE) __builtin_prefetch(next + c);
            visit(j, r);
        }
        t = end;
    }
}

// Keys [k0, k1) of one sequence. s: Hq rows of `stride` floats of scratch. Writes acc
// [Hq, D] (unnormalized), m [Hq] (max logit), l [Hq] (sum of exponentials).
void attend_part(Sequence seq, const cache_t *k_cache, const cache_t *v_cache, int k0, int k1,
                 int H, int G, int bs, float scale, float *s, int stride, float *acc,
                 float *m, float *l)
{
    const int row = H * D, Hq = H * G;
    for_each_key(k_cache, seq.table, k0, k1, bs, row, [&](int j, const cache_t *k) {
        for (int h = 0; h < H; ++h) {  // scores
            v16 kv[NV];
            for (int c = 0; c < NV; ++c) kv[c] = load_cache(k + h * D + c * 16);
            for (int g = 0; g < G; ++g) {
                const float *qh = seq.q + (h * G + g) * D;
                v16 dot = load(qh) * kv[0];
                for (int c = 1; c < NV; ++c) dot += load(qh + c * 16) * kv[c];
                s[(h * G + g) * stride + j - k0] = hsum(dot) * scale;
            }
        }
    });
    const int n = k1 - k0, full = n & ~15;
    for (int i = 0; i < Hq; ++i) {  // softmax weights, unnormalized
        float *si = s + i * stride;
        float mx = -FLT_MAX;
        for (int t = 0; t < n; ++t) mx = si[t] > mx ? si[t] : mx;
        v16 sum = v16{};
        for (int t = 0; t < full; t += 16) {
            v16 e = vexp(load(si + t) - mx);
            store(si + t, e);
            sum += e;
        }
        float tail = 0.f;
        for (int t = full; t < n; ++t) tail += si[t] = std::exp(si[t] - mx);
        m[i] = mx;
        l[i] = hsum(sum) + tail;
    }
    std::memset(acc, 0, sizeof(float) * Hq * D);
    for_each_key(v_cache, seq.table, k0, k1, bs, row, [&](int j, const cache_t *v) {
        for (int h = 0; h < H; ++h) {  // weighted values
            v16 vv[NV];
            for (int c = 0; c < NV; ++c) vv[c] = load_cache(v + h * D + c * 16);
            for (int g = 0; g < G; ++g) {
                const float p = s[(h * G + g) * stride + j - k0];
                float *o = acc + (h * G + g) * D;
                for (int c = 0; c < NV; ++c) store(o + c * 16, load(o + c * 16) + p * vv[c]);
            }
        }
    });
}

}  // namespace

// Returns 0, or -1 if scratch could not be allocated (nothing written then).
extern "C" int heron_decode_attention(
    const float *q, const cache_t *k_cache, const cache_t *v_cache, const int32_t *block_tables,
    int64_t table_stride, const int32_t *seq_lens, int num_seqs, int num_kv_heads, int group,
    int block_size, float scale, int part_keys, float *out)
{
    const int H = num_kv_heads, G = group, Hq = H * G, B = num_seqs;
    // task i covers keys [(i - first[b]) * part_keys, ...) of sequence b = owner[i]
    int num_tasks = 0;
    for (int b = 0; b < B; ++b) num_tasks += (seq_lens[b] + part_keys - 1) / part_keys;
    const int part_stride = Hq * (D + 2);  // acc [Hq, D], m [Hq], l [Hq]
    int *first = static_cast<int *>(std::malloc(sizeof(int) * (B + 1 + num_tasks)));
    float *parts = static_cast<float *>(std::malloc(sizeof(float) * num_tasks * part_stride));
    if (first == nullptr || parts == nullptr) {
        std::free(first);
        std::free(parts);
        return -1;
    }
    int *owner = first + B + 1;
    for (int b = 0, i = 0; b < B; ++b) {
        first[b] = i;
        for (int n = (seq_lens[b] + part_keys - 1) / part_keys; n > 0; --n) owner[i++] = b;
    }
    first[B] = num_tasks;
    const int stride = (part_keys + 15) & ~15;  // a score row, whole vectors
    int failed = 0;
    #pragma omp parallel
    {
        float *s = static_cast<float *>(std::malloc(sizeof(float) * Hq * stride));
        if (s == nullptr) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < num_tasks; ++i) {
            if (s == nullptr) continue;
            const int b = owner[i], k0 = (i - first[b]) * part_keys;
            const int k1 = k0 + part_keys < seq_lens[b] ? k0 + part_keys : seq_lens[b];
            float *p = parts + (int64_t)i * part_stride;
            attend_part({q + (int64_t)b * Hq * D, block_tables + b * table_stride}, k_cache,
                        v_cache, k0, k1, H, G, block_size, scale, s, stride, p, p + Hq * D,
                        p + Hq * D + Hq);
        }
        std::free(s);
        #pragma omp for
        for (int b = 0; b < B; ++b) {  // merge a sequence's parts: one softmax over all
            for (int i = 0; i < Hq; ++i) {
                float mx = -FLT_MAX, sum = 0.f;
                for (int j = first[b]; j < first[b + 1]; ++j) {
                    const float mj = parts[(int64_t)j * part_stride + Hq * D + i];
                    mx = mj > mx ? mj : mx;
                }
                v16 o[NV] = {};
                for (int j = first[b]; j < first[b + 1]; ++j) {
                    const float *pj = parts + (int64_t)j * part_stride;
                    const float w = std::exp(pj[Hq * D + i] - mx);
                    sum += w * pj[Hq * D + Hq + i];
                    for (int c = 0; c < NV; ++c) o[c] += w * load(pj + i * D + c * 16);
                }
                for (int c = 0; c < NV; ++c)
                    store(out + ((int64_t)b * Hq + i) * D + c * 16, o[c] / sum);
            }
        }
    }
    std::free(first);
    std::free(parts);
    return failed ? -1 : 0;
}
