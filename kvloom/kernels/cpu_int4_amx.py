"""4-bit (and 8-bit) weights times a step of several rows on AMX: each weight tile read once a call, for every row.

torch's CPU int4 matmul (``kvloom.kernels.cpu_int4``) converts the 4-bit codes again for every row it multiplies,
so its time grows with the rows (SmolLM2's 120 layers on this project's 2-core Xeon: 4.9 ms at 1 row, 14 at 8, 66
at 32), and the oneDNN bf16 copy streams four times the bytes. On a CPU with AMX this kernel makes each 16-output x
32-input tile of the codes into the layout AMX's B operand takes (pairs of inputs side by side) once per call and
multiplies up to 16 rows at a time with one ``tdpbf16ps`` per tile. Two loops:

- up to ``GROUPED_ROWS`` rows (decode steps of a few streams), the B tiles hold the codes themselves, 0..15 as bf16
  (a table lookup, no float math a weight), and each group's float32 sums are scaled once: ``scale * (x . q) +
  (zero - 8 * scale) * sum(x)``, two FMAs a row a group. 5.4-7.4 ms from 1 to 16 rows (the loop below: 8.0-8.5);
- more rows share each weight's float math: the tiles dequantized to bf16 (``W = (q - 8) * scale + zero``, rounded
  once), 9.3 ms at 17 rows, 14 at 32, 22 at 48 (docs/benchmarks.md, "CPU: 4-bit matmuls on AMX").

The weights are the ones ``cpu_int4.pack_int4`` takes: codes ``q`` [N, K] in 0..15 and ``W = (q - 8) * scale +
zero`` per group of inputs, the scales and zeros in bf16; the codes packed as ``pack_codes`` lays them out, the
scales and zeros as ``pack_scale_zeros`` does (each tile's groups together: in torch's [K / group, N, 2] a tile's
64 bytes of each group lie a row apart, and steps of one row waited on them: 4.1 against 3.0 ms over SmolLM2's 120
layers on a Zen 5). The first loop multiplies by those weights exactly (products of bf16 rows and small integers,
summed and scaled in float32); the second rounds each weight to bf16 first, as a bf16 matmul by the dequantized
weights would. Both differ from such a matmul only within the output's bf16 rounding.

The dequantizing loops serve 8-bit codes too (``q8_amx_mm``), at any row count: GGUF's Q8_0, ``W = d * q`` with
one fp16 ``d`` per 32 inputs, which a GGUF file's output projection (its tied embedding table, mostly) comes in; laid
out by ``pack_q8_codes`` in the B operand's pair order, a tile needs no shuffle. 2.5-2.9 ms for SmolLM2's 49152 x 576
table from 1 to 32 rows against 4.0-6.0 for its bf16 copy.

On a CPU with AVX512-BF16 but no AMX (Zen 4/5, Cooper Lake) the same entry points run on ``vdpbf16ps``: a B tile's
row of pairs is one operand, each row's pair of inputs broadcast is the other (the rows' pairs laid out pair-major
first, so one pointer addresses them all). There the 4-bit weights take the first loop at any row count, the rows in
blocks of up to 16 (``grouped_rows()``), each tile's codes read once for all blocks and fetched ahead of the loop; a
dequantized tile would cost as many vector instructions as the dot products it feeds. They serve steps of 1 to 64
rows (``on_amx()`` tells the engine which; ``cpu_packing.int4_rows``), and the 8-bit head steps of 1 to 8 rows.

There, too, ``int4_q8_mm`` multiplies 8-bit inputs, as llama.cpp multiplies a GGUF file's 4-bit blocks: each row's
32 inputs of a chunk rounded to int8 with one scale (max |x| / 127), the codes times them on ``vpdpbusd`` (four
products a lane, twice ``vdpbf16ps``'s) and each chunk's integer sums scaled, ``scale * d * (q . xq) + offset * d *
sum(xq)``: the weights times the rounded inputs. SmolLM2's 120 layers on a 2-core Zen 5: 0.67x the bf16 loop's time
at 32-64 rows, 0.65x the bf16 copy's at 4,096 (so it serves prompt steps too); greedy choices over a real text agree
with the bf16 path's at 95.3 % of positions against the bf16 loop's 96.5 %. The engine gives it a GGUF file's layers
(``q8_inputs()``; ``KVLOOM_CPU_INT8_INPUTS=0`` keeps bf16 inputs, ``=1`` gives it AWQ/GPTQ layers too).

Linux lends AMX's tile registers only to a process that asks (``arch_prctl(ARCH_REQ_XCOMP_PERM)``); the library
asks when it loads. Built like the other CPU kernels (``kvloom.kernels.cpu_build``); where the compiler or the CPU
has neither AMX nor AVX512-BF16, or ``KVLOOM_CPU_INT4_AMX=0``, ``available()`` is False and torch's kernel and the
bf16 copy serve.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading

import torch

from kvloom.kernels.cpu_build import build_library

logger = logging.getLogger("kvloom")

OUTPUTS = 16  # outputs a tile (a B tile's 16 columns of float32 results)
INPUTS = 32  # inputs a tile (one 64-byte row of bf16 an A tile row holds)
GROUPED_ROWS = 16  # on AMX, up to this many rows the codes are multiplied and each group's sums scaled

_SOURCE = r"""
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <omp.h>
#include <type_traits>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KVLOOM_AMX 1
#endif

namespace {

#ifdef KVLOOM_AMX
struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};
#endif

// The 4-bit codes: [N / 16, K / 32, 8, 32] bytes (``pack_codes``). Byte i of a chunk's row pair h holds word i of
// B rows 2h (low nibble) and 2h + 1 (high nibble), word 2j + e of B row p being output j's code of input 2p + e:
// AMX's B operand order, so a B tile is made without shuffles.

// Up to 16 rows (``int4_grouped``): a chunk's codes as the bf16 integers 0..15, by table lookup (no float math a
// weight). vpermw reads an index's low five bits, so the table holds them twice and a high nibble may stay above.
inline __m512i code_table() {
    alignas(64) uint16_t words[32];
    for (int i = 0; i < 32; ++i) {
        const float f = static_cast<float>(i & 15);
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        words[i] = static_cast<uint16_t>(bits >> 16);  // a small integer: exact in bf16
    }
    return _mm512_load_si512(words);
}

// 16 (scale, zero) bf16 pairs -> the scales and W's offsets, zero - 8 * scale: W = q * scale + offset
inline void scale_offset(const uint32_t* scale_zero, __m512& s, __m512& off) {
    const __m512i sz = _mm512_loadu_si512(scale_zero);
    s = _mm512_castsi512_ps(_mm512_slli_epi32(sz, 16));
    off = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s,
                           _mm512_castsi512_ps(_mm512_and_si512(sz, _mm512_set1_epi32(static_cast<int>(0xffff0000u)))));
}

// 8-bit weights (GGUF's Q8_0): codes int8 [N / 16, K / 32, 16, 16, 2] (``pack_q8_codes``: byte 2j + e of row p is
// output j's code of input 2p + e, already the B operand's pair order), one fp16 scale d per output and 32 inputs
// [K / 32, N]; W = d * q rounded to bf16 (d * q is exact in float32).
struct Int8Tiles {
    const int8_t* codes;
    const uint16_t* scales;
    int64_t N, chunks;
    inline void operator()(int64_t t, int64_t k, uint16_t* out) const {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + k * N + t * 16)));
        // lanes 2j and 2j + 1 take output j's scale: outputs 0-7 in the first 16 lanes, 8-15 in the second
        const __m512 s_lo = _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), d);
        const __m512 s_hi = _mm512_permutexvar_ps(
            _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8), d);
        const int8_t* c = codes + (t * chunks + k) * 512;
        for (int l = 0; l < 8; ++l) _mm_prefetch(reinterpret_cast<const char*>(c + 4096 + l * 64), _MM_HINT_T0);
        for (int p = 0; p < 16; ++p) {
            const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + p * 32)))), s_lo);
            const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + p * 32 + 16)))), s_hi);
            _mm512_store_si512(out + p * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
};

// The sum of n bf16 values (n a multiple of 16), in float32.
inline float sum_bf16(const uint16_t* x, int64_t n) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t k = 0; k < n; k += 16)
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + k))), 16)));
    return _mm512_reduce_add_ps(sum);
}

