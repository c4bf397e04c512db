#pragma once
// Measurement shim (Harrier, session 44): stands in for ThunderKittens' pybind11 binding so the
// published megakernel builds without Python.h. `mk_call` takes, for each bound member in
// order, a device pointer and a 4-d shape (globals) or a value (scalars), and launches.
#include "kittens.cuh"
#include <cstdint>
#include <functional>
#include <utility>

namespace kittens {
namespace py {
struct module_stub {
    const char*& doc() { static const char* d = ""; return d; }
};
using launcher_fn = std::function<int(const uint64_t*, const int*, const double*, void*)>;
inline launcher_fn& launcher() { static launcher_fn f; return f; }
template <typename T> struct from_raw {
    static T make(uint64_t, const int*, double v) { return (T)v; }
};
template <ducks::gl::all GL> struct from_raw<GL> {
    static GL make(uint64_t p, const int* s, double) { return make_gl<GL>(p, s[0], s[1], s[2], s[3]); }
};
template <typename> struct trait;
template <typename MT, typename T> struct trait<MT T::*> { using member_type = MT; using type = T; };
template <typename TGlobal, typename... MP, size_t... I>
TGlobal build_globals(std::index_sequence<I...>, const uint64_t* p, const int* s, const double* v) {
    return TGlobal{from_raw<typename trait<MP>::member_type>::make(p[I], s + 4 * I, v[I])...};
}
template <typename P, typename...> struct first { using type = P; };
template <auto kernel, typename... MP>
static void bind_kernel(module_stub&, const char*, MP... member_ptrs) {
    using TGlobal = typename trait<typename first<MP...>::type>::type;
    (void)sizeof...(member_ptrs);
    launcher() = [](const uint64_t* p, const int* s, const double* v, void* stream) -> int {
        TGlobal g = build_globals<TGlobal, MP...>(std::index_sequence_for<MP...>{}, p, s, v);
        int smem = (int)g.dynamic_shared_memory();
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        kernel<<<g.grid(), g.block(), smem, (cudaStream_t)stream>>>(g);
        return (int)cudaGetLastError();
    };
}
}  // namespace py
}  // namespace kittens

#define PYBIND11_MODULE(name, m)                                                                 \
    static void mk_register_##name(kittens::py::module_stub& m);                                 \
    extern "C" int mk_call(const uint64_t* p, const int* s, const double* v, void* stream) {     \
        static bool registered = false;                                                          \
        if (!registered) {                                                                       \
            kittens::py::module_stub ms;                                                         \
            mk_register_##name(ms);                                                              \
            registered = true;                                                                   \
        }                                                                                        \
        return kittens::py::launcher()(p, s, v, stream);                                         \
    }                                                                                            \
    static void mk_register_##name(kittens::py::module_stub& m)
