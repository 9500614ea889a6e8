// A second entry point for a CPU kernel, `<name>_packed(const int64_t *args)`, taking its
// arguments as one array of 64-bit words: what a recorded decode step (`core/cpu_graphs`)
// replays from C, one call per kernel, without a Python call or ctypes' argument
// conversion between them.
//
// Words map onto the kernel's parameters in order: a pointer is its address, an integer
// its value, a float or double the bits of a double. The packed call returns the kernel's
// own result as a word (0 for a void kernel), so a kernel's failure flag stops a replay.
//
//     HERON_PACKED(heron_rms_norm)   // after the kernel, at file scope

#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

namespace heron_packed {

template <typename T>
inline T word_as(int64_t word)
{
    if constexpr (std::is_pointer_v<T>) {
        return reinterpret_cast<T>(static_cast<intptr_t>(word));
    } else if constexpr (std::is_floating_point_v<T>) {
        double d;
        std::memcpy(&d, &word, sizeof d);
        return static_cast<T>(d);
    } else {
        return static_cast<T>(word);
    }
}

template <typename Fn, Fn *F>
struct Call;

template <typename R, typename... A, R (*F)(A...)>
struct Call<R(A...), F> {
    static int64_t run(const int64_t *words) { return run(words, std::index_sequence_for<A...>{}); }

    template <std::size_t... I>
    static int64_t run(const int64_t *words, std::index_sequence<I...>)
    {
        if constexpr (std::is_void_v<R>) {
            F(word_as<A>(words[I])...);
            return 0;
        } else {
            return static_cast<int64_t>(F(word_as<A>(words[I])...));
        }
    }
};

}  // namespace heron_packed

#define HERON_PACKED(fn)                                          \
    extern "C" int64_t fn##_packed(const int64_t *words)          \
    {                                                             \
        return heron_packed::Call<decltype(fn), fn>::run(words);  \
    }