#ifdef KVLOOM_AMX
// A chunk's codes as the bf16 integers (``code_table``) into a B tile, for AMX's grouped loop.
inline void code_tile(const uint8_t* codes, __m512i table, uint16_t* out) {
    for (int h = 0; h < 8; ++h) {
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + h * 32)));
        _mm512_store_si512(out + (2 * h) * 32, _mm512_permutexvar_epi16(v, table));
        _mm512_store_si512(out + (2 * h + 1) * 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table));
    }
}

// More rows: the weights dequantized into the B tiles (W = (q - 8) * scale + zero in float32, rounded to bf16
// nearest even), shared by all the rows (``few_rows``, ``many_rows``).
struct Int4Tiles {
    const uint8_t* codes;
    const uint32_t* sz;
    int64_t groups, chunks, per_group;
    inline void operator()(int64_t t, int64_t k, uint16_t* out) const {
        __m512 s, off;
        scale_offset(sz + (t * groups + k / per_group) * 16, s, off);
        // words 0-15 of a B row are outputs 0-7's (each twice), words 16-31 outputs 8-15's
        const __m512i lo_idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
        const __m512i hi_idx = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
        const __m512 s_lo = _mm512_permutexvar_ps(lo_idx, s), s_hi = _mm512_permutexvar_ps(hi_idx, s);
        const __m512 o_lo = _mm512_permutexvar_ps(lo_idx, off), o_hi = _mm512_permutexvar_ps(hi_idx, off);
        const __m512i low = _mm512_set1_epi32(0x0f);
        const uint8_t* c = codes + (t * chunks + k) * 256;
        for (int h = 0; h < 8; ++h) {
            const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + h * 32)));
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + h * 32 + 16)));
            _mm512_store_si512(out + (2 * h) * 32, (__m512i)_mm512_cvtne2ps_pbh(
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, low)), s_hi, o_hi),
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(a, low)), s_lo, o_lo)));
            _mm512_store_si512(out + (2 * h + 1) * 32, (__m512i)_mm512_cvtne2ps_pbh(
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), s_hi, o_hi),
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(a, 4)), s_lo, o_lo)));
        }
    }
};

inline void store_rows(const float* c, int64_t rows, uint16_t* y, int64_t N) {
    for (int64_t r = 0; r < rows; ++r)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * N),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c + r * 16)));
}

// Each row's sum over each group of inputs (the offsets' term of the grouped loops), [M, K / group]; free() it.
inline float* group_sums(const uint16_t* x, int64_t M, int64_t K, int64_t group) {
    const int64_t groups = K / group;
    float* xsum = static_cast<float*>(std::aligned_alloc(64, (M * groups * sizeof(float) + 63) / 64 * 64));
    for (int64_t r = 0; r < M; ++r)
        for (int64_t g = 0; g < groups; ++g) xsum[r * groups + g] = sum_bf16(x + r * K + g * group, group);
    return xsum;
}

// Up to 32 rows: the float32 sums of both 16-row blocks stay in tile registers (tmm0, tmm3) over all of K.
// ``W(t, k, out)`` writes the B tile of outputs 16t.. and inputs 32k.. (bf16 pairs).
template <typename Tiles>
void few_rows(const uint16_t* x, const Tiles& tiles_in, uint16_t* y, int64_t M, int64_t K, int64_t N) {
    const int64_t tiles = N / 16, chunks = K / 32, m0 = M > 16 ? 16 : M, m1 = M - m0;
#pragma omp parallel
    {
        const Tiles W = tiles_in;  // a thread's own copy: its fields stay in registers (bf16 stores may alias a ref)
        TileConfig cfg;
        cfg.rows[0] = cfg.rows[1] = m0;  // sums, rows of x
        cfg.rows[2] = 16;                // weights
        cfg.rows[3] = cfg.rows[4] = m1;  // the second block's
        for (int t = 0; t < 5; ++t) cfg.colsb[t] = cfg.rows[t] ? 64 : 0;
        _tile_loadconfig(&cfg);
        alignas(64) uint16_t b[2][16 * 32];  // the next chunk dequantized while AMX multiplies this one
        alignas(64) float c[16 * 16];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            _tile_zero(0);
            if (m1) _tile_zero(3);
            W(t, 0, b[0]);
            for (int64_t k = 0; k < chunks; ++k) {
                _tile_loadd(2, b[k & 1], 64);
                _tile_loadd(1, x + k * 32, K * 2);
                _tile_dpbf16ps(0, 1, 2);
                if (m1) {
                    _tile_loadd(4, x + 16 * K + k * 32, K * 2);
                    _tile_dpbf16ps(3, 4, 2);
                }
                if (k + 1 < chunks) W(t, k + 1, b[(k + 1) & 1]);
            }
            _tile_stored(0, c, 64);
            store_rows(c, m0, y + t * 16, N);
            if (m1) {
                _tile_stored(3, c, 64);
                store_rows(c, m1, y + 16 * N + t * 16, N);
            }
        }
        _tile_release();
    }
}

// More rows: every 16-row block's sums live in a buffer (tile loads and stores from L1), each weight tile still
// dequantized once for all of them.
template <typename Tiles>
void many_rows(const uint16_t* x, const Tiles& tiles_in, uint16_t* y, int64_t M, int64_t K, int64_t N) {
    const int64_t tiles = N / 16, chunks = K / 32, blocks = (M + 15) / 16, last = M - (blocks - 1) * 16;
#pragma omp parallel
    {
        const Tiles W = tiles_in;  // a thread's own copy: its fields stay in registers (bf16 stores may alias a ref)
        TileConfig cfg;
        cfg.rows[0] = cfg.rows[1] = cfg.rows[2] = 16;  // sums, rows of x, weights (whole blocks)
        cfg.rows[3] = cfg.rows[4] = last;              // the last block's sums and rows
        for (int t = 0; t < 5; ++t) cfg.colsb[t] = 64;
        _tile_loadconfig(&cfg);
        alignas(64) uint16_t b[2][16 * 32];
        float* c = static_cast<float*>(std::aligned_alloc(64, blocks * 256 * sizeof(float)));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            std::memset(c, 0, blocks * 256 * sizeof(float));
            W(t, 0, b[0]);
            for (int64_t k = 0; k < chunks; ++k) {
                _tile_loadd(2, b[k & 1], 64);
                for (int64_t r = 0; r + 1 < blocks; ++r) {
                    _tile_loadd(0, c + r * 256, 64);
                    _tile_loadd(1, x + r * 16 * K + k * 32, K * 2);
                    _tile_dpbf16ps(0, 1, 2);
                    _tile_stored(0, c + r * 256, 64);
                }
                const int64_t r = blocks - 1;
                _tile_loadd(3, c + r * 256, 64);
                _tile_loadd(4, x + r * 16 * K + k * 32, K * 2);
                _tile_dpbf16ps(3, 4, 2);
                _tile_stored(3, c + r * 256, 64);
                if (k + 1 < chunks) W(t, k + 1, b[(k + 1) & 1]);
            }
            store_rows(c, M, y + t * 16, N);
        }
        std::free(c);
        _tile_release();
    }
}

// Up to 16 rows of 4-bit weights: the B tiles hold the codes themselves (``code_tile``) and each group's float32
// sums x . q are scaled once: y = sum over groups of scale * (x . q) + (zero - 8 * scale) * sum(x). The weight's
// float math, done per weight in ``Int4Tiles``, becomes two FMAs a row a group. Groups alternate between two sum
// tiles (tmm0, tmm1), so that one group's sums are scaled while the next group's multiply; a chunk's B tile is made
// while the one before multiplies.
void int4_grouped(const uint16_t* x, const uint8_t* codes, const uint32_t* sz, uint16_t* y, int64_t M, int64_t K,
                  int64_t N, int64_t group) {
    const int64_t tiles = N / 16, chunks = K / 32, per_group = group / 32, groups = K / group;
    float* xsum = group_sums(x, M, K, group);
#pragma omp parallel
    {
        const __m512i table = code_table();
        TileConfig cfg;
        cfg.rows[0] = cfg.rows[1] = cfg.rows[3] = M;  // sums (two), rows of x
        cfg.rows[6] = 16;                             // codes
        cfg.colsb[0] = cfg.colsb[1] = cfg.colsb[3] = cfg.colsb[6] = 64;
        _tile_loadconfig(&cfg);
        alignas(64) uint16_t b[2][16 * 32];
        alignas(64) float c[2][16 * 16];
        __m512 acc[16];  // the rows' outputs, in registers (the loops over rows unrolled)
        auto scale = [&](const float* sums, int64_t t, int64_t g) {
            __m512 s, off;
            scale_offset(sz + (t * groups + g) * 16, s, off);
#pragma GCC unroll 16
            for (int r = 0; r < 16; ++r)
                if (r < M)
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * groups + g]), off,
                                             _mm512_fmadd_ps(_mm512_load_ps(sums + r * 16), s, acc[r]));
        };
