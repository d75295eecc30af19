"""The hot CPU ops' dispatch in C++: a compiled step reaches its kernels without re-entering Python.

A compiled CPU step calls each kvloom op through torch's dispatcher; an op registered from Python
(``kvloom.kernels.cpu_ops``) re-enters the interpreter for its body: arguments unpacked, the result allocated, the
pointers handed to ctypes. That costs ~4 us a call over the kernel's own (one 576 x 576 one-row 4-bit layer on a
2-core Zen 5: 7.9-8.5 us through the Python op, 4.6-4.7 through this one, 3.6 the ctypes call alone), and a SmolLM2
decode step makes ~180 such calls. This small C++ library, built against the installed torch the first time (~5 s,
cached like the kernels by source, flags, torch version and CPU: ``kvloom.kernels.cpu_build``), registers CPU
kernels for the ops a decode step calls per layer (``cpu_ops.NATIVE_OPS``): the common case in C++ (the result
allocated, the kernel called through the pointer its ctypes library exports), every other case (rows beyond the
kernel's, an empty step, a shape or build the kernel refuses, attention sinks) handed whole to the op's Python body
(registered beside it as ``<op>_python``), which computes or raises as it always did. The results are the kernels'
own, bit for bit.

Where there is no C++ compiler or torch's headers, or the build fails (one log line says why), or
``KVLOOM_CPU_NATIVE_OPS=0``, the ops keep their Python bodies."""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import torch

from kvloom.kernels.cpu_build import build_library

logger = logging.getLogger("kvloom")

_SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <utility>

