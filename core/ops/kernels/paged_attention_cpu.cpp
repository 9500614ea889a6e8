// Paged attention on the CPU, reading the KV blocks in place: decode (one query per
// sequence; heron_decode_attention) and prompts (heron_prefill_attention, further down).
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

#include "vec_cpu.h"
#include "packed_cpu.h"

#ifndef HEAD_DIM
#error "HEAD_DIM must be defined"
#endif
static_assert(HEAD_DIM % 16 == 0, "HEAD_DIM must be a multiple of 16");

namespace {

constexpr int D = HEAD_DIM;
constexpr int NV = D / VL;  // vectors per head row

#ifdef CACHE_BF16
typedef bf16_t cache_t;  // widened to float32 as it loads
#else
typedef float cache_t;
#endif
constexpr int LINE = 64 / sizeof(cache_t);  // cache elements a cache line holds

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
            vec kv[NV];
            for (int c = 0; c < NV; ++c) kv[c] = vload(k + h * D + c * VL);
            for (int g = 0; g < G; ++g) {
                const float *qh = seq.q + (h * G + g) * D;
                vec dot = vload(qh) * kv[0];
                for (int c = 1; c < NV; ++c) dot += vload(qh + c * VL) * kv[c];
                s[(h * G + g) * stride + j - k0] = vsum(dot) * scale;
            }
        }
    });
    const int n = k1 - k0, full = n - n % VL;
    for (int i = 0; i < Hq; ++i) {  // softmax weights, unnormalized
        float *si = s + i * stride;
        float mx = -FLT_MAX;
        for (int t = 0; t < n; ++t) mx = si[t] > mx ? si[t] : mx;
        vec sum = vec{};
        for (int t = 0; t < full; t += VL) {
            vec e = vexp(vload(si + t) - mx);
            vstore(si + t, e);
            sum += e;
        }
        float tail = 0.f;
        for (int t = full; t < n; ++t) tail += si[t] = std::exp(si[t] - mx);
        m[i] = mx;
        l[i] = vsum(sum) + tail;
    }
    std::memset(acc, 0, sizeof(float) * Hq * D);
    for_each_key(v_cache, seq.table, k0, k1, bs, row, [&](int j, const cache_t *v) {
        for (int h = 0; h < H; ++h) {  // weighted values
            vec vv[NV];
            for (int c = 0; c < NV; ++c) vv[c] = vload(v + h * D + c * VL);
            for (int g = 0; g < G; ++g) {
                const float p = s[(h * G + g) * stride + j - k0];
                float *o = acc + (h * G + g) * D;
                for (int c = 0; c < NV; ++c) vstore(o + c * VL, vload(o + c * VL) + p * vv[c]);
            }
        }
    });
}

}  // namespace

// Returns 0, or -1 if scratch could not be allocated (nothing written then). Tasks cover
// parts of part_keys keys: all sequences' keys shared by `tasks`, within [part_min,
// part_max] (every thread gets several tasks, none too short to be worth one).
extern "C" int heron_decode_attention(
    const float *q, const cache_t *k_cache, const cache_t *v_cache, const int32_t *block_tables,
    int64_t table_stride, const int32_t *seq_lens, int num_seqs, int num_kv_heads, int group,
    int block_size, float scale, int part_min, int part_max, int tasks, float *out)
{
    const int H = num_kv_heads, G = group, Hq = H * G, B = num_seqs;
    int64_t keys = 0;
    for (int b = 0; b < B; ++b) keys += seq_lens[b];
    const int64_t even = (keys + tasks - 1) / tasks;
    const int part_keys = even < part_min ? part_min : even > part_max ? part_max : (int)even;
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
    // one task (a single short context: a decode step of one sequence) runs on this thread;
    // waking the others would cost more than its keys
    #pragma omp parallel if (num_tasks > 1)
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
                vec o[NV] = {};
                for (int j = first[b]; j < first[b + 1]; ++j) {
                    const float *pj = parts + (int64_t)j * part_stride;
                    const float w = std::exp(pj[Hq * D + i] - mx);
                    sum += w * pj[Hq * D + Hq + i];
                    for (int c = 0; c < NV; ++c) o[c] += w * vload(pj + i * D + c * VL);
                }
                for (int c = 0; c < NV; ++c)
                    vstore(out + ((int64_t)b * Hq + i) * D + c * VL, o[c] / sum);
            }
        }
    }
    std::free(first);
    std::free(parts);
    return failed ? -1 : 0;
}

