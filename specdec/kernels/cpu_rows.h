// The short-block product of cpu_rows.cpp as templates, for every kernel that multiplies by weights
// (cpu_rows.cpp's op, cpu_layer.cpp's decoder layer): y [M, N] = x [M, K] (float32) @ w [N, K]^T (+ bias).
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "cpu_vec.h"

namespace specdec_cpu {

// How far ahead of its reads a tile of 2 or more rows of x asks for its weight rows' lines (a prefetch a line;
// past a row's end it reaches the next row of the same stream, the next tile's). With several rows of x a
// line takes longer to consume, and the hardware prefetchers alone left the memory idle between tiles: the
// SmolLM2 step (AMD EPYC Zen 4, 2 threads, in-process A/B of 25 alternating rounds, 3-4 runs) 6-8 % faster for 4
// tokens in bfloat16 and 3-4 % for 8, 1-4 % for 4 in float32, level for 1, 2, 8 and 16 in float32 within the
// +-3 % these runs moved by (256 or 512 bytes ahead alike; 4 KB slower). One row of x asks further ahead
// instead (below).
constexpr int64_t PREFETCH_BYTES = 512;

// One row of x (a decode step's products; up to 3 on the AVX512-BF16 path) asks for its weight rows' lines
// further ahead and into L2 only: the memory, not the multiply-adds, sets that pace, and the hardware
// prefetchers alone left it below the streaming line between the short streams of a step's many products.
// AMD EPYC Zen 4, SmolLM2's weights, 2 threads, in-process A/B: bfloat16 (AVX512-BF16 path, one and two rows
// of x) 0.85x the time for the 210 products of a step and 0.91x the one-token step's 30 layers; float32 0.95x
// the layers (1, 2 or 4 KB ahead alike; 1 KB into L1, measured before, gained nothing).
constexpr int64_t ONE_ROW_PREFETCH_BYTES = 2048;

}  // namespace specdec_cpu

#include "cpu_rows_bf16.h"  // the bfloat16 x bfloat16 path on CPUs with AVX512-BF16 (uses the prefetch distances)

