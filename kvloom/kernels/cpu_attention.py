"""Decode attention that reads the paged KV cache in place on the CPU.

The batched-matmul formula (``CPUAttentionBackend._decode``) first gathers every decode row's blocks into one
contiguous ``[B, Hkv, L, D]`` copy per layer, K and V: at 32 streams on SmolLM2 that copy moves ~140 MB a
step and took more time than the attention itself. This kernel walks each row's block table instead and
reads each cached K/V row once, where it lies: one work item per (row, KV head, span of blocks), the query heads
that share the KV head computed together, an online softmax in float32 over the span, and the spans of a row
merged at the end (so one long sequence still spreads over every thread).

It is C++ built with the machine's compiler the first time (``kvloom.kernels.cpu_build``: ``-O3 -march=native
-ffast-math -fopenmp``, cached by source, compiler and CPU) and loaded with ctypes; its OpenMP loops run on torch's
own OpenMP runtime and thread count. Where no build works (no C++ compiler), ``available()`` is False
and the backend keeps the gather. The op is registered as ``kvloom::paged_decode`` so the compiled decode step
calls it as one opaque node.

The same library rotates a bf16 step's q and k and writes its K/V rows to the cache in one pass (``rope_write``,
``kvloom::cpu_rope_write``, which writes the cache where it lies): the compiled steps' own loops for the rotary and
``index_copy_`` took 24 us a layer at 32 rows, against ~8 here.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import torch

from kvloom.kernels import cpu_ops
from kvloom.kernels.cpu_build import build_library

logger = logging.getLogger("kvloom")

# blocks one work item reads: a row of more spreads over several items (merged afterwards)
SPAN_BLOCKS = 8

_SOURCE = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <omp.h>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

inline float bf16_to_float(uint16_t h) {
    uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN stays NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
    return static_cast<uint16_t>(bits >> 16);
}

// exp as plain arithmetic, so the softmax loops vectorize (a libm call a score was half the kernel's time):
// 2^n * e^r with n = round(x / ln 2), |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (rel. error < 3e-7)
inline float fast_exp(float x) {
    x = std::max(x, -87.f);
    const float n = std::nearbyint(x * 1.44269504088896341f);
    const float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
    float p = 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return p * scale;
}

template <typename T> inline float load(const T* p, int64_t i);
template <> inline float load<float>(const float* p, int64_t i) { return p[i]; }
template <> inline float load<uint16_t>(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }

template <typename T> inline void store(T* p, int64_t i, float v);
template <> inline void store<float>(float* p, int64_t i, float v) { p[i] = v; }
template <> inline void store<uint16_t>(uint16_t* p, int64_t i, float v) { p[i] = float_to_bf16(v); }

constexpr int MAX_GROUP = 16;
constexpr int MAX_DIM = 256;
constexpr int MAX_BLOCK = 256;
constexpr float NEG = -1e30f;  // finite: inductor's flags may assume finite math

// Block ``blk`` of a row's table: the rows [lo, hi) of it that the row attends (positions in [start, end)),
// and the cache row where head h's part of the block starts.
inline int64_t block_rows(const int32_t* table, int64_t blk, int64_t bs, int64_t start, int64_t end, int64_t Hkv,
                          int64_t h, int64_t& lo, int64_t& hi) {
    lo = std::max<int64_t>(start - blk * bs, 0);
    hi = std::min<int64_t>(end - blk * bs, bs);
    return (static_cast<int64_t>(table[blk]) * Hkv + h) * bs;
}

// One head's block of scores s[lo, hi) into the running softmax: the running max m and sum l, and the output
// accumulator acc rescaled to the new max; s becomes the block's exp(score - m).
template <int D>
inline void online_softmax(float* s, int64_t lo, int64_t hi, float& m, float& l, float* acc) {
    float mx = m;
    for (int64_t t = lo; t < hi; ++t) mx = std::max(mx, s[t]);
    const float c = fast_exp(m - mx);  // 0 on the first block (m = NEG)
    m = mx;
    float sum = 0.f;
    for (int64_t t = lo; t < hi; ++t) {
        s[t] = fast_exp(s[t] - mx);
        sum += s[t];
    }
    l = l * c + sum;
    for (int d = 0; d < D; ++d) acc[d] *= c;
}

// One (row, KV head, span): G query heads over the span's cached positions in [start, end).
// Writes the span's unnormalized output acc[G][D], its running max m[G] and sum l[G].
template <typename T, int D>
void span(const T* q, const T* kc, const T* vc, const int32_t* table, int64_t start, int64_t end,
          int64_t blk0, int64_t blk1, int64_t h, int64_t G, int64_t Hkv, int64_t bs,
          float scale, float softcap, float* acc, float* m_out, float* l_out) {
    float qf[MAX_GROUP][D];
    float s[MAX_GROUP][MAX_BLOCK];
    float m[MAX_GROUP], l[MAX_GROUP];
    for (int64_t g = 0; g < G; ++g) {
        const T* qg = q + (h * G + g) * D;
        for (int d = 0; d < D; ++d) qf[g][d] = load(qg, d) * scale;
        for (int d = 0; d < D; ++d) acc[g * D + d] = 0.f;
        m[g] = NEG;
        l[g] = 0.f;
    }
    for (int64_t blk = blk0; blk < blk1; ++blk) {
        int64_t lo, hi;
        const int64_t row = block_rows(table, blk, bs, start, end, Hkv, h, lo, hi);
        if (lo >= hi) continue;
        const T* kb = kc + row * D;
        const T* vb = vc + row * D;
        for (int64_t t = lo; t < hi; ++t) {
            float kf[D];
            for (int d = 0; d < D; ++d) kf[d] = load(kb + t * D, d);
            for (int64_t g = 0; g < G; ++g) {
                float dot = 0.f;
                for (int d = 0; d < D; ++d) dot += qf[g][d] * kf[d];
                if (softcap > 0.f) dot = softcap * std::tanh(dot / softcap);
                s[g][t] = dot;
            }
        }
        for (int64_t g = 0; g < G; ++g) online_softmax<D>(s[g], lo, hi, m[g], l[g], acc + g * D);
        for (int64_t t = lo; t < hi; ++t) {
            float vf[D];
            for (int d = 0; d < D; ++d) vf[d] = load(vb + t * D, d);
            for (int64_t g = 0; g < G; ++g) {
                const float p = s[g][t];
                float* a = acc + g * D;
                for (int d = 0; d < D; ++d) a[d] += p * vf[d];
            }
        }
    }
    for (int64_t g = 0; g < G; ++g) { m_out[g] = m[g]; l_out[g] = l[g]; }
}

// The work item a thread runs next: its blocks [blk0, blk1) of KV head h through ``table`` (none where blk0 >= blk1).
struct NextItem {
    const int32_t* table;
    int64_t blk0, blk1, h;
};

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define KVLOOM_AVX512_BF16 1

// lane j of the result: the sum of a[j]'s 16 lanes (a transposing tree: ~3 instructions a vector, not ~8 each)
inline __m512 sum16(const __m512* a) {
    __m512 x[8], y[4], z[2];
    for (int i = 0; i < 8; ++i)
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        const __m512d u = _mm512_castps_pd(x[2 * i]), w = _mm512_castps_pd(x[2 * i + 1]);
        y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(u, w)), _mm512_castpd_ps(_mm512_unpackhi_pd(u, w)));
    }
    for (int i = 0; i < 2; ++i)
        z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
}

// heads whose value accumulators (2 * D / 32 vectors each) fit 16 registers
template <int D> constexpr int PV_HEADS = 16 / (D / 16) > 0 ? 16 / (D / 16) : 1;

// probabilities as bf16 a head: a row's slots [lo, hi) and a zero at hi, so a pair read at hi - 1 ends in 0
constexpr int PB_STRIDE = MAX_BLOCK + 16;

// acc[g] += p[g][t] * V[t] over rows [lo, hi) for NG heads, accumulators in registers: two rows at a time, their
// values interleaved as bf16 pairs and their probabilities a bf16 pair (``pb``, rounded from the float32 softmax as
// the reference formula casts probabilities to the cache's dtype), one dot-product instruction per 16 lanes. Lane
// 4k + j of each run of 16 accumulates dimension 8k + j (the first 16 of a 32-run) or 8k + 4 + j (the second): see
// span_bf16's end.
template <int D, int NG>
inline void pv_block(const uint16_t* vb, int64_t lo, int64_t hi, const uint16_t* pb, float* acc) {
    constexpr int C = D / 32;
    __m512 a[NG][2 * C];
    for (int g = 0; g < NG; ++g)
        for (int c = 0; c < 2 * C; ++c) a[g][c] = _mm512_loadu_ps(acc + g * D + 16 * c);
    for (int64_t t = lo; t < hi; t += 2) {
        const bool pair = t + 1 < hi;
        __m512i vlo[C], vhi[C];
        for (int c = 0; c < C; ++c) {
            const __m512i v0 = _mm512_loadu_si512(vb + t * D + 32 * c);
            const __m512i v1 = pair ? _mm512_loadu_si512(vb + (t + 1) * D + 32 * c) : _mm512_setzero_si512();
            vlo[c] = _mm512_unpacklo_epi16(v0, v1);
            vhi[c] = _mm512_unpackhi_epi16(v0, v1);
        }
        for (int g = 0; g < NG; ++g) {
            int32_t bits;
            std::memcpy(&bits, pb + g * PB_STRIDE + t, 4);
            const __m512bh pp = (__m512bh)_mm512_set1_epi32(bits);
            for (int c = 0; c < C; ++c) {
                a[g][2 * c] = _mm512_dpbf16_ps(a[g][2 * c], (__m512bh)vlo[c], pp);
                a[g][2 * c + 1] = _mm512_dpbf16_ps(a[g][2 * c + 1], (__m512bh)vhi[c], pp);
            }
        }
    }
    for (int g = 0; g < NG; ++g)
        for (int c = 0; c < 2 * C; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, a[g][c]);
}

template <int D>
inline void pv_heads(const uint16_t* vb, int64_t lo, int64_t hi, const uint16_t* pb, float* acc, int64_t ng) {
    switch (ng) {
        case 1: pv_block<D, 1>(vb, lo, hi, pb, acc); return;
        case 2: if constexpr (PV_HEADS<D> >= 2) { pv_block<D, 2>(vb, lo, hi, pb, acc); return; } break;
        case 3: if constexpr (PV_HEADS<D> >= 3) { pv_block<D, 3>(vb, lo, hi, pb, acc); return; } break;
        case 4: if constexpr (PV_HEADS<D> >= 4) { pv_block<D, 4>(vb, lo, hi, pb, acc); return; } break;
        case 5: if constexpr (PV_HEADS<D> >= 5) { pv_block<D, 5>(vb, lo, hi, pb, acc); return; } break;
        case 6: if constexpr (PV_HEADS<D> >= 6) { pv_block<D, 6>(vb, lo, hi, pb, acc); return; } break;
        case 7: if constexpr (PV_HEADS<D> >= 7) { pv_block<D, 7>(vb, lo, hi, pb, acc); return; } break;
        case 8: if constexpr (PV_HEADS<D> >= 8) { pv_block<D, 8>(vb, lo, hi, pb, acc); return; } break;
    }
}

// blocks span_bf16 requests ahead: 30 layers of 32 rows x 160 positions 8 % faster than one (2 or 4: ~3 %; 6 slower)
constexpr int64_t PREFETCH_BLOCKS = 3;

// span<> for a bfloat16 cache with AVX512-BF16: scores as bf16 pair dot products, 16 keys summed at once; values
// through pv_block, which leaves acc's lanes permuted within each 32: put back in order at the end.
template <int D>
void span_bf16(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int32_t* table, int64_t start,
               int64_t end, int64_t blk0, int64_t blk1, int64_t h, int64_t G, int64_t Hkv, int64_t bs,
               float scale, float softcap, float* acc, float* m_out, float* l_out, const NextItem& next) {
    constexpr int C = D / 32;
    __m512bh qb[MAX_GROUP][C];
    alignas(64) float s[MAX_GROUP][MAX_BLOCK];
    alignas(64) uint16_t pb[MAX_GROUP][PB_STRIDE];
    float m[MAX_GROUP], l[MAX_GROUP];
    for (int64_t g = 0; g < G; ++g) {
        for (int c = 0; c < C; ++c) qb[g][c] = (__m512bh)_mm512_loadu_si512(q + (h * G + g) * D + 32 * c);
        for (int d = 0; d < D; ++d) acc[g * D + d] = 0.f;
        m[g] = NEG;
        l[g] = 0.f;
    }
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t blk = blk0; blk < blk1; ++blk) {
        int64_t lo, hi;
        const int64_t row = block_rows(table, blk, bs, start, end, Hkv, h, lo, hi);
        if (lo >= hi) continue;
        const uint16_t* kb = kc + row * D;
        const uint16_t* vb = vc + row * D;
        // K and V requested PREFETCH_BLOCKS blocks ahead in this thread's order (the rest of this item's blocks,
        // then the next item's; an item's first blocks at its start): misses bound the loop (written out here: as a
        // lambda the loop ran ~50 % slower)
        for (int64_t ahead = blk == blk0 ? 1 : PREFETCH_BLOCKS; ahead <= PREFETCH_BLOCKS; ++ahead) {
            const int64_t b = blk + ahead, nb = next.blk0 + (b - blk1);
            if (b >= blk1 && nb >= next.blk1) break;
            const int64_t first = b < blk1 ? (static_cast<int64_t>(table[b]) * Hkv + h) * bs * D
                                           : (static_cast<int64_t>(next.table[nb]) * Hkv + next.h) * bs * D;
            for (int64_t off = 0; off < bs * D; off += 32) {
                _mm_prefetch(reinterpret_cast<const char*>(kc + first + off), _MM_HINT_T0);
                _mm_prefetch(reinterpret_cast<const char*>(vc + first + off), _MM_HINT_T0);
            }
        }
        // whole tiles of 16 rows from the block's 16-row boundaries (bs is a multiple of 16): rows outside
        // [lo, hi) are scored too, in lanes of their own, and never read
        for (int64_t t0 = lo & ~int64_t(15); t0 < hi; t0 += 16) {
            for (int64_t g = 0; g < G; ++g) {
                __m512 a[16];
                for (int j = 0; j < 16; ++j) {
                    a[j] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[g][0],
                                            (__m512bh)_mm512_loadu_si512(kb + (t0 + j) * D));
                    for (int c = 1; c < C; ++c)
                        a[j] = _mm512_dpbf16_ps(a[j], qb[g][c],
                                                (__m512bh)_mm512_loadu_si512(kb + (t0 + j) * D + 32 * c));
                }
                _mm512_storeu_ps(&s[g][t0], _mm512_mul_ps(sum16(a), vscale));
            }
        }
        for (int64_t g = 0; g < G; ++g) {
            if (softcap > 0.f)
                for (int64_t t = lo; t < hi; ++t) s[g][t] = softcap * std::tanh(s[g][t] / softcap);
            online_softmax<D>(s[g], lo, hi, m[g], l[g], acc + g * D);
            for (int64_t t = lo; t < hi; t += 16) {  // round to bf16 (nearest even), 16 at once
                const __mmask16 k = static_cast<__mmask16>(hi - t >= 16 ? 0xffff : (1u << (hi - t)) - 1);
                const __m256i b = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(k, &s[g][t]));
                _mm256_mask_storeu_epi16(&pb[g][t], k, b);
            }
            pb[g][hi] = 0;
        }
        for (int64_t g0 = 0; g0 < G; g0 += PV_HEADS<D>)
            pv_heads<D>(vb, lo, hi, &pb[g0][0], acc + g0 * D, std::min<int64_t>(PV_HEADS<D>, G - g0));
    }
    // acc lane 4k + j of a 32-lane run held dimension 8k + j, lane 16 + 4k + j dimension 8k + 4 + j
    for (int64_t g = 0; g < G; ++g) {
        float ordered[D];
        float* a = acc + g * D;
        for (int c = 0; c < C; ++c)
            for (int k = 0; k < 4; ++k)
                for (int j = 0; j < 4; ++j) {
                    ordered[32 * c + 8 * k + j] = a[32 * c + 4 * k + j];
                    ordered[32 * c + 8 * k + 4 + j] = a[32 * c + 16 + 4 * k + j];
                }
        for (int d = 0; d < D; ++d) a[d] = ordered[d];
        m_out[g] = m[g];
        l_out[g] = l[g];
    }
}
#endif

template <typename T, int D>
void decode(const T* q, const T* kc, const T* vc, const int32_t* tables, int64_t table_stride,
            const int64_t* starts, const int64_t* ends, const float* sinks, T* out,
            int64_t B, int64_t Hq, int64_t Hkv, int64_t bs, int64_t span_blocks, float scale, float softcap,
            int fast) {
    const int64_t G = Hq / Hkv;
    int64_t spans = 1;
    for (int64_t b = 0; b < B; ++b) {
        const int64_t blocks = (ends[b] + bs - 1) / bs - starts[b] / bs;
        spans = std::max(spans, (blocks + span_blocks - 1) / span_blocks);
    }
    // per (row, head, span): acc[G][D], m[G], l[G]
    const int64_t item = G * D + 2 * G;
    std::vector<float> buffer(B * Hkv * spans * item);
    float* work = buffer.data();
    const int64_t items = B * Hkv * spans;
    const auto blocks_of = [&](int64_t i, int64_t& b, int64_t& h, int64_t& blk0, int64_t& blk1) {
        b = i / (Hkv * spans);
        h = (i / spans) % Hkv;
        blk0 = starts[b] / bs + (i % spans) * span_blocks;
        blk1 = std::min(blk0 + span_blocks, (ends[b] + bs - 1) / bs);
    };
    // Items in runs that the threads take in turn (a core that another process holds up takes fewer); a thread takes
    // its next run before the last item of this one, so that it always knows which item's K/V to prefetch.
    const int64_t run = std::max<int64_t>(1, items / (4 * omp_get_max_threads()));
    const int64_t runs = (items + run - 1) / run;
    std::atomic<int64_t> taken{0};
#pragma omp parallel
    for (int64_t r = taken.fetch_add(1); r < runs;) {
        const int64_t run_end = std::min(items, (r + 1) * run);
        int64_t r_next = runs;
        for (int64_t i = r * run; i < run_end; ++i) {
            int64_t b, h, blk0, blk1, next_b = 0;
            blocks_of(i, b, h, blk0, blk1);
            NextItem next{tables, 0, 0, 0};
            if (i + 1 == run_end) r_next = taken.fetch_add(1);
            const int64_t j = i + 1 < run_end ? i + 1 : r_next < runs ? r_next * run : -1;
            if (j >= 0) {
                blocks_of(j, next_b, next.h, next.blk0, next.blk1);
                next.table = tables + next_b * table_stride;
            }
            float* w = work + i * item;
            if (blk0 >= blk1) {  // a row shorter than the longest: this span is empty
                for (int64_t g = 0; g < G; ++g) { w[G * D + g] = NEG; w[G * D + G + g] = 0.f; }
                continue;
            }
#ifdef KVLOOM_AVX512_BF16
            if constexpr (sizeof(T) == 2 && D % 32 == 0) {
                if (fast && bs % 16 == 0) {
                    span_bf16<D>(q + b * Hq * D, kc, vc, tables + b * table_stride, starts[b], ends[b], blk0, blk1,
                                 h, G, Hkv, bs, scale, softcap, w, w + G * D, w + G * D + G, next);
                    continue;
                }
            }
#endif
            span<T, D>(q + b * Hq * D, kc, vc, tables + b * table_stride, starts[b], ends[b], blk0, blk1, h, G, Hkv,
                       bs, scale, softcap, w, w + G * D, w + G * D + G);
        }
        r = r_next;
    }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < B * Hkv; ++i) {
        const int64_t b = i / Hkv, h = i % Hkv;
        for (int64_t g = 0; g < G; ++g) {
            float mx = sinks ? sinks[h * G + g] : NEG;
            for (int64_t sp = 0; sp < spans; ++sp) mx = std::max(mx, work[(i * spans + sp) * item + G * D + g]);
            float total = sinks ? std::exp(sinks[h * G + g] - mx) : 0.f;
            float o[D];
            for (int d = 0; d < D; ++d) o[d] = 0.f;
            for (int64_t sp = 0; sp < spans; ++sp) {
                const float* w = work + (i * spans + sp) * item;
                if (w[G * D + G + g] == 0.f) continue;  // an empty span
                const float c = std::exp(w[G * D + g] - mx);
                total += w[G * D + G + g] * c;
                for (int d = 0; d < D; ++d) o[d] += w[g * D + d] * c;
            }
            const float inv = total > 0.f ? 1.f / total : 0.f;
            T* og = out + (b * Hq + h * G + g) * D;
            for (int d = 0; d < D; ++d) store(og, d, o[d] * inv);
        }
    }
}

template <typename T>
int dispatch(int64_t D, const void* q, const void* kc, const void* vc, const int32_t* tables, int64_t table_stride,
             const int64_t* starts, const int64_t* ends, const float* sinks, void* out, int64_t B,
             int64_t Hq, int64_t Hkv, int64_t bs, int64_t span_blocks, float scale, float softcap, int fast) {
#define KVLOOM_CASE(DIM) \
    case DIM: decode<T, DIM>(static_cast<const T*>(q), static_cast<const T*>(kc), static_cast<const T*>(vc), tables, \
                             table_stride, starts, ends, sinks, static_cast<T*>(out), B, Hq, Hkv, bs, \
                             span_blocks, scale, softcap, fast); return 0;
    switch (D) {
        KVLOOM_CASE(16) KVLOOM_CASE(32) KVLOOM_CASE(64) KVLOOM_CASE(80)
        KVLOOM_CASE(96) KVLOOM_CASE(128) KVLOOM_CASE(256)
        default: return 1;
    }
#undef KVLOOM_CASE
}


#ifdef KVLOOM_AVX512_BF16
// Causal attention of prompt rows over their K/V, bf16 (``prompt_attention``): query i of Q sees keys
// [0, S - Q + i]. A work item is (sequence, KV head, PROMPT_CHUNK queries): its keys transposed once (Kt: 16 keys a
// group, lane j holding key j's pair of dimensions p, so that a tile's scores are 16 keys a vector for each of 16
// queries) and its values copied contiguous (pv_block's rows); then for each query head of the group, tiles of 16
// queries over blocks of PROMPT_KEYS keys: scores, the online softmax of decode (online_softmax), the probabilities
// rounded to bf16 and pv_block.
constexpr int64_t PROMPT_CHUNK = 64;
constexpr int64_t PROMPT_KEYS = 64;

template <int D>
void prompt_item(const uint16_t* q, int64_t q_row, int64_t q_head, const uint16_t* k, int64_t k_row,
                 const uint16_t* v, int64_t v_row, uint16_t* out, int64_t o_row, int64_t Q, int64_t S, int64_t i_lo,
                 int64_t i_hi, int64_t G, float scale, std::vector<uint32_t>& kt, std::vector<uint16_t>& vc) {
    constexpr int P = D / 2;  // dimension pairs
    const int64_t offset = S - Q, kend = offset + i_hi, groups = (kend + 15) / 16;
    kt.assign(groups * P * 16, 0u);
    vc.resize((kend + 1) * D);
    for (int64_t t = 0; t < kend; ++t) {
        const uint32_t* row = reinterpret_cast<const uint32_t*>(k + t * k_row);
        uint32_t* dst = kt.data() + (t / 16) * P * 16 + t % 16;
        for (int p = 0; p < P; ++p) dst[p * 16] = row[p];
        std::memcpy(vc.data() + t * D, v + t * v_row, D * sizeof(uint16_t));
    }
    alignas(64) float s[16][PROMPT_KEYS];
    alignas(64) uint16_t pb[16][PB_STRIDE];
    alignas(64) float acc[16 * D];
    float m[16], l[16];
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t g = 0; g < G; ++g) {
        const uint16_t* qg = q + g * q_head;
        for (int64_t i0 = i_lo; i0 < i_hi; i0 += 16) {
            const int64_t nq = std::min<int64_t>(16, i_hi - i0), last = offset + i0 + nq;
            for (int64_t i = 0; i < 16; ++i) { m[i] = NEG; l[i] = 0.f; }
            std::memset(acc, 0, sizeof(acc));
            for (int64_t kb = 0; kb < last; kb += PROMPT_KEYS) {
                const int64_t nk = std::min<int64_t>(PROMPT_KEYS, last - kb);
                for (int64_t kg = 0; kg < (nk + 15) / 16; ++kg) {
                    const uint32_t* kp = kt.data() + ((kb / 16) + kg) * P * 16;
                    __m512 a[16];
                    for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
                    for (int p = 0; p < P; ++p) {
                        const __m512bh kv = (__m512bh)_mm512_loadu_si512(kp + p * 16);
#pragma GCC unroll 16
                        for (int i = 0; i < 16; ++i) {  // rows past nq repeat the last query: computed, never read
                            int32_t bits;
                            std::memcpy(&bits, qg + std::min<int64_t>(i0 + i, i0 + nq - 1) * q_row + 2 * p, 4);
                            a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_set1_epi32(bits), kv);
                        }
                    }
                    for (int i = 0; i < 16; ++i) _mm512_store_ps(&s[i][kg * 16], _mm512_mul_ps(a[i], vscale));
                }
                for (int64_t i = 0; i < nq; ++i) {
                    // the keys this query sees in the block: up to its own position
                    const int64_t seen = std::clamp<int64_t>(offset + i0 + i - kb + 1, 0, nk);
                    if (seen > 0) online_softmax<D>(s[i], 0, seen, m[i], l[i], acc + i * D);
                    for (int64_t t = 0; t < seen; t += 16) {
                        const __mmask16 mk = static_cast<__mmask16>(seen - t >= 16 ? 0xffff : (1u << (seen - t)) - 1);
                        const __m512 x = _mm512_maskz_loadu_ps(mk, &s[i][t]);
                        _mm256_mask_storeu_epi16(&pb[i][t], mk, (__m256i)_mm512_cvtneps_pbh(x));
                    }
                    std::memset(&pb[i][seen], 0, (nk + 1 - seen) * sizeof(uint16_t));
                }
                for (int64_t i = 0; i < nq; i += PV_HEADS<D>)
                    pv_heads<D>(vc.data() + kb * D, 0, nk, &pb[i][0], acc + i * D,
                                std::min<int64_t>(PV_HEADS<D>, nq - i));
            }
            // pv_block's lanes back in order (as span_bf16's end), divided by the softmax's sum
            for (int64_t i = 0; i < nq; ++i) {
                const float* a = acc + i * D;
                const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
                uint16_t* o = out + (i0 + i) * o_row + g * D;
                for (int c = 0; c < D / 32; ++c)
                    for (int kk = 0; kk < 4; ++kk)
                        for (int j = 0; j < 4; ++j) {
                            o[32 * c + 8 * kk + j] = float_to_bf16(a[32 * c + 4 * kk + j] * inv);
                            o[32 * c + 8 * kk + 4 + j] = float_to_bf16(a[32 * c + 16 + 4 * kk + j] * inv);
                        }
            }
        }
    }
}

template <int D>
void prompt(const uint16_t* q, const int64_t* qs, const uint16_t* k, const int64_t* ks, const uint16_t* v,
            const int64_t* vs, uint16_t* out, int64_t n, int64_t Q, int64_t S, int64_t Hq, int64_t Hkv, float scale) {
    const int64_t G = Hq / Hkv, chunks = (Q + PROMPT_CHUNK - 1) / PROMPT_CHUNK, items = n * Hkv * chunks;
#pragma omp parallel
    {
        std::vector<uint32_t> kt;
        std::vector<uint16_t> vc;
        // the last chunks of a sequence see the most keys: taken first
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; ++it) {
            const int64_t c = chunks - 1 - it % chunks, h = (it / chunks) % Hkv, j = it / (chunks * Hkv);
            const int64_t i_lo = c * PROMPT_CHUNK, i_hi = std::min(Q, i_lo + PROMPT_CHUNK);
            // qs/ks/vs: strides of (sequence, position, head) for q, (sequence, head, position) for k and v
            prompt_item<D>(q + j * qs[0] + h * G * qs[2], qs[1], qs[2], k + j * ks[0] + h * ks[1], ks[2],
                           v + j * vs[0] + h * vs[1], vs[2], out + j * Q * Hq * D + h * G * D, Hq * D, Q, S, i_lo,
                           i_hi, G, scale, kt, vc);
        }
    }
}
#endif

}  // namespace

extern "C" int kvloom_paged_decode(int dtype, int64_t D, const void* q, const void* kc, const void* vc,
                                   const int32_t* tables, int64_t table_stride, const int64_t* starts,
                                   const int64_t* ends, const float* sinks, void* out, int64_t B,
                                   int64_t Hq, int64_t Hkv, int64_t bs, int64_t span_blocks,
                                   float scale, float softcap, int fast) {
    if (Hq % Hkv != 0 || Hq / Hkv > MAX_GROUP || bs > MAX_BLOCK) return 2;
    if (dtype == 0)
        return dispatch<float>(D, q, kc, vc, tables, table_stride, starts, ends, sinks, out, B, Hq, Hkv, bs,
                               span_blocks, scale, softcap, fast);
    return dispatch<uint16_t>(D, q, kc, vc, tables, table_stride, starts, ends, sinks, out, B, Hq, Hkv, bs,
                              span_blocks, scale, softcap, fast);
}

// out [n, Q, Hq, D] (contiguous) = causal attention of bf16 q [n, Q, Hq, D] over k, v [n, Hkv, S, D] (strides in
// qs, ks, vs; the last dimension contiguous), query i at position S - Q + i. 1: a shape it does not take; 2: this build
// has no AVX512-BF16 path.
extern "C" int kvloom_prompt_attention(int64_t D, const void* q, const int64_t* qs, const void* k, const int64_t* ks,
                                       const void* v, const int64_t* vs, void* out, int64_t n, int64_t Q, int64_t S,
                                       int64_t Hq, int64_t Hkv, float scale) {
#ifdef KVLOOM_AVX512_BF16
    if (Hq % Hkv != 0 || Q > S || PROMPT_KEYS + 1 > PB_STRIDE) return 1;
    const auto* qq = static_cast<const uint16_t*>(q);
    const auto* kk = static_cast<const uint16_t*>(k);
    const auto* vv = static_cast<const uint16_t*>(v);
    auto* oo = static_cast<uint16_t*>(out);
    switch (D) {
        case 32: prompt<32>(qq, qs, kk, ks, vv, vs, oo, n, Q, S, Hq, Hkv, scale); return 0;
        case 64: prompt<64>(qq, qs, kk, ks, vv, vs, oo, n, Q, S, Hq, Hkv, scale); return 0;
        case 96: prompt<96>(qq, qs, kk, ks, vv, vs, oo, n, Q, S, Hq, Hkv, scale); return 0;
        case 128: prompt<128>(qq, qs, kk, ks, vv, vs, oo, n, Q, S, Hq, Hkv, scale); return 0;
        case 256: prompt<256>(qq, qs, kk, ks, vv, vs, oo, n, Q, S, Hq, Hkv, scale); return 0;
        default: return 1;
    }
#else
    return 2;
#endif
}

// Rotary embedding and the cache write in one pass, bf16: heads [T, H, D] of q (H = Hq) and k (Hkv), rows of
// q_row / k_row / v_row elements apart, each head's D contiguous and heads D apart; cos, sin [T, D] contiguous (sin's
// first half negated, ``rotary_tables``' form): x * cos + swap(x) * sin in float32 rounded once. Into q_out [T, Hq,
// D] and k_out [T, Hkv, D] (contiguous), and the rotated k and the v rows into the caches' rows write_rows[t * Hkv + h]
// (of D elements).
extern "C" void kvloom_rope_write(int64_t D, int64_t T, int64_t Hq, int64_t Hkv, const uint16_t* q, int64_t q_row,
                                  const uint16_t* k, int64_t k_row, const uint16_t* v, int64_t v_row,
                                  const uint16_t* cos, const uint16_t* sin, uint16_t* q_out, uint16_t* k_out,
                                  uint16_t* k_cache, uint16_t* v_cache, const int64_t* write_rows) {
    const int64_t half = D / 2;
    const auto rotate = [=](const uint16_t* x, const uint16_t* c, const uint16_t* s, uint16_t* out) {
        for (int64_t i = 0; i < D; ++i) {
            const float swapped = bf16_to_float(x[i < half ? i + half : i - half]);
            out[i] = float_to_bf16(bf16_to_float(x[i]) * bf16_to_float(c[i]) + swapped * bf16_to_float(s[i]));
        }
    };
#pragma omp parallel for schedule(static) if (T * (Hq + Hkv) >= 128)
    for (int64_t t = 0; t < T; ++t) {
        const uint16_t* c = cos + t * D;
        const uint16_t* s = sin + t * D;
        for (int64_t h = 0; h < Hq; ++h) rotate(q + t * q_row + h * D, c, s, q_out + (t * Hq + h) * D);
        for (int64_t h = 0; h < Hkv; ++h) {
            uint16_t* rotated = k_out + (t * Hkv + h) * D;
            rotate(k + t * k_row + h * D, c, s, rotated);
            const int64_t row = write_rows[t * Hkv + h];
            std::memcpy(k_cache + row * D, rotated, D * sizeof(uint16_t));
            std::memcpy(v_cache + row * D, v + t * v_row + h * D, D * sizeof(uint16_t));
        }
    }
}

// whether this build has the AVX512-BF16 path (the machine compiled for has those instructions)
extern "C" int kvloom_paged_decode_vectorized() {
#ifdef KVLOOM_AVX512_BF16
    return 1;
#else
    return 0;
#endif
}
"""

HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
MAX_GROUP = 16
MAX_BLOCK = 256
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# a bfloat16 cache on a CPU with AVX512-BF16 takes the hand-vectorized path (False: the portable loops, which
# KVLOOM_CPU_PAGED_DECODE=portable asks for, to compare the two)
VECTORIZED = os.environ.get("KVLOOM_CPU_PAGED_DECODE") != "portable"

# prompt rows in bf16 take ``prompt_attention`` where the AVX512-BF16 build serves (``KVLOOM_CPU_PROMPT_ATTENTION=0``:
# the backend's batched matmuls, to compare)
PROMPT_ENABLED = os.environ.get("KVLOOM_CPU_PROMPT_ATTENTION", "1") != "0"
PROMPT_HEAD_DIMS = (32, 64, 96, 128, 256)

_lock = threading.Lock()
_lib = None  # the loaded function, False once building or loading failed
_prompt = None  # the prompt kernel, False where this build has none (no AVX512-BF16)
_rope = None  # the rotary-and-cache-write kernel
_rope_built = False  # whether it is (a plain bool: the compiler reads it while tracing a step)


def _load():
    global _lib, _prompt, _rope, _rope_built
    if _lib is not None:  # built (or refused) already: no lock on the path every call takes
        return _lib
    with _lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL(build_library("paged_decode", _SOURCE))
                fn = lib.kvloom_paged_decode
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_int, ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] + \
                    [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5 + [ctypes.c_float] * 2 + [ctypes.c_int]
                prompt = lib.kvloom_prompt_attention
                prompt.restype = ctypes.c_int
                prompt.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 5 + [ctypes.c_float]
                _prompt = prompt if lib.kvloom_paged_decode_vectorized() == 1 else False
                rope = lib.kvloom_rope_write
                rope.restype = None
                rope.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_void_p, ctypes.c_int64] * 3 + [ctypes.c_void_p] * 7
                _rope, _rope_built = rope, True
                _lib = fn  # last: a caller without the lock sees the kernels set up once this is
            except Exception as exc:  # noqa: BLE001 - no compiler or a failed build: the gather path serves
                _lib = _prompt = _rope = False
                logger.warning("CPU paged decode attention unavailable (%s: %s); attention gathers the cache instead",
                               type(exc).__name__, str(exc)[:300])
    return _lib


