// The replay of a recorded decode step's run of kernels (`core/cpu_graphs`): each kernel's
// packed entry point (`packed_cpu.h`) with its recorded argument words, in order.
//
// Returns 0, or 1 + the index of the first kernel that returned non-zero (its failure flag),
// after which none runs.

#include <cstdint>

typedef int64_t (*packed_kernel)(const int64_t *words);

extern "C" int64_t heron_replay(const packed_kernel *kernels, const int64_t *const *words,
                                int64_t n)
{
    for (int64_t i = 0; i < n; ++i)
        if (kernels[i](words[i]) != 0)
            return i + 1;
    return 0;
}