// Prefill attention: each sequence's new queries over its paged KV (the cached prefix and the
// chunk's own keys, already written), causal, read in place.
//
// Layout: q, out [T, H * G, D] (sequence b's query_lens[b] queries consecutive from row
// query_starts[b]; a sequence of 0 queries is skipped, its rows left alone); the caches and
// tables as for decode. Query i of a sequence with n queries and L keys sees keys
// 0 .. L - n + i.
//
// The torch path copies each sequence's blocks out of the cache in every layer before SDPA,
// whose CPU kernel then reads the keys once per query head. Here a task is one KV head of
// a tile of TILE_ROWS / G consecutive query positions: the tile's G query heads per position
// become the rows of one matrix, so each key is read once for all of them (rows rounded up
// to a multiple of TILE_ROWS repeat the last position; their outputs are dropped). The
// queries are transposed once per task into [D, rows], so that a vector holds VL rows: a
// key's scores against them are FMAs of the key's elements, broadcast, with no transposed
// keys, and the online softmax (running max and sum per row) works on whole vectors.

namespace {

constexpr int KEYS = 16;        // keys per tile
constexpr int TILE_ROWS = 64;   // query rows (positions x G) per task
// The products' register blocks, sized to the register file: KB x RB score vectors and RB
// query vectors; PR x NV output vectors and NV value vectors.
constexpr int KB = 4;                                // keys per block of the scores product
constexpr int RB = VECTOR_REGISTERS == 32 ? 4 : 2;   // row vectors per block of it
constexpr int PR_FIT = (VECTOR_REGISTERS - 1 - NV) / NV;
constexpr int PR = PR_FIT > 4 ? 4 : PR_FIT < 1 ? 1 : PR_FIT;  // rows per block of the values product

struct Tile {
    float *qt;     // [D, rows]: the queries, times the scale, transposed
    float *o;      // [rows, D]: the output, unnormalized
    float *p;      // [KEYS, rows]: scores, then weights
    float *k;      // [KEYS, D]: a tile's keys, as float32
    float *m;      // [rows]: running max
    float *l;      // [rows]: running sum
    float *alpha;  // [rows]: how much the running max moved this tile (exp of it)
    int *limit;    // [rows]: keys < limit are visible
};

// The rows [0, rows) of tile `t` (rows a multiple of VL * RB) over keys [0, k_end) of a
// sequence.
void attend_tile(Tile t, int rows, const cache_t *k_cache, const cache_t *v_cache,
                 const int32_t *table, int bs, int h, int H, int k_end)
{
    const int row = H * D;
    const cache_t *vrow[KEYS];
    const int min_limit = t.limit[0];
    for (int j0 = 0; j0 < k_end; j0 += KEYS) {
        const int n = k_end - j0 < KEYS ? k_end - j0 : KEYS;
        for (int j = 0; j < KEYS; ++j) {  // the keys as float32 rows, the values' rows
            float *kj = t.k + j * D;
            if (j < n) {
                const int key = j0 + j;
                const int64_t at = ((int64_t)table[key / bs] * bs + key % bs) * row + h * D;
                vrow[j] = v_cache + at;
                for (int c = 0; c < NV; ++c) vstore(kj + c * VL, vload(k_cache + at + c * VL));
            } else {  // past the keys: masked (the values loop stops at n)
                for (int c = 0; c < NV; ++c) vstore(kj + c * VL, vec{});
            }
        }
        for (int r0 = 0; r0 < rows; r0 += VL * RB)  // scores: p[j, r] = k_j . q_r
            for (int jb = 0; jb < KEYS; jb += KB) {
                vec s[KB][RB] = {};
                for (int d = 0; d < D; ++d) {
                    vec q[RB];
                    for (int b = 0; b < RB; ++b) q[b] = vload(t.qt + d * rows + r0 + b * VL);
                    for (int j = 0; j < KB; ++j) {
                        const float kd = t.k[(jb + j) * D + d];
                        for (int b = 0; b < RB; ++b) s[j][b] += kd * q[b];
                    }
                }
                for (int j = 0; j < KB; ++j)
                    for (int b = 0; b < RB; ++b)
                        vstore(t.p + (jb + j) * rows + r0 + b * VL, s[j][b]);
            }
        const bool masked = j0 + KEYS > min_limit;
        for (int r = 0; r < rows; r += VL) {  // softmax weights, online
            const veci limit = vload(t.limit + r);
            vec mx = vload(t.m + r);
            const vec m_old = mx;
            for (int j = 0; j < KEYS; ++j) {
                vec sj = vload(t.p + j * rows + r);
                if (masked) {
                    sj = j0 + j < limit ? sj : vec{} - FLT_MAX;
                    vstore(t.p + j * rows + r, sj);
                }
                mx = sj > mx ? sj : mx;
            }
            // every row sees key 0, so its max is a real logit from the first tile on
            const vec alpha = vexp(m_old - mx);  // m_old -FLT_MAX: exp(-87), times nothing
            vec sum = vload(t.l + r) * alpha;
            for (int j = 0; j < KEYS; ++j) {
                vec e = vexp(vload(t.p + j * rows + r) - mx);
                if (masked) e = j0 + j < limit ? e : vec{};  // vexp stops at exp(-87), not 0
                vstore(t.p + j * rows + r, e);
                sum += e;
            }
            vstore(t.m + r, mx);
            vstore(t.l + r, sum);
            vstore(t.alpha + r, alpha);
        }
        for (int r0 = 0; r0 < rows; r0 += PR) {  // weighted values, the old sums rescaled
            vec o[PR][NV];
            for (int i = 0; i < PR; ++i)
                for (int c = 0; c < NV; ++c)
                    o[i][c] = vload(t.o + (r0 + i) * D + c * VL) * t.alpha[r0 + i];
            for (int j = 0; j < n; ++j) {
                vec v[NV];
                for (int c = 0; c < NV; ++c) v[c] = vload(vrow[j] + c * VL);
                for (int i = 0; i < PR; ++i) {
                    const float w = t.p[j * rows + r0 + i];
                    for (int c = 0; c < NV; ++c) o[i][c] += w * v[c];
                }
            }
            for (int i = 0; i < PR; ++i)
                for (int c = 0; c < NV; ++c) vstore(t.o + (r0 + i) * D + c * VL, o[i][c]);
        }
    }
}

}  // namespace