def enabled() -> bool:
    """False where ``KVLOOM_CPU_PAGED_DECODE=0`` asks for the gather path (to compare)."""
    return os.environ.get("KVLOOM_CPU_PAGED_DECODE", "1") != "0"


def available() -> bool:
    """Whether the kernel is built (building it on the first call)."""
    return bool(_load())


def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether the kernel takes this cache and these heads (otherwise the gather path serves)."""
    return (dtype in _DTYPES and head_dim in HEAD_DIMS and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GROUP and block_size <= MAX_BLOCK)


def prompt_serves(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether ``prompt_attention`` takes prompt rows of this dtype and these heads here."""
    return (PROMPT_ENABLED and VECTORIZED and dtype == torch.bfloat16 and head_dim in PROMPT_HEAD_DIMS
            and num_heads % num_kv_heads == 0 and available() and bool(_prompt))


def prompt_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of bf16 prompt rows ``q`` ``[n, Q, Hq, D]`` at the last ``Q`` of ``S`` positions over
    ``keys``/``values`` ``[n, Hkv, S, D]`` (any strides, the last dimension contiguous): ``[n, Q, Hq, D]``. Scores and
    softmax in float32, the probabilities rounded to bf16 for the values' dot products, as decode rows are
    (``paged_decode``); where ``prompt_serves``."""
    n, length, num_heads, head_dim = q.shape
    num_kv_heads, total = keys.shape[1], keys.shape[2]
    out = torch.empty(n, length, num_heads, head_dim, dtype=q.dtype)
    if n == 0 or length == 0:
        return out
    if any(t.stride(-1) != 1 for t in (q, keys, values)):
        q, keys, values = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, keys, values))
    strides = [torch.tensor([t.stride(0), t.stride(1), t.stride(2)], dtype=torch.int64) for t in (q, keys, values)]
    rc = _prompt(head_dim, q.data_ptr(), strides[0].data_ptr(), keys.data_ptr(), strides[1].data_ptr(),
                 values.data_ptr(), strides[2].data_ptr(), out.data_ptr(), n, length, total, num_heads,
                 num_kv_heads, scale)
    if rc:
        raise ValueError(f"prompt_attention: unsupported shape (head_dim {head_dim}, heads {num_heads}/{num_kv_heads}, "
                         f"{length} queries over {total} keys; head_dim in {PROMPT_HEAD_DIMS}, at most as many queries "
                         "as keys)")
    return out


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 starts: torch.Tensor, ends: torch.Tensor, scale: float, softcap: float,
                 sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention of decode rows ``q`` ``[B, Hq, D]`` over their cached positions ``starts[b] <= p < ends[b]``
    (int64 ``[B]``), found through ``tables`` (int32 ``[B, W]``, block numbers) in ``k_cache``/``v_cache``
    ``[num_blocks, Hkv, bs, D]``. ``softcap`` 0: none; ``sinks`` (``[Hq]``): a logit per head that takes a share
    of the softmax and contributes no value."""
    if torch.compiler.is_compiling():  # one opaque op in a compiled step
        return _paged_decode_op(q, k_cache, v_cache, tables, starts, ends, scale, softcap, sinks)
    return _paged_decode(q, k_cache, v_cache, tables, starts, ends, scale, softcap, sinks)