namespace {

using Stack = torch::jit::Stack;
// kvloom_int4_amx_mm / kvloom_int4_q8_mm / kvloom_int4_q8_glu (kvloom.kernels.cpu_int4_amx)
using MatmulFn = int (*)(const void*, const void*, const void*, void*, int64_t, int64_t, int64_t, int64_t);
// kvloom_paged_decode and kvloom_rope_write (kvloom.kernels.cpu_attention)
using DecodeFn = int (*)(int, int64_t, const void*, const void*, const void*, const void*, int64_t, const void*,
                         const void*, const void*, void*, int64_t, int64_t, int64_t, int64_t, int64_t, float, float,
                         int);
using RopeFn = void (*)(int64_t, int64_t, int64_t, int64_t, const void*, int64_t, const void*, int64_t, const void*,
                        int64_t, const void*, const void*, void*, void*, void*, void*, const void*);

MatmulFn amx_mm = nullptr, q8_mm = nullptr, q8_glu = nullptr;
DecodeFn decode = nullptr;
RopeFn rope = nullptr;
int64_t span_blocks = 8;
int vectorized = 1;
std::atomic<int64_t> served{0};  // calls the C++ path took (tests read it)

// the op's Python body on the same stack: every case the C++ path leaves
void python(const char* name, Stack* stack) {
    c10::Dispatcher::singleton().findSchemaOrThrow(name, "").callBoxed(stack);
}

template <typename... Outputs>
void finish(Stack* stack, size_t args, Outputs&&... outputs) {
    torch::jit::drop(*stack, args);
    torch::jit::push(*stack, std::forward<Outputs>(outputs)...);
    served.fetch_add(1, std::memory_order_relaxed);
}

// fn's ``columns`` results for bf16 rows x (a[0]) by the codes and scales a[1], a[2] in groups of a[3]; undefined
// where x is not rows the kernel takes (1 to max_rows) or the kernel refuses the shape
at::Tensor matmul(MatmulFn fn, c10::ArrayRef<c10::IValue> a, int64_t max_rows, int64_t columns) {
    const at::Tensor& x0 = a[0].toTensor();
    if (fn == nullptr || x0.dim() != 2 || x0.scalar_type() != at::kBFloat16 || x0.size(0) == 0 ||
        x0.size(0) > max_rows)
        return at::Tensor();
    const at::Tensor x = x0.contiguous();
    const at::Tensor &codes = a[1].toTensor(), &scales = a[2].toTensor();
    at::Tensor y = at::empty({x.size(0), columns}, x.options());
    const int rc = fn(x.data_ptr(), codes.data_ptr(), scales.data_ptr(), y.data_ptr(), x.size(0), x.size(1),
                      codes.size(0) * 16, a[3].toInt());
    return rc == 0 ? y : at::Tensor();
}

// kernel_linear(Tensor x, Tensor codes, Tensor scale_zeros, int group, Tensor dense_weight, Tensor? bias,
//               int max_rows, int int8_inputs=0) -> Tensor
void kernel_linear(const c10::OperatorHandle&, c10::DispatchKeySet, Stack* stack) {
    auto a = torch::jit::last(*stack, 8);
    at::Tensor y = matmul(a[7].toInt() ? q8_mm : amx_mm, a, a[6].toInt(), a[1].toTensor().size(0) * 16);
    if (!y.defined()) return python("kvloom::kernel_linear_python", stack);  // it computes, or names the refusal
    if (!a[5].isNone()) y = y.add(a[5].toTensor());
    finish(stack, 8, std::move(y));
}

// kernel_glu(Tensor x, Tensor codes, Tensor scale_zeros, int group, Tensor dense_weight, int max_rows) -> Tensor
void kernel_glu(const c10::OperatorHandle&, c10::DispatchKeySet, Stack* stack) {
    auto a = torch::jit::last(*stack, 6);
    at::Tensor y = matmul(q8_glu, a, a[5].toInt(), a[1].toTensor().size(0) * 8);  // silu(gate) * up: half the outputs
    if (!y.defined()) return python("kvloom::kernel_glu_python", stack);
    finish(stack, 6, std::move(y));
}

// paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor starts, Tensor ends, float scale,
//              float softcap, Tensor? sinks) -> Tensor
void paged_decode(const c10::OperatorHandle&, c10::DispatchKeySet, Stack* stack) {
    auto a = torch::jit::last(*stack, 9);
    const at::Tensor &q0 = a[0].toTensor(), &kc = a[1].toTensor(), &vc = a[2].toTensor();
    const bool dtype_ok = q0.scalar_type() == at::kBFloat16 || q0.scalar_type() == at::kFloat;
    if (decode == nullptr || !a[8].isNone() || !dtype_ok || q0.dim() != 3 || q0.size(0) == 0 || kc.dim() != 4)
        return python("kvloom::paged_decode_python", stack);
    const at::Tensor q = q0.contiguous(), tables = a[3].toTensor().contiguous();
    const at::Tensor starts = a[4].toTensor().contiguous(), ends = a[5].toTensor().contiguous();
    at::Tensor out = at::empty(q.sizes(), q.options());
    if (decode(q.scalar_type() == at::kBFloat16 ? 1 : 0, q.size(2), q.data_ptr(), kc.data_ptr(), vc.data_ptr(),
               tables.data_ptr(), tables.stride(0), starts.data_ptr(), ends.data_ptr(), nullptr, out.data_ptr(),
               q.size(0), q.size(1), kc.size(1), kc.size(2), span_blocks, static_cast<float>(a[6].toDouble()),
               static_cast<float>(a[7].toDouble()), vectorized) != 0)
        return python("kvloom::paged_decode_python", stack);
    finish(stack, 9, std::move(out));
}

// cpu_rope_write(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache,
//                Tensor write_rows) -> (Tensor, Tensor)
void rope_write(const c10::OperatorHandle&, c10::DispatchKeySet, Stack* stack) {
    auto a = torch::jit::last(*stack, 8);
    const at::Tensor &q = a[0].toTensor(), &k = a[1].toTensor(), &v = a[2].toTensor();
    if (rope == nullptr || q.dim() != 3 || q.size(0) == 0) return python("kvloom::cpu_rope_write_python", stack);
    const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k.size(1);
    at::Tensor q_out = at::empty({tokens, heads, dim}, q.options());
    at::Tensor k_out = at::empty({tokens, kv_heads, dim}, k.options());
    const at::Tensor cos = a[3].toTensor().reshape({tokens, dim}).contiguous();
    const at::Tensor sin = a[4].toTensor().reshape({tokens, dim}).contiguous();
    const at::Tensor rows = a[7].toTensor().contiguous();
    rope(dim, tokens, heads, kv_heads, q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
         v.stride(0), cos.data_ptr(), sin.data_ptr(), q_out.data_ptr(), k_out.data_ptr(), a[5].toTensor().data_ptr(),
         a[6].toTensor().data_ptr(), rows.data_ptr());
    finish(stack, 8, std::move(q_out), std::move(k_out));
}

}  // namespace