// Returns 0, or -1 if scratch could not be allocated (nothing written then).
extern "C" int heron_prefill_attention(
    const float *q, const cache_t *k_cache, const cache_t *v_cache, const int32_t *block_tables,
    int64_t table_stride, const int32_t *query_starts, const int32_t *query_lens,
    const int32_t *seq_lens, int num_seqs,
    int num_kv_heads, int group, int block_size, float scale, float *out)
{
    const int H = num_kv_heads, G = group, Hq = H * G, B = num_seqs;
    const int positions = TILE_ROWS / G > 0 ? TILE_ROWS / G : 1;
    const int rows = (positions * G + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
    // task i: KV head i % H of the tile of positions starting at tile_start[i / H]
    int num_tiles = 0;
    for (int b = 0; b < B; ++b)
        num_tiles += (query_lens[b] + positions - 1) / positions;
    int *tile_seq = static_cast<int *>(std::malloc(sizeof(int) * 2 * (num_tiles + 1)));
    if (tile_seq == nullptr) return -1;
    int *tile_start = tile_seq + num_tiles + 1;
    // each sequence's last tile (the most keys) first, for the dynamic schedule
    for (int b = 0, i = 0; b < B; ++b) {
        const int n = query_lens[b];
        for (int p = n > 0 ? (n - 1) / positions * positions : -1; p >= 0; p -= positions, ++i) {
            tile_seq[i] = b;
            tile_start[i] = p;
        }
    }
    int failed = 0;
    #pragma omp parallel
    {
        const size_t floats = (size_t)rows * (2 * D + KEYS + 4) + KEYS * D;
        float *scratch = static_cast<float *>(std::aligned_alloc(64, (floats * 4 + 63) / 64 * 64));
        if (scratch == nullptr) {
            #pragma omp atomic write
            failed = 1;
        }
        Tile t;
        if (scratch != nullptr) {
            t.qt = scratch;
            t.o = t.qt + rows * D;
            t.p = t.o + rows * D;
            t.k = t.p + KEYS * rows;
            t.m = t.k + KEYS * D;
            t.l = t.m + rows;
            t.alpha = t.l + rows;
            t.limit = reinterpret_cast<int *>(t.alpha + rows);
        }
        #pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < num_tiles * H; ++task) {
            if (scratch == nullptr) continue;
            const int i = task / H, h = task % H, b = tile_seq[i];
            const int n = query_lens[b], L = seq_lens[b];
            const int p0 = tile_start[i], np = n - p0 < positions ? n - p0 : positions;
            const float *qb = q + ((int64_t)(query_starts[b] + p0) * Hq + h * G) * D;
            for (int r = 0; r < rows; ++r) {
                const int p = r / G < np ? r / G : np - 1, g = r % G;  // padding: the last row
                const float *qr = qb + (p * Hq + g) * D;
                for (int d = 0; d < D; ++d) t.qt[d * rows + r] = qr[d] * scale;
                std::memset(t.o + r * D, 0, sizeof(float) * D);
                t.m[r] = -FLT_MAX;
                t.l[r] = 0.f;
                t.limit[r] = L - n + p0 + p + 1;
            }
            attend_tile(t, rows, k_cache, v_cache, block_tables + b * table_stride, block_size,
                        h, H, L - n + p0 + np);
            for (int r = 0; r < np * G; ++r) {
                const int p = r / G, g = r % G;
                const float inv = 1.f / t.l[r];
                float *ob = out + ((int64_t)(query_starts[b] + p0 + p) * Hq + h * G + g) * D;
                for (int c = 0; c < NV; ++c) vstore(ob + c * VL, vload(t.o + r * D + c * VL) * inv);
            }
        }
        std::free(scratch);
    }
    std::free(tile_seq);
    return failed ? -1 : 0;
}

HERON_PACKED(heron_decode_attention)
HERON_PACKED(heron_prefill_attention)