def _paged_decode(q, k_cache, v_cache, tables, starts, ends, scale, softcap, sinks):
    fn = _load()
    batch, num_heads, head_dim = q.shape
    _, num_kv_heads, bs, _ = k_cache.shape
    out = torch.empty(q.shape, dtype=q.dtype)  # contiguous, as the kernel writes it (not ``q``'s strides)
    if batch == 0:
        return out
    q, tables = q.contiguous(), tables.contiguous()
    starts, ends = starts.contiguous(), ends.contiguous()
    sinks = None if sinks is None else sinks.float().contiguous()  # held until the call returns
    rc = fn(_DTYPES[q.dtype], head_dim, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
            tables.stride(0), starts.data_ptr(), ends.data_ptr(), None if sinks is None else sinks.data_ptr(),
            out.data_ptr(), batch, num_heads, num_kv_heads, bs, SPAN_BLOCKS, scale, softcap, int(VECTORIZED))
    if rc:
        raise ValueError(f"paged_decode: unsupported shape (head_dim {head_dim}, heads {num_heads}/{num_kv_heads}, "
                         f"block size {bs}; supported: head_dim in {HEAD_DIMS}, at most {MAX_GROUP} query heads "
                         f"a KV head, blocks of at most {MAX_BLOCK})")
    return out