#define KVLOOM_INT4_GROUP(TMM, t, g)                                                                    \
        for (int64_t k = (g) * per_group; k < ((g) + 1) * per_group; ++k) {                          \
            _tile_loadd(6, b[k & 1], 64);                                                             \
            _tile_loadd(3, x + k * 32, K * 2);                                                        \
            _tile_dpbf16ps(TMM, 3, 6);                                                                \
            if (k + 1 < chunks) code_tile(codes + ((t) * chunks + k + 1) * 256, table, b[(k + 1) & 1]); \
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
#pragma GCC unroll 16
            for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
            code_tile(codes + t * chunks * 256, table, b[0]);
            for (int64_t g = 0; g < groups; g += 2) {
                _tile_zero(0);
                KVLOOM_INT4_GROUP(0, t, g)
                if (g > 0) scale(c[1], t, g - 1);  // the group before, stored at the end of the last pass
                if (g + 1 < groups) {
                    _tile_zero(1);
                    KVLOOM_INT4_GROUP(1, t, g + 1)
                }
                _tile_stored(0, c[0], 64);
                scale(c[0], t, g);
                if (g + 1 < groups) _tile_stored(1, c[1], 64);
            }
            if (groups % 2 == 0) scale(c[1], t, groups - 1);
#pragma GCC unroll 16
            for (int r = 0; r < 16; ++r)
                if (r < M)
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * N + t * 16),
                                        (__m256i)_mm512_cvtneps_pbh(acc[r]));
        }
#undef KVLOOM_INT4_GROUP
        _tile_release();
    }
    std::free(xsum);
}

template <typename Tiles>
void matmul(const uint16_t* x, const Tiles& W, uint16_t* y, int64_t M, int64_t K, int64_t N) {
    if (M <= 32)
        few_rows(x, W, y, M, K, N);
    else
        many_rows(x, W, y, M, K, N);
}
#else
// Without AMX, the same loops on AVX512-BF16's dot products: a B tile's row p (output j's weights of inputs 2p and
// 2p + 1 in words 2j and 2j + 1) is one vdpbf16ps operand, and each row's pair of inputs is broadcast against it.

// accumulators a row keeps, so that a few rows still give the dot products' latency enough independent chains (12
// hide it; two a row up to 9 rows still fit the registers beside the grouped loop's sums: 8 rows 10 % faster)
template <int R> constexpr int SPLIT = R >= 10 ? 1 : R >= 4 ? 2 : R >= 2 ? 4 : 8;

// A buffer of the calling thread's, grown as needed and kept (freed when the thread ends): a step calls the kernel
// ~100 times.
struct Scratch {
    void* buffers[3] = {nullptr, nullptr, nullptr};
    size_t sizes[3] = {0, 0, 0};
    ~Scratch() {
        for (void* b : buffers) std::free(b);
    }
};

inline void* scratch(int which, size_t bytes) {
    thread_local Scratch s;
    if (s.sizes[which] < bytes) {
        std::free(s.buffers[which]);
        s.sizes[which] = (bytes + 4095) / 4096 * 4096;
        s.buffers[which] = std::aligned_alloc(64, s.sizes[which]);
    }
    return s.buffers[which];
}

// Rows x [R, K] as their pairs of inputs, pair-major: out[j * R + r] holds row r's inputs 2j and 2j + 1 (pairs j0
// to j1, all by default). A dot product then broadcasts each row's pair from one pointer and a constant offset (from
// R row pointers, the loops ran out of registers for addresses).
inline void pack_pairs(const uint16_t* x, int64_t R, int64_t K, int32_t* out, int64_t j0 = 0, int64_t j1 = -1) {
    if (j1 < 0) j1 = K / 2;
    for (int64_t r = 0; r < R; ++r) {
        const int32_t* row = reinterpret_cast<const int32_t*>(x + r * K);
        for (int64_t j = j0; j < j1; ++j) out[j * R + r] = row[j];
    }
}

inline void store_bf16(uint16_t* y, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(v));
}

// R rows (their pairs ``xp``, ``pack_pairs``) by one column of B tiles b (chunks x 16 rows x 32 words) into y
// (stride N), bf16
template <int R>
void dot_rows(const int32_t* xp, const uint16_t* b, int64_t chunks, uint16_t* y, int64_t N) {
    constexpr int A = SPLIT<R>;
    __m512 acc[A][R];
    for (int a = 0; a < A; ++a)
        for (int r = 0; r < R; ++r) acc[a][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < chunks; ++k) {
        const uint16_t* bk = b + k * 512;
        const int32_t* xk = xp + k * 16 * R;
#pragma GCC unroll 16
        for (int p = 0; p < 16; ++p) {
            const __m512bh w = (__m512bh)_mm512_load_si512(bk + p * 32);
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r)
                acc[p % A][r] = _mm512_dpbf16_ps(acc[p % A][r], w, (__m512bh)_mm512_set1_epi32(xk[p * R + r]));
        }
    }
    for (int r = 0; r < R; ++r) {
        __m512 sum = acc[0][r];
        for (int a = 1; a < A; ++a) sum = _mm512_add_ps(sum, acc[a][r]);
        store_bf16(y + r * N, sum);
    }
}

#define KVLOOM_BY_ROWS(F, M, ...)                                                                               \
    switch (M) {                                                                                                \
        case 1: F<1>(__VA_ARGS__); break;   case 2: F<2>(__VA_ARGS__); break;   case 3: F<3>(__VA_ARGS__); break;   \
        case 4: F<4>(__VA_ARGS__); break;   case 5: F<5>(__VA_ARGS__); break;   case 6: F<6>(__VA_ARGS__); break;   \
        case 7: F<7>(__VA_ARGS__); break;   case 8: F<8>(__VA_ARGS__); break;   case 9: F<9>(__VA_ARGS__); break;   \
        case 10: F<10>(__VA_ARGS__); break; case 11: F<11>(__VA_ARGS__); break; case 12: F<12>(__VA_ARGS__); break; \
        case 13: F<13>(__VA_ARGS__); break; case 14: F<14>(__VA_ARGS__); break; case 15: F<15>(__VA_ARGS__); break; \
        default: F<16>(__VA_ARGS__); break;                                                                     \
    }

// Any rows: a column of B tiles dequantized once (``W(t, k, out)``, all of K) for every row, the rows in blocks of
// at most 16 and of even size (17 rows: 9 + 8, not 16 + 1, whose lone row would wait on its chain's latency).
template <typename Tiles>
void matmul(const uint16_t* x, const Tiles& tiles_in, uint16_t* y, int64_t M, int64_t K, int64_t N) {
    const int64_t tiles = N / 16, chunks = K / 32, blocks = (M + 15) / 16;
    int32_t* xp = static_cast<int32_t*>(scratch(0, M * K * 2));
    for (int64_t i = 0; i < blocks; ++i)  // each block's pairs, pair-major within the block
        pack_pairs(x + i * M / blocks * K, (i + 1) * M / blocks - i * M / blocks, K, xp + i * M / blocks * (K / 2));
#pragma omp parallel
    {
        const Tiles W = tiles_in;  // a thread's own copy: its fields stay in registers (bf16 stores may alias a ref)
        uint16_t* b = static_cast<uint16_t*>(scratch(1, chunks * 512 * sizeof(uint16_t)));  // the thread's own
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            for (int64_t k = 0; k < chunks; ++k) W(t, k, b + k * 512);
            for (int64_t i = 0, r0 = 0; i < blocks; ++i) {
                const int64_t r1 = (i + 1) * M / blocks;
                KVLOOM_BY_ROWS(dot_rows, r1 - r0, xp + r0 * (K / 2), b, chunks, y + r0 * N + t * 16, N)
                r0 = r1;
            }
        }
    }
}

