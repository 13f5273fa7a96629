// Short-block linear for x86 CPUs with AVX2 + FMA: y [n, out] = x [n, in] @ w [out, in]^T (+ bias), for the
// 1 to 16 rows of a decode, draft or verification step, float32 or bfloat16 weights.
//
// Why (specdec/kernels/cpu_rows.py has the measurements): the BLAS torch calls is built for big blocks. A
// short block is a stream of the weights past a few rows of x, so its speed is the speed the weights are
// read at; here every weight row is read once, 1 to 4 rows of it at a time, against up to 8 rows of x
// held in registers (more rows: the next 8 re-read the weight rows while they are still in L1), the
// output rows split between torch's intra-op threads. bfloat16 weights are widened to float32 in
// registers (a shift: bfloat16 is float32's top half), so a bfloat16 model reads half the bytes.
// Accumulation is float32 in 4 x 8 lanes; the result differs from the BLAS's in the last bits (another
// summation order), as the BLAS's own k-row and 1-row products differ from each other.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "cpu_vec.h"

namespace {

using specdec_cpu::hsum;
using specdec_cpu::load8;
using specdec_cpu::widen;

// R weight rows [n, n + R) against M rows of x (float32, [M, K], row stride K): out[m, n + r].
template <int M, int R, typename W, typename O>
inline void tile(const float* x, const W* w, const float* bias, O* out, int64_t n, int64_t N, int64_t K) {
  __m256 acc[R][M];
  for (int r = 0; r < R; r++)
    for (int m = 0; m < M; m++) acc[r][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; r++) wv[r] = load8(w + (n + r) * K + k);
    if ((k & 15) == 0)  // the next tile's rows, one cache line per row per 64 bytes of float32 read here
      for (int r = 0; r < R; r++) _mm_prefetch(reinterpret_cast<const char*>(w + (n + R + r) * K + k), _MM_HINT_T0);
    for (int m = 0; m < M; m++) {
      __m256 xv = load8(x + m * K + k);
      for (int r = 0; r < R; r++) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int m = 0; m < M; m++) {
      float s = hsum(acc[r][m]);
      for (int64_t j = k; j < K; j++) s += widen(w[(n + r) * K + j]) * x[m * K + j];
      if (bias) s += bias[n + r];
      out[m * N + n + r] = O(s);
    }
}

// Weight rows [n0, n1) against M <= 8 rows of x: R at a time, then one at a time.
template <int M, typename W, typename O>
void rows(const float* x, const W* w, const float* bias, O* out, int64_t n0, int64_t n1, int64_t N, int64_t K) {
  constexpr int R = M <= 2 ? 4 : M <= 3 ? 3 : M <= 6 ? 2 : 1;  // R * M accumulators + R weights + 1 x <= 16 registers
  int64_t n = n0;
  for (; n + R <= n1; n += R) tile<M, R>(x, w, bias, out, n, N, K);
  for (; n < n1; n++) tile<M, 1>(x, w, bias, out, n, N, K);
}

template <typename W, typename O>
void rows_any(int64_t M, const float* x, const W* w, const float* bias, O* out, int64_t n0, int64_t n1, int64_t N,
              int64_t K) {
  switch (M) {
    case 1: return rows<1>(x, w, bias, out, n0, n1, N, K);
    case 2: return rows<2>(x, w, bias, out, n0, n1, N, K);
    case 3: return rows<3>(x, w, bias, out, n0, n1, N, K);
    case 4: return rows<4>(x, w, bias, out, n0, n1, N, K);
    case 5: return rows<5>(x, w, bias, out, n0, n1, N, K);
    case 6: return rows<6>(x, w, bias, out, n0, n1, N, K);
    case 7: return rows<7>(x, w, bias, out, n0, n1, N, K);
    default: return rows<8>(x, w, bias, out, n0, n1, N, K);
  }
}

// Split the weight's rows evenly between torch's intra-op threads (in multiples of 4); within a thread,
// blocks of 64 weight rows meet x in chunks of 8 rows while the block is in cache.
template <typename W, typename O>
void product(const float* x, const W* w, const float* bias, O* out, int64_t M, int64_t N, int64_t K) {
  at::parallel_for(0, (N + 3) / 4, 4, [&](int64_t q0, int64_t q1) {
    const int64_t end = std::min(N, q1 * 4);
    for (int64_t n0 = q0 * 4; n0 < end; n0 += 64) {
      const int64_t n1 = std::min(end, n0 + 64);
      for (int64_t m = 0; m < M; m += 8)
        rows_any(std::min<int64_t>(8, M - m), x + m * K, w, bias, out + m * N, n0, n1, N, K);
    }
  });
}

at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rows_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "rows_linear: x [n, in] and weight [out, in], got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "rows_linear: x and weight both float32 or both bfloat16, got ", x.scalar_type(), " and ",
              weight.scalar_type());
  TORCH_CHECK(weight.is_contiguous(), "rows_linear: the weight must be contiguous");
  const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1);
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor bf;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "rows_linear: bias [out], got ", bias->sizes());
    bf = bias->to(at::kFloat).contiguous();
  }
  const float* b = bias.has_value() ? bf.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (weight.scalar_type() == at::kFloat)
    product(xf.data_ptr<float>(), weight.data_ptr<float>(), b, out.data_ptr<float>(), M, N, K);
  else
    product(xf.data_ptr<float>(), weight.data_ptr<c10::BFloat16>(), b, out.data_ptr<c10::BFloat16>(), M, N, K);
  return out;
}

}  // namespace

TORCH_LIBRARY(specdec_cpu, m) { m.def("rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(specdec_cpu, CPU, m) { m.impl("rows_linear", &rows_linear); }