_paged_decode_op = cpu_ops.define(
    "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor starts, Tensor ends, float scale, "
    "float softcap, Tensor? sinks) -> Tensor", _paged_decode, lambda q, *rest: torch.empty_like(q))


# bf16 steps rotate q and k and write the cache in ``rope_write`` (``KVLOOM_CPU_ROPE_WRITE=0``: the traced rotary and
# ``index_copy_``, to compare)
ROPE_ENABLED = os.environ.get("KVLOOM_CPU_ROPE_WRITE", "1") != "0"


def rope_serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether ``rope_write`` takes these: bf16 throughout, heads of an even size side by side in each row, the
    cache contiguous, and the kernel built."""
    if not _rope_built and not torch.compiler.is_compiling():  # (the lock is no code to trace)
        _load()
    head_dim = q.shape[-1]
    return (ROPE_ENABLED and _rope_built and head_dim % 2 == 0
            and q.dtype == k.dtype == v.dtype == k_cache.dtype == cos.dtype == torch.bfloat16
            and k_cache.is_contiguous()
            and all(x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == head_dim for x in (q, k, v)))


def rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor,
               write_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` [T, Hq, D] and ``k`` [T, Hkv, D] rotated by ``reference.rotary_tables``' ``cos``/``sin`` ([T, 1, D]),
    ``x * cos + swap(x) * sin`` in float32 rounded once to bf16, returned (new, contiguous); the rotated ``k`` and
    ``v`` written to the caches' rows ``write_rows`` ([T * Hkv], of the cache viewed as [-1, D]) in the same pass
    (where ``rope_serves``). One call a layer in place of the compiled step's rotary loops and ``index_copy_``s
    (25 us of a 32-row decode step's layer on a 2-core Zen 5, 1.3 ms of a 4,096-row prompt step's)."""
    _load()
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty(tokens, num_heads, head_dim, dtype=q.dtype)
    k_out = torch.empty(tokens, num_kv_heads, head_dim, dtype=k.dtype)
    if tokens == 0:
        return q_out, k_out
    cos, sin = cos.reshape(tokens, head_dim).contiguous(), sin.reshape(tokens, head_dim).contiguous()
    write_rows = write_rows.contiguous()
    _rope(head_dim, tokens, num_heads, num_kv_heads, q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
          v.data_ptr(), v.stride(0), cos.data_ptr(), sin.data_ptr(), q_out.data_ptr(), k_out.data_ptr(),
          k_cache.data_ptr(), v_cache.data_ptr(), write_rows.data_ptr())
    return q_out, k_out


rope_write_op = cpu_ops.define(
    "cpu_rope_write(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "Tensor write_rows) -> (Tensor, Tensor)", rope_write,
    lambda q, k, *rest: (q.new_empty(q.shape), k.new_empty(k.shape)))