// The 4-bit weights, as the AMX loop does up to 16 rows: the codes themselves as bf16 integers (a table lookup, in
// registers) and each group's float32 sums scaled once, y = sum over groups of scale * (x . q) + offset * sum(x).
// One tile (16 outputs) for R rows (their pairs ``xp``, pair-major, and group sums ``xsum``, [groups, M]).
template <int R>
void grouped_tile(const int32_t* xp, const uint8_t* codes, const uint32_t* sz, const float* xsum, int64_t M,
                  uint16_t* y, int64_t N, int64_t groups, int64_t per_group, __m512i table) {
    constexpr int A = SPLIT<R>;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m512 gs[A][R];
        for (int a = 0; a < A; ++a)
            for (int r = 0; r < R; ++r) gs[a][r] = _mm512_setzero_ps();
        for (int64_t k = g * per_group; k < (g + 1) * per_group; ++k) {
            const uint8_t* c = codes + k * 256;
            const int32_t* xk = xp + k * 16 * R;
            // 8 chunks ahead (past the tile's end: the next tile's): ~20 % at 8 to 32 rows over the prefetcher's own
            for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(c + 2048 + l * 64), _MM_HINT_T0);
#pragma GCC unroll 8
            for (int h = 0; h < 8; ++h) {  // B rows 2h (low nibbles) and 2h + 1: inputs 4h.. and 4h + 2..
                const __m512i v = _mm512_cvtepu8_epi16(
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + h * 32)));
                const __m512bh w0 = (__m512bh)_mm512_permutexvar_epi16(v, table);
                const __m512bh w1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
#pragma GCC unroll 16
                for (int r = 0; r < R; ++r)
                    gs[(2 * h) % A][r] = _mm512_dpbf16_ps(gs[(2 * h) % A][r], w0,
                                                          (__m512bh)_mm512_set1_epi32(xk[2 * h * R + r]));
#pragma GCC unroll 16
                for (int r = 0; r < R; ++r)
                    gs[(2 * h + 1) % A][r] = _mm512_dpbf16_ps(gs[(2 * h + 1) % A][r], w1,
                                                              (__m512bh)_mm512_set1_epi32(xk[(2 * h + 1) * R + r]));
            }
        }
        __m512 s, off;
        scale_offset(sz + g * 16, s, off);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
            __m512 sum = gs[0][r];
            for (int a = 1; a < A; ++a) sum = _mm512_add_ps(sum, gs[a][r]);
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[g * M + r]), off, _mm512_fmadd_ps(sum, s, acc[r]));
        }
    }
    for (int r = 0; r < R; ++r) store_bf16(y + r * N, acc[r]);
}

// Any rows, in even blocks of at most 16 (17 rows: 9 + 8, not 16 + 1): each block's pairs and group sums made by
// the team, then each tile's codes read once for every block while they are in cache.
void int4_grouped(const uint16_t* x, const uint8_t* codes, const uint32_t* sz, uint16_t* y, int64_t M, int64_t K,
                  int64_t N, int64_t group) {
    const int64_t tiles = N / 16, chunks = K / 32, groups = K / group, blocks = (M + 15) / 16;
    int32_t* xp = static_cast<int32_t*>(scratch(0, M * K * 2));
    float* xsum = static_cast<float*>(scratch(1, M * groups * sizeof(float)));
    const auto pack = [&](int64_t g) {  // group g's pairs of each block, and each row's sum over it
        for (int64_t i = 0; i < blocks; ++i) {
            const int64_t r0 = i * M / blocks, rows = (i + 1) * M / blocks - r0;
            pack_pairs(x + r0 * K, rows, K, xp + r0 * (K / 2), g * group / 2, (g + 1) * group / 2);
        }
        for (int64_t r = 0; r < M; ++r) xsum[g * M + r] = sum_bf16(x + r * K + g * group, group);
    };
    const bool shared = M > 16;  // a few rows are packed sooner than the team would meet at a barrier
    if (!shared)
        for (int64_t g = 0; g < groups; ++g) pack(g);
#pragma omp parallel
    {
        if (shared) {
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; ++g) pack(g);  // by groups: a thread writes whole cache lines of a block
        }
        const __m512i table = code_table();
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t)
            for (int64_t i = 0, r0 = 0; i < blocks; ++i) {
                const int64_t r1 = (i + 1) * M / blocks;
                KVLOOM_BY_ROWS(grouped_tile, r1 - r0, xp + r0 * (K / 2), codes + t * chunks * 256, sz + t * groups * 16,
                               xsum + r0, M, y + r0 * N + t * 16, N, groups, group / 32, table)
                r0 = r1;
            }
    }
}

// 8-bit inputs (``kvloom_int4_q8_mm``), as llama.cpp multiplies its 4-bit blocks: each row's 32 inputs of a chunk
// rounded to int8 with one scale d (max |x| / 127), multiplied by the codes on vpdpbusd (u8 codes by s8 inputs, four
// products a lane: twice vdpbf16ps's) and each chunk's integer sums scaled, y = sum over chunks of scale * d * (q .
// xq) + offset * d * sum(xq): the weights times the rounded inputs. (The offsets over the exact inputs' sums would
// weigh each input's rounding by its code, 0..15, rather than by its weight: twice the error, measured.)

// Chunks c0..c1 (one group) of rows x [R, K] quantized: out[(c * 8 + h) * R + r] holds row r's inputs 32c + 4h ..
// 32c + 4h + 3 as int8, d[c * M + r] its scale, xsum[r] the group's rounded inputs summed. A row at a time (a step
// of a few rows takes this; ``quantize_rows`` puts more side by side).
inline void quantize_each_row(const uint16_t* x, int64_t R, int64_t K, int32_t* out, float* d, float* xsum,
                              int64_t M, int64_t c0, int64_t c1) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t r = 0; r < R; ++r) {
        float sum = 0.0f;
        for (int64_t c = c0; c < c1; ++c) {
            const uint16_t* xc = x + r * K + c * 32;
            const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc))), 16));
            const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc + 16))), 16));
            const float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
            const __m512 inv = _mm512_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
            const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
            const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
            alignas(32) int32_t quads[8];
            _mm_store_si128(reinterpret_cast<__m128i*>(quads), _mm512_cvtepi32_epi8(qlo));
            _mm_store_si128(reinterpret_cast<__m128i*>(quads + 4), _mm512_cvtepi32_epi8(qhi));
            for (int h = 0; h < 8; ++h) out[(c * 8 + h) * R + r] = quads[h];
            const float scale = m / 127.0f;
            d[c * M + r] = scale;
            sum += static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi))) * scale;
        }
        xsum[r] = sum;
    }
}

// Lane j of the result: v[j]'s 16 lanes reduced by ``op`` (a transposing tree: 46 instructions for 16 vectors, not
// ~8 a vector one at a time)
template <typename V, typename Op>
inline V reduce16(V (&v)[16], Op op) {
    V w[8], u[4], y[2];
    for (int k = 0; k < 8; ++k)  // lanes 0-7: v[2k]'s halves reduced, 8-15: v[2k + 1]'s
        w[k] = op(V(_mm512_shuffle_i32x4(__m512i(v[2 * k]), __m512i(v[2 * k + 1]), 0x44)),
                  V(_mm512_shuffle_i32x4(__m512i(v[2 * k]), __m512i(v[2 * k + 1]), 0xEE)));
    for (int k = 0; k < 4; ++k)  // quarter i: v[4k + i]'s, 4 lanes
        u[k] = op(V(_mm512_shuffle_i32x4(__m512i(w[2 * k]), __m512i(w[2 * k + 1]), 0x88)),
                  V(_mm512_shuffle_i32x4(__m512i(w[2 * k]), __m512i(w[2 * k + 1]), 0xDD)));
    for (int k = 0; k < 2; ++k)  // quarter i: lanes 0-1 v[8k + i]'s, 2-3 v[8k + 4 + i]'s
        y[k] = op(V(_mm512_unpacklo_epi64(__m512i(u[2 * k]), __m512i(u[2 * k + 1]))),
                  V(_mm512_unpackhi_epi64(__m512i(u[2 * k]), __m512i(u[2 * k + 1]))));
    // quarter i: v[i], v[4 + i], v[8 + i], v[12 + i] (each lane pair's sum); put in order
    const __m512 y0 = __m512(y[0]), y1 = __m512(y[1]);
    const V z = op(V(_mm512_shuffle_ps(y0, y1, 0x88)), V(_mm512_shuffle_ps(y0, y1, 0xDD)));
    return V(_mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15),
                                      __m512i(z)));
}

