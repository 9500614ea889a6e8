// Greedy sampling on the CPU (heron_checked_argmax): each row's first largest logit, or
// `failed` where the row is unusable: a NaN or +inf in it, or every logit -inf.
//
// torch's argmax over one row of a vocabulary does not vectorize (SmolLM2's 49152 logits
// took ~60 us on 2 AVX2 cores, ~120 us with the gather and checks after it); this is one
// vector pass.
//
// logits [rows, vocab] float32, rows `stride` floats apart, elements contiguous; out [rows]
// int64. Each lane keeps the largest value it saw and its first index (a strict compare),
// so among equal maxima the lowest index wins, as torch's argmax picks the first.

#include <cmath>
#include <cstdint>

#include "vec_cpu.h"
#include "packed_cpu.h"

namespace {

int64_t row_argmax(const float *x, int64_t n, int64_t failed)
{
    const int64_t vn = n - n % VL;
    const vec inf = vec{} + INFINITY;
    vec best = -inf;
    veci at{}, lane{}, bad{};
    for (int i = 0; i < VL; ++i) lane[i] = i;
    for (int64_t i = 0; i < vn; i += VL) {
        const vec v = vload(x + i);
        bad |= (v != v) | (v == inf);  // NaN, +inf
        const veci larger = v > best;
        best = larger ? v : best;
        at = larger ? lane + (int32_t)i : at;
    }
    float top = -INFINITY;
    int64_t index = 0;
    for (int i = 0; i < VL; ++i) {
        if (bad[i]) return failed;
        if (best[i] > top || (best[i] == top && at[i] < index)) top = best[i], index = at[i];
    }
    for (int64_t i = vn; i < n; ++i) {
        if (std::isnan(x[i]) || x[i] == INFINITY) return failed;
        if (x[i] > top) top = x[i], index = i;
    }
    return top == -INFINITY ? failed : index;
}

}  // namespace

extern "C" void heron_checked_argmax(const float *logits, int64_t stride, int64_t rows,
                                     int64_t vocab, int64_t failed, int64_t *out)
{
    #pragma omp parallel for if (rows * vocab >= (1 << 20))
    for (int64_t r = 0; r < rows; ++r)
        out[r] = row_argmax(logits + r * stride, vocab, failed);
}

HERON_PACKED(heron_checked_argmax)
