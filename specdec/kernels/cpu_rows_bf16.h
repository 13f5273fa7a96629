// cpu_rows.h's short-block product for bfloat16 weights on CPUs with AVX512-BF16 (AMD Zen 4, Intel Cooper Lake,
// Sapphire Rapids and later): y [M, N] = x [M, K] @ w [N, K]^T (+ bias), w and x both bfloat16.
//
// Why: widening bfloat16 weights to float32 costs two instructions per 8 weights before the FMA, and with several
// rows of x (verification, trees) the products, not the memory, set the pace. vdpbf16ps multiplies 32 bfloat16
// pairs a register and adds them pairwise into 16 float32 lanes: one instruction where the AVX2 path spends
// three per 8 weights per row of x. bfloat16 x bfloat16 is exact in float32 (8 + 8 significant bits), so the
// products are the AVX2 path's; the sums run in another order (16 lanes of adjacent pairs, 32 weights a step),
// which moves the float32 result in its last bits, as any other BLAS would.
//
// x must hold bfloat16 values (widened to float32): every caller's does (rows_linear takes x of the weights'
// dtype; the decoder layer rounds each product's input to the model's dtype, as HF's modules store it), so the
// conversion below is exact.
//
// Compiled for AVX512 in this header only (the pragma below); called only where the CPU has the instructions
// (cpu_library.py asks /proc/cpuinfo and switches it on with set_bf16_dot).
#pragma once
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define SPECDEC_BF16_DOT 1
#else
#define SPECDEC_BF16_DOT 0  // the pragma below is GCC's; other compilers keep the AVX2 path
#endif

namespace specdec_cpu {

// Whether bfloat16 products take this path: off until the library's loader switches it on for a CPU with
// AVX512-BF16 (the ops read it; set_bf16_dot sets it)
inline std::atomic<bool>& bf16_dot_enabled() {
  static std::atomic<bool> enabled{false};
  return enabled;
}

}  // namespace specdec_cpu

#if SPECDEC_BF16_DOT
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")

namespace specdec_cpu::bf16_dot {

// R weight rows n, n + stride, ..., n + (R - 1) * stride against M rows of x (bfloat16 bits, [M, K], row stride
// K): out[m, n + r * stride].
template <int M, int R, typename O>
inline void tile(const uint16_t* x, const uint16_t* w, const float* bias, O* out, int64_t n, int64_t stride,
                 int64_t N, int64_t K) {
  __m512 acc[R][M];
  for (int r = 0; r < R; r++)
    for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512i wv[R];
    for (int r = 0; r < R; r++) {
      const uint16_t* wr = w + (n + r * stride) * K + k;
      if constexpr (M >= 4)  // cpu_rows.h's prefetch (PREFETCH_BYTES): once a 64-byte line, which is one step here
        _mm_prefetch(reinterpret_cast<const char*>(wr) + PREFETCH_BYTES, _MM_HINT_T0);
      else  // fewer rows: further ahead, into L2 (ONE_ROW_PREFETCH_BYTES: 0.84-0.85x the time at one and two rows)
        _mm_prefetch(reinterpret_cast<const char*>(wr) + ONE_ROW_PREFETCH_BYTES, _MM_HINT_T1);
      wv[r] = _mm512_loadu_si512(wr);
    }
    for (int m = 0; m < M; m++) {
      const __m512i xv = _mm512_loadu_si512(x + m * K + k);
      for (int r = 0; r < R; r++) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], (__m512bh)wv[r], (__m512bh)xv);
    }
  }
  if (k < K) {  // K's tail through masked loads, whose zeros add nothing
    const __mmask32 mask = __mmask32((1u << (K - k)) - 1);
    for (int m = 0; m < M; m++) {
      const __m512i xv = _mm512_maskz_loadu_epi16(mask, x + m * K + k);
      for (int r = 0; r < R; r++)
        acc[r][m] = _mm512_dpbf16_ps(acc[r][m], (__m512bh)_mm512_maskz_loadu_epi16(mask, w + (n + r * stride) * K + k),
                                     (__m512bh)xv);
    }
  }
  for (int r = 0; r < R; r++)
    for (int m = 0; m < M; m++) {
      const int64_t row = n + r * stride;
      float s = _mm512_reduce_add_ps(acc[r][m]);
      if (bias) s += bias[row];
      out[m * N + row] = O(s);
    }
}

// cpu_rows.h's rows for this path: the range in R streams read side by side. 32 registers: R * M accumulators
// + R weights + one x <= 32.
template <int M, typename O>
void rows(const uint16_t* x, const uint16_t* w, const float* bias, O* out, int64_t n0, int64_t n1, int64_t N,
          int64_t K) {
  constexpr int R = M <= 6 ? 4 : 3;
  const int64_t part = (n1 - n0) / R;
  for (int64_t i = 0; i < part; i++) tile<M, R>(x, w, bias, out, n0 + i, part, N, K);
  for (int64_t n = n0 + part * R; n < n1; n++) tile<M, 1>(x, w, bias, out, n, 1, N, K);
}

}  // namespace specdec_cpu::bf16_dot

#pragma GCC pop_options
#endif