// Chunks c0..c1 (one group) of rows x [R, K] quantized as ``quantize_each_row`` does (R <= 16), the rows side by
// side in a vector's lanes for the maxima, scales and sums, and the codes transposed in registers to their layout
// (4,096 x 1,536 inputs by one tile on a 2-core Zen 5: 1.13 against 1.81 ms). Fewer than 4 rows go a row at a time.
inline void quantize_rows(const uint16_t* x, int64_t R, int64_t K, int32_t* out, float* d, float* xsum, int64_t M,
                          int64_t c0, int64_t c1) {
    if (R < 4) return quantize_each_row(x, R, K, out, d, xsum, M, c0, c1);
    const __m512 sign = _mm512_set1_ps(-0.0f);
    const __mmask16 rows = static_cast<__mmask16>((1u << R) - 1);
    const auto half = [&](int64_t r, int64_t c, int h) {  // inputs 32c + 16h .. + 15 of row r, as float32
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * K + c * 32 + 16 * h))), 16));
    };
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c = c0; c < c1; ++c) {
        __m512 a[16];
#pragma GCC unroll 16
        for (int r = 0; r < 16; ++r)
            a[r] = r < R ? _mm512_max_ps(_mm512_andnot_ps(sign, half(r, c, 0)), _mm512_andnot_ps(sign, half(r, c, 1)))
                         : _mm512_setzero_ps();
        const __m512 m = reduce16(a, [](__m512 p, __m512 q) { return _mm512_max_ps(p, q); });
        const __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(m, _mm512_setzero_ps(), _CMP_GT_OQ),
                                               _mm512_set1_ps(127.0f), m);
        const __m512 scale = _mm512_div_ps(m, _mm512_set1_ps(127.0f));
        alignas(64) int32_t quads[16][8];  // row r's 32 codes
        __m512i s[16];
#pragma GCC unroll 16
        for (int r = 0; r < 16; ++r) {
            if (r >= R) {
                s[r] = _mm512_setzero_si512();
                continue;
            }
            const __m512 f = _mm512_permutexvar_ps(_mm512_set1_epi32(r), inv);
            const __m512i lo = _mm512_cvtps_epi32(_mm512_mul_ps(half(r, c, 0), f));
            const __m512i hi = _mm512_cvtps_epi32(_mm512_mul_ps(half(r, c, 1), f));
            _mm_store_si128(reinterpret_cast<__m128i*>(quads[r]), _mm512_cvtepi32_epi8(lo));
            _mm_store_si128(reinterpret_cast<__m128i*>(quads[r] + 4), _mm512_cvtepi32_epi8(hi));
            s[r] = _mm512_add_epi32(lo, hi);
        }
        const __m512i isum = reduce16(s, [](__m512i p, __m512i q) { return _mm512_add_epi32(p, q); });
        sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, sum);
        _mm512_mask_storeu_ps(d + c * M, rows, scale);
        // [16 rows][8 quads] -> out [8][R]: rows j and j + 8 side by side, an 8 x 8 transpose in each half
        __m512i z[8], t[8], u[8];
        for (int j = 0; j < 8; ++j)
            z[j] = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_load_si256(reinterpret_cast<const __m256i*>(quads[j]))),
                _mm256_load_si256(reinterpret_cast<const __m256i*>(quads[j + 8])), 1);
        for (int k = 0; k < 4; ++k) {
            t[2 * k] = _mm512_unpacklo_epi32(z[2 * k], z[2 * k + 1]);
            t[2 * k + 1] = _mm512_unpackhi_epi32(z[2 * k], z[2 * k + 1]);
        }
        for (int k = 0; k < 2; ++k) {
            u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
            u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
            u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
            u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
        }
        for (int i = 0; i < 4; ++i) {  // u[i]: quads i and i + 4 of rows 0-3 and 8-11; u[4 + i] of rows 4-7, 12-15
            const __m512i lo = _mm512_shuffle_i32x4(u[i], u[4 + i], 0x88);
            const __m512i hi = _mm512_shuffle_i32x4(u[i], u[4 + i], 0xDD);
            _mm512_mask_storeu_epi32(out + (c * 8 + i) * R, rows, _mm512_shuffle_i32x4(lo, lo, 0xD8));
            _mm512_mask_storeu_epi32(out + (c * 8 + i + 4) * R, rows, _mm512_shuffle_i32x4(hi, hi, 0xD8));
        }
    }
    _mm512_mask_storeu_ps(xsum, rows, sum);
}

constexpr int Q8_ROWS = 12;  // rows a block: its sums and results, two registers a row, fit beside the codes
template <int R> constexpr int Q8_SPLIT = R >= 4 ? 1 : 2;  // chains a row: a few rows still hide the latency

// The weights q8_tile multiplies, one tile's: a chunk's codes as eight vpdpbusd operands (lane j: output j's codes
// of inputs 4h .. 4h + 3, unsigned bytes) and W = code * scale + offset per group of chunks.
struct Int4Quads {  // the 4-bit codes (``pack_codes``), a scale and zero per group
    const uint8_t* codes;
    const uint32_t* sz;
    int64_t per_group;
    static constexpr int64_t chunk_bytes = 256;
    inline __m512i quad(const uint8_t* c, int h) const {
        // pair h's bytes 2j, 2j + 1 hold output j's inputs 4h .. 4h + 3 in their low and high nibbles:
        // (v | v << 12) & 0x0f0f0f0f
        const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + h * 32)));
        return _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), _mm512_set1_epi32(0x0f0f0f0f), 0xA8);
    }
    inline void scale_offset(int64_t g, __m512& s, __m512& off) const { ::scale_offset(sz + g * 16, s, off); }
};

struct Int8Quads {  // GGUF's Q8_0 codes plus 128 (``pack_q8_quads``), one fp16 scale d per chunk: W = d * (u - 128)
    const uint8_t* codes;
    const uint16_t* scales;  // the tile's first, [chunks, N]
    int64_t N;
    static constexpr int64_t per_group = 1, chunk_bytes = 512;
    inline __m512i quad(const uint8_t* c, int h) const { return _mm512_loadu_si512(c + h * 64); }
    inline void scale_offset(int64_t g, __m512& s, __m512& off) const {
        s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + g * N)));
        off = _mm512_mul_ps(s, _mm512_set1_ps(-128.0f));
    }
};

// Where q8_tile puts row r's 16 results: bf16 into y (rows N apart)
struct StoreRows {
    uint16_t* y;
    int64_t N;
    inline void operator()(int r, __m512 v) const { store_bf16(y + r * N, v); }
};

// float32 into a block's buffer (a gate tile, before its up tile)
struct KeepRows {
    float* buf;
    inline void operator()(int r, __m512 v) const { _mm512_storeu_ps(buf + 16 * r, v); }
};

inline __m512 round_bf16(__m512 v) {  // v rounded to bf16 as a stored result is, back in float32
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// StoreRows' bf16 values widened to float32 in y (rows N apart): logits, as the sampler reads them, without a second
// pass to widen them; streamed past the caches (each store a whole line of its row; scattered rows' read-for-ownership
// made the two-pass head 0.3-0.8 ms slower a 32-row step)
struct StoreFloatRows {
    float* y;
    int64_t N;
    inline void operator()(int r, __m512 v) const { _mm512_stream_ps(y + r * N, round_bf16(v)); }
};

// e^x: 2^n * 2^f with n = round(x log2 e), |f| <= 1/2, 2^f by its degree-6 Taylor polynomial in f ln 2 (rel. error
// < 2e-7); scalef takes n to 0 or infinity where e^x leaves float's range, as expf does
inline __m512 exp_ps(__m512 x) {
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    constexpr float coef[6] = {1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};
    for (int i = 0; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(coef[i]));
    return _mm512_scalef_ps(p, n);
}

// silu(gate) * up into y (bf16, rows N apart), gate and up each rounded to bf16 first as the two results of the
// unfused matmul are, the product in float32 rounded once as the compiled step's elementwise kernel does
struct GluRows {
    const float* gate;
    uint16_t* y;
    int64_t N;
    inline void operator()(int r, __m512 v) const {
        const __m512 g = round_bf16(_mm512_loadu_ps(gate + 16 * r));
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 sig = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f), e));
        store_bf16(y + r * N, _mm512_mul_ps(_mm512_mul_ps(g, sig), round_bf16(v)));
    }
};