// the kernels' addresses (their ctypes libraries'), before any call takes the C++ path; a null one keeps Python's
extern "C" void kvloom_native_set(void* amx, void* q8, void* glu, void* dec, void* rot, int64_t span, int vec) {
    amx_mm = reinterpret_cast<MatmulFn>(amx);
    q8_mm = reinterpret_cast<MatmulFn>(q8);
    q8_glu = reinterpret_cast<MatmulFn>(glu);
    decode = reinterpret_cast<DecodeFn>(dec);
    rope = reinterpret_cast<RopeFn>(rot);
    span_blocks = span;
    vectorized = vec;
}

extern "C" int64_t kvloom_native_served() { return served.load(); }

// CPU tensors; oneDNN's packed weights (a layer's dense copy, an argument of the linear ops) are MkldnnCPU's
#define KVLOOM_NATIVE_OPS(m)                                                                   \
    m.impl("kernel_linear", torch::CppFunction::makeFromBoxedFunction<&kernel_linear>());     \
    m.impl("kernel_glu", torch::CppFunction::makeFromBoxedFunction<&kernel_glu>());           \
    m.impl("paged_decode", torch::CppFunction::makeFromBoxedFunction<&paged_decode>());       \
    m.impl("cpu_rope_write", torch::CppFunction::makeFromBoxedFunction<&rope_write>());

TORCH_LIBRARY_IMPL(kvloom, CPU, m) { KVLOOM_NATIVE_OPS(m) }
TORCH_LIBRARY_IMPL(kvloom, MkldnnCPU, m) { KVLOOM_NATIVE_OPS(m) }
"""

_lock = threading.Lock()
_lib = None  # the loaded library, False where it may not be built or loaded here


def _flags() -> tuple[list[str], tuple[str, ...]]:
    """The compiler's flags (torch's headers and ABI) and what to link (torch's libraries)."""
    root = os.path.dirname(torch.__file__)
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    flags = ["-O2", "-w", f"-I{os.path.join(root, 'include')}", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
             f"-DKVLOOM_TORCH_VERSION={torch.__version__}"]  # a build per torch: its headers are the ABI
    return flags, (f"-L{os.path.join(root, 'lib')}", "-lc10", "-ltorch_cpu")


def load() -> bool:
    """Build and load the library (once a process) and point it at the kernels; whether the C++ path serves."""
    global _lib
    if _lib is not None:
        return bool(_lib)
    with _lock:
        if _lib is None:
            _lib = _build()
    return bool(_lib)


def _build():
    if os.environ.get("KVLOOM_CPU_NATIVE_OPS", "1") == "0":
        return False
    from kvloom.kernels import cpu_attention, cpu_int4_amx

    try:
        flags, link = _flags()
        lib = ctypes.CDLL(build_library("native_ops", _SOURCE, flag_sets=[flags], link=link))
    except Exception as exc:  # noqa: BLE001 - no compiler or torch headers: the Python bodies serve
        logger.warning("CPU ops keep their Python dispatch (the C++ one did not build: %s: %s)",
                       type(exc).__name__, str(exc)[:300])
        return False
    int4 = cpu_int4_amx._load()
    decode = cpu_attention._load()
    rope = cpu_attention._rope if decode else None

    def address(fn) -> int | None:
        return ctypes.cast(fn, ctypes.c_void_p).value if fn else None

    lib.kvloom_native_set.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_int]
    lib.kvloom_native_set(address(int4 and int4.kvloom_int4_amx_mm), address(int4 and int4.kvloom_int4_q8_mm),
                          address(int4 and int4.kvloom_int4_q8_glu), address(decode), address(rope),
                          cpu_attention.SPAN_BLOCKS, int(cpu_attention.VECTORIZED))
    lib.kvloom_native_served.restype = ctypes.c_int64
    return lib


def served() -> int:
    """Calls the C++ path has taken in this process (0 where it is not loaded)."""
    return int(_lib.kvloom_native_served()) if _lib else 0
