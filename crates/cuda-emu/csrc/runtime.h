// Shared between runtime.cpp and the generated wrapper / registry translation units.
#pragma once

#include <stddef.h>
#include <string.h>

#include <utility>

namespace baton_emu {

// One kernel entry point of one dtype module: runs the kernel body for the current fiber,
// reading parameter i from args[i] as cuLaunchKernel reads kernelParams.
struct Entry {
    const char* name;
    unsigned num_params;
    void (*invoke)(void** args);
};

template <class T>
inline T load_param(void* p) {
    T v;
    memcpy(&v, p, sizeof(T));
    return v;
}

template <class Sig>
struct Unpack;
template <class... A>
struct Unpack<void (*)(A...)> {
    static constexpr unsigned count = sizeof...(A);
    template <void (*F)(A...), size_t... I>
    static void call_impl(void** args, std::index_sequence<I...>) {
        F(load_param<A>(args[I])...);
        (void)args;
    }
    template <void (*F)(A...)>
    static void call(void** args) {
        call_impl<F>(args, std::index_sequence_for<A...>{});
    }
};

}  // namespace baton_emu

#define BATON_EMU_ENTRY(fn, name)                                                    \
    ::baton_emu::Entry {                                                             \
        name, ::baton_emu::Unpack<decltype(&fn)>::count,                             \
            &::baton_emu::Unpack<decltype(&fn)>::template call<&fn>                  \
    }