// One tile (16 outputs) for R rows of 8-bit inputs (their quads ``xq``, scales ``d`` and group sums ``xsum``), each
// row's results handed to ``out``.
template <int R, typename W, typename Out>
void q8_tile(const int32_t* xq, const float* d, const W& w_in, const float* xsum, int64_t M, int64_t groups,
             const Out& out) {
    constexpr int A = Q8_SPLIT<R>;
    const W w = w_in;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m512 s, off;
        w.scale_offset(g, s, off);
        for (int64_t k = g * w.per_group; k < (g + 1) * w.per_group; ++k) {
            const uint8_t* c = w.codes + k * W::chunk_bytes;
            const int32_t* xk = xq + k * 8 * R;
            for (int l = 0; l < W::chunk_bytes / 64; ++l)  // 8 chunks ahead, as the bf16 loop
                _mm_prefetch(reinterpret_cast<const char*>(c + 8 * W::chunk_bytes + l * 64), _MM_HINT_T0);
            __m512i S[A][R];
            for (int a = 0; a < A; ++a)
                for (int r = 0; r < R; ++r) S[a][r] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int h = 0; h < 8; ++h) {
                const __m512i q = w.quad(c, h);
#pragma GCC unroll 16
                for (int r = 0; r < R; ++r)
                    S[h % A][r] = _mm512_dpbusd_epi32(S[h % A][r], q, _mm512_set1_epi32(xk[h * R + r]));
            }
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) {
                __m512i sum = S[0][r];
                for (int a = 1; a < A; ++a) sum = _mm512_add_epi32(sum, S[a][r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(s, _mm512_set1_ps(d[k * M + r])),
                                         acc[r]);
            }
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[g * M + r]), off, acc[r]);
    }
    for (int r = 0; r < R; ++r) out(r, acc[r]);
}

#define KVLOOM_BY_Q8_ROWS(F, M, ...)                                                                                \
    switch (M) {                                                                                                    \
        case 1: F<1>(__VA_ARGS__); break;   case 2: F<2>(__VA_ARGS__); break;   case 3: F<3>(__VA_ARGS__); break;   \
        case 4: F<4>(__VA_ARGS__); break;   case 5: F<5>(__VA_ARGS__); break;   case 6: F<6>(__VA_ARGS__); break;   \
        case 7: F<7>(__VA_ARGS__); break;   case 8: F<8>(__VA_ARGS__); break;   case 9: F<9>(__VA_ARGS__); break;   \
        case 10: F<10>(__VA_ARGS__); break; case 11: F<11>(__VA_ARGS__); break; default: F<12>(__VA_ARGS__); break; \
    }

// Any rows, in even blocks of at most Q8_ROWS, quantized by the team beyond 16 rows; the blocks in spans of
// Q8_SPAN rows (their inputs stay in a core's L2 while every tile's codes pass over them). ``tile(t)``: tile t's
// weights (Int4Quads, Int8Quads), their groups of ``group`` inputs. With ``glu``, y [M, N / 2] is silu of outputs
// [0, N / 2) times outputs [N / 2, N) (a gate and up projection's halves): each gate tile's results kept for its up
// tile's, a block at a time.
constexpr int64_t Q8_SPAN = 16 * Q8_ROWS;

template <typename Tile, typename Y>
void q8_matmul(const uint16_t* x, Tile tile, Y* y, int64_t M, int64_t K, int64_t N, int64_t group,
               bool glu = false) {
    using Rows = std::conditional_t<std::is_same_v<Y, float>, StoreFloatRows, StoreRows>;
    const int64_t tiles = glu ? N / 32 : N / 16, chunks = K / 32, groups = K / group, per_group = group / 32;
    const int64_t stride = glu ? N / 2 : N;
    const int64_t blocks = (M + Q8_ROWS - 1) / Q8_ROWS;
    int32_t* xq = static_cast<int32_t*>(scratch(0, M * K));
    float* xsum = static_cast<float*>(scratch(1, M * groups * sizeof(float)));
    float* d = static_cast<float*>(scratch(2, M * chunks * sizeof(float)));
    const auto pack = [&](int64_t g) {  // group g's inputs of each block, quantized, and each row's sum over it
        for (int64_t i = 0; i < blocks; ++i) {
            const int64_t r0 = i * M / blocks, rows = (i + 1) * M / blocks - r0;
            quantize_rows(x + r0 * K, rows, K, xq + r0 * (K / 4), d + r0, xsum + g * M + r0, M, g * per_group,
                          (g + 1) * per_group);
        }
    };
    const bool shared = M > 16;
    if (!shared)
        for (int64_t g = 0; g < groups; ++g) pack(g);
    const int64_t span_blocks = Q8_SPAN / Q8_ROWS;
#pragma omp parallel
    {
        if (shared) {
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; ++g) pack(g);
        }
        for (int64_t b0 = 0; b0 < blocks; b0 += span_blocks) {
            const int64_t b1 = b0 + span_blocks < blocks ? b0 + span_blocks : blocks;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tiles; ++t) {
                const auto w = tile(t);
                for (int64_t i = b0; i < b1; ++i) {
                    const int64_t r0 = i * M / blocks, r1 = (i + 1) * M / blocks;
                    const Rows rows{y + r0 * stride + t * 16, stride};
                    if (!glu) {
                        KVLOOM_BY_Q8_ROWS(q8_tile, r1 - r0, xq + r0 * (K / 4), d + r0, w, xsum + r0, M, groups, rows)
                        if constexpr (std::is_same_v<Y, float>) _mm_sfence();  // the streamed stores, done
                        continue;
                    }
                    if constexpr (std::is_same_v<Y, uint16_t>) {  // the GLU's epilogue writes bf16
                        alignas(64) float gate[Q8_ROWS * 16];
                        KVLOOM_BY_Q8_ROWS(q8_tile, r1 - r0, xq + r0 * (K / 4), d + r0, w, xsum + r0, M, groups,
                                          KeepRows{gate})
                        KVLOOM_BY_Q8_ROWS(q8_tile, r1 - r0, xq + r0 * (K / 4), d + r0, tile(t + tiles), xsum + r0,
                                          M, groups, (GluRows{gate, rows.y, stride}))
                    }
                }
            }
        }
    }
}
#undef KVLOOM_BY_Q8_ROWS
#undef KVLOOM_BY_ROWS
#endif

}  // namespace

extern "C" int kvloom_int4_amx_ready() {
#ifdef KVLOOM_AMX
    // ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): without it the first tile instruction faults
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : 0;
#else
    return 1;
#endif
}

// 1: the loops run on AMX's tiles; 2: on AVX512-BF16's dot products
extern "C" int kvloom_int4_amx_kind() {
#ifdef KVLOOM_AMX
    return 1;
#else
    return 2;
#endif
}

// y [M, N] = x [M, K] @ W.T, x and y bf16; 0 done, 1 a shape it does not take
extern "C" int kvloom_int4_amx_mm(const uint16_t* x, const uint8_t* codes, const uint16_t* scale_zeros, uint16_t* y,
                                  int64_t M, int64_t K, int64_t N, int64_t group) {
    if (M < 1 || N % 16 || K % 32 || group % 32 || K % group) return 1;
    const uint32_t* sz = reinterpret_cast<const uint32_t*>(scale_zeros);
#ifdef KVLOOM_AMX
    if (M > 16) {  // GROUPED_ROWS
        matmul(x, Int4Tiles{codes, sz, K / group, K / 32, group / 32}, y, M, K, N);
        return 0;
    }
#endif
    int4_grouped(x, codes, sz, y, M, K, N, group);
    return 0;
}