namespace specdec_cpu {

// R weight rows n, n + stride, ..., n + (R - 1) * stride against M rows of x (float32, [M, K], row stride K):
// out[m, n + r * stride].
template <int M, int R, typename W, typename O>
inline void tile(const float* x, const W* w, const float* bias, O* out, int64_t n, int64_t stride, int64_t N,
                 int64_t K) {
  __m256 acc[R][M];
  for (int r = 0; r < R; r++)
    for (int m = 0; m < M; m++) acc[r][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[R];
    // once a cache line: each weight row's line PREFETCH_BYTES on into L1, or with one row of x
    // ONE_ROW_PREFETCH_BYTES on into L2
    constexpr int64_t ahead = M == 1 ? ONE_ROW_PREFETCH_BYTES : PREFETCH_BYTES;
    constexpr auto hint = M == 1 ? _MM_HINT_T1 : _MM_HINT_T0;
    if (k % (64 / sizeof(W)) == 0)
      for (int r = 0; r < R; r++)
        _mm_prefetch(reinterpret_cast<const char*>(w + (n + r * stride) * K + k) + ahead, hint);
    for (int r = 0; r < R; r++) wv[r] = load8(w + (n + r * stride) * K + k);
    for (int m = 0; m < M; m++) {
      __m256 xv = load8(x + m * K + k);
      for (int r = 0; r < R; r++) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int m = 0; m < M; m++) {
      const int64_t row = n + r * stride;
      float s = hsum(acc[r][m]);
      for (int64_t j = k; j < K; j++) s += widen(w[row * K + j]) * x[m * K + j];
      if (bias) s += bias[row];
      out[m * N + row] = O(s);
    }
}

// Weight rows [n0, n1) against M <= 6 rows of x, as R streams: the range in R equal parts read side by side,
// one row of each part a tile (then the remainder one row at a time). Several streams far apart read memory
// faster than one: the hardware prefetchers run ahead on each (AMD EPYC, both threads, SmolLM2's weights: one
// token 38 GB/s float32, 36 bfloat16, against 25-26 reading the R rows of a tile next to each other with
// software prefetch; Qwen2.5-Coder-1.5B's bfloat16 weights 1.15-1.2x. Software prefetch on top measured
// slower.)
template <int M, typename W, typename O>
void rows(const float* x, const W* w, const float* bias, O* out, int64_t n0, int64_t n1, int64_t N, int64_t K) {
  constexpr int R = M <= 2 ? 4 : M <= 4 ? 3 : 2;  // R * M accumulators + R weights <= 16 registers
  const int64_t part = (n1 - n0) / R;
  for (int64_t i = 0; i < part; i++) tile<M, R>(x, w, bias, out, n0 + i, part, N, K);
  for (int64_t n = n0 + part * R; n < n1; n++) tile<M, 1>(x, w, bias, out, n, 1, N, K);
}

// One weight of a product_segments call: w [N, K], its bias [N] or null, its output out [M, N].
template <typename W, typename O>
struct Segment {
  const W* w;
  const float* bias;
  O* out;
  int64_t N;
};

// Several weights of the same K (a layer's q, k and v; its gate and up) in one parallel region: their rows, in
// quads, split evenly between torch's intra-op threads, so the threads meet once for all of them. Up to
// max_rows rows of x, a thread's rows of a weight are one block (its streams as long as they can be); more,
// blocks of 64 weight rows meet x in chunks of `chunk` rows while the block is in cache: for the AVX2 path 3
// streams of 12 products a step instead of one of 7 or 8 (1.1-1.4x for 7-16 rows on the AMD EPYC, kernel alone).
// rows_of(rows, m, segment, n0, n1): x's rows [m, m + rows) against the segment's weight rows [n0, n1).
template <typename W, typename O, typename Rows>
void split_segments(const Segment<W, O>* segments, size_t count, int64_t M, int64_t max_rows, int64_t chunk,
                    Rows&& rows_of) {
  std::vector<int64_t> first(count + 1, 0);  // each segment's first quad in the joint numbering
  for (size_t i = 0; i < count; i++) first[i + 1] = first[i] + (segments[i].N + 3) / 4;
  at::parallel_for(0, first[count], 4, [&](int64_t q0, int64_t q1) {
    for (size_t i = 0; i < count; i++) {
      const int64_t lo = std::max(q0, first[i]) - first[i], hi = std::min(q1, first[i + 1]) - first[i];
      if (lo >= hi) continue;
      const Segment<W, O>& s = segments[i];
      const int64_t end = std::min(s.N, hi * 4), block = M <= max_rows ? end : 64, step = M <= max_rows ? M : chunk;
      for (int64_t n0 = lo * 4; n0 < end; n0 += block) {
        const int64_t n1 = std::min(end, n0 + block);
        for (int64_t m = 0; m < M; m += step) rows_of(std::min(step, M - m), m, s, n0, n1);
      }
    }
  });
}

// x [M, K] times several weights of the same K (split_segments). bfloat16 weights on a CPU with AVX512-BF16
// (bf16_dot_enabled): x rounded to bfloat16 once (exact: see cpu_rows_bf16.h), up to 8 rows of x a tile.
template <typename W, typename O>
void product_segments(const float* x, const Segment<W, O>* segments, size_t count, int64_t M, int64_t K) {
#if SPECDEC_BF16_DOT
  if constexpr (std::is_same_v<W, c10::BFloat16>)
    if (bf16_dot_enabled().load(std::memory_order_relaxed)) {
      std::vector<uint16_t> xb(M * K);
      for (int64_t j = 0; j < M * K; j++) xb[j] = c10::BFloat16(x[j]).x;
      split_segments(segments, count, M, 8, 8, [&](int64_t rows, int64_t m, const Segment<W, O>& s, int64_t n0,
                                                   int64_t n1) {
        with_row_count<8>(rows, [&](auto count) {
          bf16_dot::rows<decltype(count)::value>(xb.data() + m * K, reinterpret_cast<const uint16_t*>(s.w), s.bias,
                                                 s.out + m * s.N, n0, n1, s.N, K);
        });
      });
      return;
    }
#endif
  split_segments(segments, count, M, 6, 4, [&](int64_t rows, int64_t m, const Segment<W, O>& s, int64_t n0,
                                               int64_t n1) {
    with_row_count<6>(rows, [&](auto count) {
      specdec_cpu::rows<decltype(count)::value>(x + m * K, s.w, s.bias, s.out + m * s.N, n0, n1, s.N, K);
    });
  });
}

// y [M, N] = x [M, K] @ w [N, K]^T (+ bias): one segment
template <typename W, typename O>
void product(const float* x, const W* w, const float* bias, O* out, int64_t M, int64_t N, int64_t K) {
  const Segment<W, O> one{w, bias, out, N};
  product_segments(x, &one, 1, M, K);
}

}  // namespace specdec_cpu