// The 8-bit input loop over the 4-bit codes (``q8_matmul``): y [M, N], or with ``glu`` [M, N / 2] (its epilogue)
static inline int int4_q8(const uint16_t* x, const uint8_t* codes, const uint16_t* scale_zeros, uint16_t* y, int64_t M,
                          int64_t K, int64_t N, int64_t group, bool glu) {
    if (M < 1 || N % (glu ? 32 : 16) || K % 32 || group % 32 || K % group) return 1;
#ifdef KVLOOM_AMX
    return 2;
#else
    const uint32_t* sz = reinterpret_cast<const uint32_t*>(scale_zeros);
    const int64_t chunks = K / 32, groups = K / group;
    q8_matmul(x, [=](int64_t t) { return Int4Quads{codes + t * chunks * 256, sz + t * groups * 16, group / 32}; },
              y, M, K, N, group, glu);
    return 0;
#endif
}

// kvloom_int4_amx_mm with each row's inputs rounded to 8 bits a chunk of 32: 2 where this build has no such loop
extern "C" int kvloom_int4_q8_mm(const uint16_t* x, const uint8_t* codes, const uint16_t* scale_zeros, uint16_t* y,
                                 int64_t M, int64_t K, int64_t N, int64_t group) {
    return int4_q8(x, codes, scale_zeros, y, M, K, N, group, false);
}

// y [M, N / 2] = silu(g) * u of [g, u] = x [M, K] @ W.T (``kvloom_int4_q8_mm``'s, N / 2 outputs each)
extern "C" int kvloom_int4_q8_glu(const uint16_t* x, const uint8_t* codes, const uint16_t* scale_zeros, uint16_t* y,
                                  int64_t M, int64_t K, int64_t N, int64_t group) {
    return int4_q8(x, codes, scale_zeros, y, M, K, N, group, true);
}

// y [M, N] = x [M, K] @ W.T of GGUF's Q8_0 weights with each row's inputs rounded to 8 bits a chunk of 32: codes
// plus 128 as ``pack_q8_quads`` lays them out, scales fp16 [K / 32, N]; y bf16, or (``float_out``) those values as
// float32
extern "C" int kvloom_int8_q8_mm(const uint16_t* x, const uint8_t* codes, const uint16_t* scales, void* y,
                                 int64_t M, int64_t K, int64_t N, int64_t float_out) {
    if (M < 1 || N % 16 || K % 32 || (float_out && reinterpret_cast<uintptr_t>(y) % 64)) return 1;  // streamed lines
#ifdef KVLOOM_AMX
    return 2;
#else
    const int64_t chunks = K / 32;
    const auto tile = [=](int64_t t) { return Int8Quads{codes + t * chunks * 512, scales + t * 16, N}; };
    if (float_out)
        q8_matmul(x, tile, static_cast<float*>(y), M, K, N, 32);
    else
        q8_matmul(x, tile, static_cast<uint16_t*>(y), M, K, N, 32);
    return 0;
#endif
}

extern "C" int kvloom_int8_amx_mm(const uint16_t* x, const int8_t* codes, const uint16_t* scales, uint16_t* y,
                                  int64_t M, int64_t K, int64_t N) {
    if (M < 1 || N % 16 || K % 32) return 1;
    matmul(x, Int8Tiles{codes, scales, N, K / 32}, y, M, K, N);
    return 0;
}
#else
extern "C" int kvloom_int4_amx_ready() { return 0; }
extern "C" int kvloom_int4_amx_kind() { return 0; }
extern "C" int kvloom_int4_amx_mm(const uint16_t*, const uint8_t*, const uint16_t*, uint16_t*, int64_t, int64_t,
                                  int64_t, int64_t) { return 2; }
extern "C" int kvloom_int4_q8_mm(const uint16_t*, const uint8_t*, const uint16_t*, uint16_t*, int64_t, int64_t,
                                 int64_t, int64_t) { return 2; }
extern "C" int kvloom_int4_q8_glu(const uint16_t*, const uint8_t*, const uint16_t*, uint16_t*, int64_t, int64_t,
                                  int64_t, int64_t) { return 2; }
extern "C" int kvloom_int8_q8_mm(const uint16_t*, const uint8_t*, const uint16_t*, void*, int64_t, int64_t,
                                 int64_t, int64_t) { return 2; }
extern "C" int kvloom_int8_amx_mm(const uint16_t*, const int8_t*, const uint16_t*, uint16_t*, int64_t, int64_t,
                                  int64_t) { return 2; }
#endif
"""

_lock = threading.Lock()
_lib = None  # the loaded library (its functions set up), False where building, loading or AMX's permission failed


def _load():
    global _lib
    lib = _lib
    if lib is not None:  # built (or refused) already: no lock on the path every matmul takes
        return lib
    with _lock:
        if _lib is None:
            _lib = _build()  # assigned once whole: a caller without the lock sees None or the result
    return _lib


def _build():
    """The loaded library, its functions set up; False where it may not run here."""
    if os.environ.get("KVLOOM_CPU_INT4_AMX", "1") == "0" or not _cpu_has_bf16_dot():
        return False
    try:
        lib = ctypes.CDLL(build_library("int4_amx", _SOURCE))
        if lib.kvloom_int4_amx_ready() != 1:
            logger.info("CPU: AMX is listed but this process may not use it (the kernel refused "
                        "ARCH_REQ_XCOMP_PERM); 4-bit weights keep torch's matmul")
            return False
        lib.kvloom_int4_amx_kind.restype = ctypes.c_int
        for fn, sizes in ((lib.kvloom_int4_amx_mm, 4), (lib.kvloom_int4_q8_mm, 4), (lib.kvloom_int4_q8_glu, 4),
                          (lib.kvloom_int8_amx_mm, 3), (lib.kvloom_int8_q8_mm, 4)):
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * sizes
        return lib
    except Exception as exc:  # noqa: BLE001 - no compiler or a failed build: torch's kernel serves
        logger.warning("CPU 4-bit matmul kernel unavailable (%s: %s); 4-bit weights keep torch's matmul",
                       type(exc).__name__, str(exc)[:300])
        return False


def _cpu_has_bf16_dot() -> bool:
    get = getattr(getattr(torch._C, "_cpu", None), "_get_cpu_capability", None)
    caps = get() if get is not None else {}
    return bool(caps.get("avx512_bf16"))


def available() -> bool:
    """Whether the kernel is built and may run here (building it on the first call)."""
    return bool(_load())


def grouped_rows() -> int:
    """The most rows a call multiplies by the codes themselves (each group's sums scaled) here: ``GROUPED_ROWS`` on
    AMX, any number on the dot products (which dequantize no 4-bit tile)."""
    return GROUPED_ROWS if on_amx() else sys.maxsize


def q8_inputs(gguf: bool = True) -> bool:
    """Whether the 4-bit layers of a GGUF file (``gguf``), or of an AWQ/GPTQ checkpoint, take their inputs at 8 bits
    here (``int4_q8_mm``): on the dot products only (not AMX's tiles). ``KVLOOM_CPU_INT8_INPUTS`` unset: a GGUF
    file's layers (llama.cpp computes its files so; AWQ/GPTQ keep bf16 inputs, as vLLM computes them); 1: both;
    0: neither."""
    setting = os.environ.get("KVLOOM_CPU_INT8_INPUTS", "")
    if setting not in ("", "0", "1"):
        raise ValueError(f"KVLOOM_CPU_INT8_INPUTS={setting!r}: expected 0 (bf16 inputs) or 1 (8-bit inputs for "
                         "every 4-bit format), or unset (GGUF files' only)")
    wanted = setting == "1" or (setting == "" and gguf)
    return wanted and available() and not on_amx()


def on_amx() -> bool:
    """Whether the loops run on AMX's tiles (else, where ``available()``, on AVX512-BF16's dot products)."""
    lib = _load()
    return bool(lib) and lib.kvloom_int4_amx_kind() == 1


def supports(out_features: int, in_features: int, group: int) -> bool:
    return out_features % OUTPUTS == 0 and group % INPUTS == 0 and in_features % group == 0


def serves(out_features: int, in_features: int, group: int, dtype: torch.dtype) -> bool:
    """Whether a layer of this shape and dtype gets the kernel's copy of its codes: bf16, this shape, and the kernel
    here (the engine's attach and the held-bytes count both ask this)."""
    return dtype == torch.bfloat16 and supports(out_features, in_features, group) and available()


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (0..15) as the kernel reads them: uint8 [N / 16, K / 32, 8, 32], each chunk of 32 inputs a
    B tile's 16 rows in pairs. Word ``2j + e`` of B row ``p`` is output ``j``'s code of input ``2p + e``; byte ``i``
    of pair ``h`` holds word ``i`` of rows ``2h`` (low nibble) and ``2h + 1`` (high)."""
    n, k = q.shape
    words = (q.to(torch.uint8).reshape(n // OUTPUTS, OUTPUTS, k // INPUTS, INPUTS // 2, 2)
             .permute(0, 2, 3, 1, 4).reshape(n // OUTPUTS, k // INPUTS, INPUTS // 4, 2, 2 * OUTPUTS))
    return (words[:, :, :, 0] | (words[:, :, :, 1] << 4)).contiguous()


def pack_scale_zeros(scale_zeros: torch.Tensor) -> torch.Tensor:
    """``cpu_int4.pack_int4``'s scales and zeros [K / group, N, 2] as the kernel reads them: [N / 16, K / group, 16,
    2], a tile's groups one after another."""
    groups, n, _ = scale_zeros.shape
    return scale_zeros.reshape(groups, n // OUTPUTS, OUTPUTS, 2).transpose(0, 1).contiguous()


def int4_amx_mm(x: torch.Tensor, codes: torch.Tensor, scale_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """``x @ W.T`` of bf16 ``x`` [M, K] with ``W`` packed by ``pack_codes`` and ``pack_scale_zeros``."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"int4_amx_mm multiplies bfloat16 rows, got {x.dtype}")
    return _checked("int4_amx_mm", x, *_run(_load().kvloom_int4_amx_mm, x, codes, scale_zeros, group), group)


def int4_q8_mm(x: torch.Tensor, codes: torch.Tensor, scale_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """``int4_amx_mm`` with each row's inputs rounded to int8 a chunk of 32 (one scale each, max |x| / 127) and
    multiplied on 8-bit dot products (``q8_inputs()`` tells whether this build has them)."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"int4_q8_mm multiplies bfloat16 rows, got {x.dtype}")
    return _checked("int4_q8_mm", x, *_run(_load().kvloom_int4_q8_mm, x, codes, scale_zeros, group), group)


def int4_q8_glu(x: torch.Tensor, codes: torch.Tensor, scale_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """``silu(g) * u`` of ``[g, u] = int4_q8_mm(x, ...)`` (a merged gate and up projection) in the matmul's epilogue:
    [M, N / 2], ``g`` and ``u`` rounded to bf16 first as the two-step result is, the product rounded once."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"int4_q8_glu multiplies bfloat16 rows, got {x.dtype}")
    y, rc = _run(_load().kvloom_int4_q8_glu, x, codes, scale_zeros, group, outputs=codes.shape[0] * OUTPUTS // 2)
    return _checked("int4_q8_glu", x, y, rc, group, pairs=True)


def _checked(name: str, x: torch.Tensor, y: torch.Tensor, rc: int, group: int | None = None,
             pairs: bool = False) -> torch.Tensor:
    """``y`` where kernel ``name`` returned 0; else the error its return code stands for (1: a shape it does not
    take, named with its limits; 2: a loop this build lacks). ``pairs``: ``y`` holds one output a pair of the
    codes' (a gate and up projection's halves)."""
    if rc == 1:
        outputs, multiple = (2 * y.shape[1], 2 * OUTPUTS) if pairs else (y.shape[1], OUTPUTS)
        rule = (f", group {group}; outputs must be a multiple of {multiple} and the group of {INPUTS})" if group
                else f"; outputs must be a multiple of {multiple} and inputs of {INPUTS})")
        raise ValueError(f"{name}: unsupported shape ({x.shape[0]} x {x.shape[1]} by {outputs}{rule}")
    if rc:
        raise ValueError(f"{name}: this build has no 8-bit input loop (AMX's)")
    return y


def _run(fn, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *args,
         outputs: int | None = None, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, int]:
    """Kernel ``fn`` on bf16 rows ``x`` into a new result of ``outputs`` columns (the codes' outputs unless
    given) and ``dtype``, and its return code; the kernel is told the codes' outputs."""
    rows, in_features = x.shape
    width = codes.shape[0] * OUTPUTS
    y = torch.empty(rows, width if outputs is None else outputs, dtype=dtype)
    if rows == 0:
        return y, 0
    x = x.contiguous()
    return y, fn(x.data_ptr(), codes.data_ptr(), scales.data_ptr(), y.data_ptr(), rows, in_features, width, *args)


def pack_q8_codes(q: torch.Tensor) -> torch.Tensor:
    """8-bit codes [N, K] (int8) as ``q8_amx_mm`` reads them: int8 [N / 16, K / 32, 16, 32], a tile's 16 input
    pairs of 32 bytes each, byte 2j + e holding output j's code of the pair's input e."""
    n, k = q.shape
    q = q.to(torch.int8).reshape(n // OUTPUTS, OUTPUTS, k // INPUTS, INPUTS // 2, 2)
    return q.permute(0, 2, 3, 1, 4).reshape(n // OUTPUTS, k // INPUTS, INPUTS // 2, 2 * OUTPUTS).contiguous()


def pack_q8_quads(q: torch.Tensor) -> torch.Tensor:
    """8-bit codes [N, K] (int8) as ``q8_q8_mm`` reads them: uint8 [N / 16, K / 32, 8, 64], the codes plus 128, byte
    4j + i of a chunk's quad h holding output j's code of input 4h + i (a ``vpdpbusd`` operand as it lies)."""
    n, k = q.shape
    u = (q.to(torch.int16) + 128).to(torch.uint8).reshape(n // OUTPUTS, OUTPUTS, k // INPUTS, 8, 4)
    return u.permute(0, 2, 3, 1, 4).reshape(n // OUTPUTS, k // INPUTS, 8, 4 * OUTPUTS).contiguous()


def q8_q8_mm(x: torch.Tensor, quads: torch.Tensor, scales: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``q8_amx_mm`` with each row's inputs rounded to int8 a chunk of 32 (as ``int4_q8_mm``), the codes laid out
    by ``pack_q8_quads``: where ``q8_inputs()``. ``out_dtype`` float32: the same bf16 results widened as they are
    stored (an output projection's logits, which the sampler reads in float32)."""
    if x.dtype != torch.bfloat16 or scales.dtype != torch.float16:
        raise TypeError(f"q8_q8_mm multiplies bfloat16 rows by float16 scales, got {x.dtype} and {scales.dtype}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"q8_q8_mm writes bfloat16 or float32, not {out_dtype}")
    return _checked("q8_q8_mm", x, *_run(_load().kvloom_int8_q8_mm, x, quads, scales,
                                         int(out_dtype == torch.float32), dtype=out_dtype))


def q8_supports(out_features: int, in_features: int) -> bool:
    return out_features % OUTPUTS == 0 and in_features % INPUTS == 0


def q8_serves(out_features: int, in_features: int, dtype: torch.dtype) -> bool:
    """Whether a bf16 layer of this shape keeps its 8-bit codes for the kernel here (attach and byte counts ask)."""
    return dtype == torch.bfloat16 and q8_supports(out_features, in_features) and available()


def q8_copy_bytes(out_features: int, in_features: int, dtype: torch.dtype) -> int:
    """The 8-bit copy ``q8_serves`` layers keep: a byte a weight and an fp16 scale per 32 (0 where none is kept)."""
    if not q8_serves(out_features, in_features, dtype):
        return 0
    return out_features * in_features + out_features * (in_features // INPUTS) * 2


def q8_amx_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` of bf16 ``x`` [M, K] with ``W = d * q`` of 8-bit codes ``q`` packed by ``pack_q8_codes`` and one
    fp16 scale ``d`` per output and 32 inputs (``scales`` [K / 32, N], GGUF's Q8_0 blocks)."""
    if x.dtype != torch.bfloat16 or scales.dtype != torch.float16:
        raise TypeError(f"q8_amx_mm multiplies bfloat16 rows by float16 scales, got {x.dtype} and {scales.dtype}")
    return _checked("q8_amx_mm", x, *_run(_load().kvloom_int8_amx_mm, x, codes, scales))
